"""``kernelcache doctor`` in a good and in a broken environment, through the real CLI.

The good one is the environment the generation was built in; the broken one has a toolchain
that fails to import, a cache variable pointing where nothing can be written, the start-up
hook off, another arch and a changed kernel source: each must be named, as a table and as
JSON checked against ``docs/cli-schemas/doctor.json``.
"""

from __future__ import annotations

import shutil
import site
from contextlib import suppress
from pathlib import Path

import pytest

from kernelcache.doctor import HOOK_FILE
from kernelcache.errors import ExitCode
from tests.conftest import (
    REPO,
    DemoBuild,
    checked,
    needs_cute,
    run_kernelcache,
    subprocess_env,
)

pytestmark = needs_cute

# A toolchain whose import fails, as one does on a node without the driver library.
BROKEN_CUTLASS = """
import sys


class BrokenCutlass:
    def find_spec(self, name, path=None, target=None):
        if name == "cutlass":
            raise ImportError("libcuda.so.1: cannot open shared object file")


sys.meta_path.insert(0, BrokenCutlass())
"""


@pytest.fixture(scope="module")
def generation(demo_build: DemoBuild) -> Path:
    return demo_build.generation


@pytest.fixture
def hook_installed():
    """The start-up hook in site-packages, as the wheel installs it (left if it was there)."""
    target = Path(site.getsitepackages()[0]) / HOOK_FILE
    if target.exists():
        yield target
        return
    shutil.copy(REPO / "src" / HOOK_FILE, target)
    try:
        yield target
    finally:
        with suppress(FileNotFoundError):
            target.unlink()


def rows(payload: dict) -> dict[str, dict]:
    return {c["check"]: c for c in payload["checks"]}


