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
    one_line_error,
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
    assert checks["stamp"]["status"] == "ok" and "a hit" in checks["stamp"]["detail"]

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
        "KERNELCACHE_RUNTIME": "",
    }
    proc = run_kernelcache("doctor", str(generation), "--arch", "sm_120a", "--json", **env)
    payload = checked("doctor", proc.stdout)
    checks = rows(payload)
    assert proc.returncode == ExitCode.WARM_FAILED == payload["exit_code"]  # the first failure
    assert checks["toolchain/cute-dsl"]["status"] == "fail"
    assert "libcuda.so.1: cannot open shared object file" in checks["toolchain/cute-dsl"]["detail"]
    assert checks["cache/TRITON_CACHE_DIR"]["status"] == "warn"
    assert "not writable" in checks["cache/TRITON_CACHE_DIR"]["detail"]
    assert checks["startup-hook"]["status"] == "warn"
    assert checks["stamp"]["status"] == "fail"
    assert checks["stamp"]["exit_code"] == ExitCode.STAMP_MISMATCH
    differing = {d["factor"]: d for d in payload["differences"]}
    assert differing["arch"] == {"factor": "arch", "generation": "sm_90a", "here": "sm_120a"}

    table = run_kernelcache("doctor", str(generation), "--arch", "sm_120a", **env)
    assert table.returncode == ExitCode.WARM_FAILED
    assert "would miss: arch: sm_90a != sm_120a" in table.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU is visible here")
def test_doctor_without_a_gpu_or_arch_fails_on_the_arch(generation):
    proc = run_kernelcache("doctor", str(generation), "--json", CUTE_DSL_ARCH="")
    payload = checked("doctor", proc.stdout)
    assert proc.returncode == ExitCode.NO_GPU_INFO
    assert rows(payload)["gpu"]["status"] == "fail"
    assert "nvidia-smi" in rows(payload)["gpu"]["detail"]


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
    assert "default/demo/sm_120a: no published generation" in one_line_error(unbuilt)

    spec_only = run_kernelcache("doctor", "-f", str(spec), "--json", CUTE_DSL_ARCH="", **env)
    payload = checked("doctor", spec_only.stdout)
    assert "stamp" not in rows(payload) and payload["differences"] == []
    # Without a generation an arch is not needed: no GPU here is a warning, not a failure.
    assert spec_only.returncode == 0 and rows(payload)["gpu"]["status"] in ("ok", "warn")