def test_doctor_in_the_environment_the_generation_was_built_in(generation, hook_installed):
    spec_dir = generation.parents[4]  # <build>/store/default/demo/sm_90a/<generation>
    env = {
        "PYTHONPATH": f"{spec_dir}:{subprocess_env()['PYTHONPATH']}",
        "KERNELCACHE_RUNTIME": "1",
        "TRITON_CACHE_DIR": str(spec_dir / "triton-cache"),
    }
    proc = run_kernelcache("doctor", str(generation), "--arch", "sm_90a", "--json", **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = checked("doctor", proc.stdout)
    checks = rows(payload)
    assert payload["ok"] is True and payload["differences"] == []
    assert checks["gpu"]["detail"].startswith("arch sm_90a (given)")
    assert checks["toolchain/cute-dsl"]["status"] == "ok"
    assert "nvidia-cutlass-dsl==" in checks["toolchain/cute-dsl"]["detail"]
    assert checks["cache/TRITON_CACHE_DIR"] == {
        "check": "cache/TRITON_CACHE_DIR",
        "status": "ok",
        "detail": f"{spec_dir / 'triton-cache'} (writable)",
        "exit_code": 0,
    }
    assert checks["startup-hook"]["status"] == "ok", checks["startup-hook"]
    # every factor matches, and the CuTe-DSL kernels are keyed by their IR: no stamp says "a hit"
    assert checks["stamp"]["status"] == "info" and "a hit" not in checks["stamp"]["detail"]
    assert "every factor matches" in checks["stamp"]["detail"]
    assert "keyed by their traced IR" in checks["stamp"]["detail"]

    table = run_kernelcache("doctor", str(generation), "--arch", "sm_90a", **env)
    assert table.returncode == 0
    assert "kernelcache doctor" in table.stdout and "every factor matches" in table.stdout
    assert "\x1b" not in table.stdout


def test_doctor_names_what_is_broken(generation, tmp_path):
    spec_dir = generation.parents[4]
    broken = tmp_path / "broken"
    broken.mkdir()
    # The DSL puts its own packages first on sys.path: fail its import from a finder instead.
    (broken / "sitecustomize.py").write_text(BROKEN_CUTLASS)
    (broken / "demo_kernels.py").write_text((spec_dir / "demo_kernels.py").read_text() + "#\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    env = {
        "PYTHONPATH": f"{broken}:{subprocess_env()['PYTHONPATH']}",
        "TRITON_CACHE_DIR": str(a_file / "triton"),
        "KERNELCACHE_RUNTIME": "1",  # asked for, and no hook installed to start it
    }
    proc = run_kernelcache("doctor", str(generation), "--arch", "sm_120a", "--json", **env)
    payload = checked("doctor", proc.stdout)
    checks = rows(payload)
    assert proc.returncode == ExitCode.NOT_INSTALLED == payload["exit_code"]  # the first failure
    assert checks["toolchain/cute-dsl"]["status"] == "fail"
    assert "libcuda.so.1: cannot open shared object file" in checks["toolchain/cute-dsl"]["detail"]
    assert checks["cache/TRITON_CACHE_DIR"]["status"] == "warn"
    assert "not writable" in checks["cache/TRITON_CACHE_DIR"]["detail"]
    assert checks["startup-hook"]["status"] == "warn"
    assert "nothing starts the runtime" in checks["startup-hook"]["detail"]
    assert checks["stamp"]["status"] == "fail"
    assert checks["stamp"]["exit_code"] == ExitCode.STAMP_MISMATCH
    differing = {d["factor"]: d for d in payload["differences"]}
    assert differing["arch"] == {"factor": "arch", "generation": "sm_90a", "here": "sm_120a"}

    table = run_kernelcache("doctor", str(generation), "--arch", "sm_120a", **env)
    assert table.returncode == ExitCode.NOT_INSTALLED
    assert "would miss: arch: sm_90a != sm_120a" in table.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU is visible here")
def test_doctor_without_a_gpu_or_arch_fails_on_the_arch(generation):
    proc = run_kernelcache("doctor", str(generation), "--json", CUTE_DSL_ARCH="")
    payload = checked("doctor", proc.stdout)
    assert proc.returncode == ExitCode.NO_GPU_INFO
    assert rows(payload)["gpu"]["status"] == "fail"
    assert "nvidia-smi" in rows(payload)["gpu"]["detail"]
    assert "name this node's arch with --arch (e.g. sm_90a)" in rows(payload)["gpu"]["detail"]
    # every other check is still reported
    assert rows(payload)["toolchain/cute-dsl"]["status"] == "ok"
    assert rows(payload)["stamp"]["exit_code"] == ExitCode.NO_GPU_INFO


def test_doctor_against_a_spec_and_its_store(generation):
    spec_dir = generation.parents[4]
    spec, store = spec_dir / "kc.yaml", spec_dir / "store"
    env = {"PYTHONPATH": f"{spec_dir}:{subprocess_env()['PYTHONPATH']}"}
    args = ("doctor", "-f", str(spec), "--store", str(store), "--json")
    proc = run_kernelcache(*args, "--arch", "sm_90a", **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = rows(checked("doctor", proc.stdout))
    assert checks["stamp"]["detail"].startswith(f"generation {generation.name}:")
    assert checks["toolchain/cute-dsl"]["status"] == "ok"

    unbuilt = run_kernelcache(*args, "--arch", "sm_120a", **env)
    assert unbuilt.returncode == ExitCode.MISSING_GENERATION
    checks = rows(checked("doctor", unbuilt.stdout))  # a row, and every other check after it
    assert checks["generation"]["status"] == "fail"
    assert "default/demo/sm_120a: no published generation" in checks["generation"]["detail"]
    assert checks["toolchain/cute-dsl"]["status"] == "ok" and "startup-hook" in checks

    spec_only = run_kernelcache("doctor", "-f", str(spec), "--json", CUTE_DSL_ARCH="", **env)
    payload = checked("doctor", spec_only.stdout)
    assert "stamp" not in rows(payload) and payload["differences"] == []
    # Without a generation an arch is not needed: no GPU here is worth knowing, no failure.
    assert spec_only.returncode == 0 and rows(payload)["gpu"]["status"] in ("ok", "info")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU is visible here")
def test_doctor_of_a_spec_and_store_without_a_gpu_reports_every_check(generation):
    """No GPU: not one line and a stop, but the gpu row naming --arch with the spec's
    arches, the generation row saying why none was picked, and every other check."""
    spec_dir = generation.parents[4]
    env = {"PYTHONPATH": f"{spec_dir}:{subprocess_env()['PYTHONPATH']}", "CUTE_DSL_ARCH": ""}
    args = ("doctor", "-f", str(spec_dir / "kc.yaml"), "--store", str(spec_dir / "store"))
    proc = run_kernelcache(*args, "--json", **env)
    assert proc.returncode == ExitCode.NO_GPU_INFO, proc.stderr
    checks = rows(checked("doctor", proc.stdout))
    assert "--arch (sm_120a or sm_90a)" in checks["gpu"]["detail"]
    assert checks["generation"]["detail"].endswith("--arch sm_120a or sm_90a")
    assert checks["toolchain/cute-dsl"]["status"] == "ok"
    assert {"startup-hook", "cache/TRITON_CACHE_DIR"} <= set(checks)


def test_doctor_after_a_build_warns_only_of_what_to_act_on(generation):
    """Straight after a build, on a machine without a GPU or the runtime's hook: what is
    worth knowing is info (no GPU needed to build, toolchains no spec asked for, the hook
    serving code starts), not a warning."""
    env = {"KERNELCACHE_RUNTIME": "", "CUTE_DSL_ARCH": ""}
    env.update({var: "" for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")})
    proc = run_kernelcache("doctor", "--json", **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = rows(checked("doctor", proc.stdout))
    warned = {n: c["detail"] for n, c in checks.items() if c["status"] == "warn"}
    # left: only a toolchain installed here that fails to import, which is worth fixing
    assert all(n.startswith("toolchain/") and "import" in d for n, d in warned.items()), warned
    assert checks["startup-hook"]["status"] in ("ok", "info")
    assert checks["gpu"]["status"] in ("ok", "info")


def test_doctor_wraps_words_whole_on_a_narrow_terminal(generation):
    """At 60 columns the table gives way to records, every word whole: no path, version or
    file name broken across lines."""
    args = ("doctor", str(generation), "--arch", "sm_90a")
    proc = run_kernelcache(*args, COLUMNS="60", KERNELCACHE_RUNTIME="")
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 60 for line in lines), proc.stdout
    assert any(line.strip() == "startup-hook  info" for line in lines), proc.stdout
    text = " ".join(lines)
    for word in ("nvidia-cutlass-dsl==", HOOK_FILE, "KERNELCACHE_CUTE_DSL_DIR"):
        assert word in text, proc.stdout
