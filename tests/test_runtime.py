"""kernelcache.runtime in real serving processes: a warmed generation compiles nothing, the
same process without it compiles and says so, strict mode refuses in one line.

Each case runs ``tests/helpers/runtime_serve.py`` in a fresh process (the runtime hooks
imports and reads its environment once) and reads the metrics text it prints. CuTe-DSL and
Triton compile for sm_90 on the CPU and torch.compile uses inductor's C++ backend; the tests
marked ``gpu`` launch Triton's JIT and torch.compile on a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kernelcache import stamp as stamps
from kernelcache.contract import Settings
from kernelcache.errors import ExitCode, SpecError
from kernelcache.runtime import metrics
from kernelcache.runtime.imports import when_imported
from kernelcache.store import Store, materialize, verify
from kernelcache.toolchains import inductor
from kernelcache.toolchains.flashinfer import BuildLogTail
from tests.conftest import (
    REPO,
    SMALL_WORKLOAD,
    DemoBuild,
    free_port,
    needs_cute,
    publish_files,
    scaled,
    serve_python,
    subprocess_env,
    system_tool,
    wait_until,
)

HELPER = Path(__file__).parent / "helpers" / "runtime_serve.py"
PTH = REPO / "src" / "zz_kernelcache_runtime.pth"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def needs_torch(test: Callable[..., None]) -> Callable[..., None]:
    """torch.compile on the CPU: torch, and g++ for inductor's C++ backend."""
    skip = pytest.mark.skipif(not _importable("torch"), reason="torch is not installed")
    return skip(pytest.mark.usefixtures("cxx")(test))


@pytest.fixture
def cxx() -> str:
    return system_tool("g++")


needs_triton = pytest.mark.skipif(not _importable("triton"), reason="triton is not installed")
needs_gpu = pytest.mark.skipif(
    shutil.which("nvidia-smi") is None or not _importable("torch"), reason="needs a CUDA GPU"
)


# --------------------------------------------------------------------------- helpers


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Samples, metric: str, /, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == metric and want <= ls)


def kernels(samples: Samples, toolchain: str) -> dict[str, float]:
    return {
        dict(ls)["kernel"]: v
        for (n, ls), v in samples.items()
        if n == "kernelcache_cold_compiles_total" and ("toolchain", toolchain) in ls
    }


def serve(*args: str, **env: str) -> tuple[subprocess.CompletedProcess, Samples]:
    """Run the serving helper; its metrics (empty when it failed before reporting)."""
    proc = serve_python(HELPER, *args, **env)
    _, marker, text = proc.stdout.partition("--- metrics\n")
    return proc, parse(text) if marker else {}


def skip_to_metrics(stdout: Any) -> None:
    """Read a serving helper's output up to its metrics marker; fail if it ends first."""
    for line in stdout:
        if line == "--- metrics\n":
            return
    raise AssertionError("the serving helper ended before printing its metrics")


def triton_elsewhere(block: int) -> list[str]:
    """A process without the kernelcache runtime that compiles the helper's Triton kernel."""
    return [sys.executable, "-c", f"import runtime_serve; runtime_serve.run_triton({block}, False)"]


def helper_env(**env: str) -> dict[str, str]:
    """``subprocess_env`` with the helpers folder importable (``runtime_serve``)."""
    pythonpath = os.pathsep.join([str(HELPER.parent), subprocess_env()["PYTHONPATH"]])
    return subprocess_env(PYTHONPATH=pythonpath, **env)


@pytest.fixture
def pth_hook(tmp_path):
    """Install the ``.pth`` hook where a child Python runs it at start, as an installed one does.

    Outside a virtualenv the hook goes into a user site directory of its own. A virtualenv
    ignores user site directories, so there it goes into the venv's own site-packages for the
    test (inert there: it acts only when ``KERNELCACHE_RUNTIME=1``) and is removed after.
    Returns a function giving the child's environment.
    """
    if site.ENABLE_USER_SITE:
        base = tmp_path / "userbase"
        vars_ = {"userbase": str(base)}
        site_dir = Path(sysconfig.get_path("purelib", f"{os.name}_user", vars=vars_))
        extra = {"PYTHONUSERBASE": str(base)}
    else:
        site_dir, extra = Path(sysconfig.get_path("purelib")), {}
    site_dir.mkdir(parents=True, exist_ok=True)
    installed = site_dir / f"zz_test_{os.getpid()}_{PTH.name}"
    shutil.copy(PTH, installed)

    def env_for(pythonpath: str | None = None) -> dict[str, str]:
        # Python reads a user site before the system site-packages, where kernelcache's
        # dependencies are, so those go on PYTHONPATH too.
        path = pythonpath or subprocess_env()["PYTHONPATH"]
        return {
            **extra,
            "PYTHONPATH": os.pathsep.join([path, sysconfig.get_path("purelib")]),
            "KERNELCACHE_RUNTIME": "1",
        }

    yield env_for
    installed.unlink()


def make_generation(root: Path, files: dict[str, bytes], **factors: str) -> Path:
    """A published generation holding ``files``, stamped for this environment."""
    store = Store(root)
    key = "default/demo/sm_90a"
    stamp = stamps.collect(arch="sm_90a", distributions=list(factors))
    publish_files(store, key, files, stamp.to_dict(), {"warmers": []})
    generation = store.current(key)
    assert generation is not None
    return generation


# --------------------------------------------------------------------------- configuration


def test_config_reads_the_environment_contract(tmp_path):
    config = Settings.from_env(
        {
            "KERNELCACHE_DIR": str(tmp_path),
            "KERNELCACHE_STRICT": "1",
            "KERNELCACHE_METRICS_PORT": "9400",
            "KERNELCACHE_NAME": "llm/qwen",
            "KERNELCACHE_ARCH": "sm_90a",
            "FLASHINFER_JIT_BUILD_LOG": str(tmp_path / "builds.jsonl"),
            "KERNELCACHE_FLASHINFER_MIN_BUILD_S": "2",
        }
    )
    assert config.generation_dir == tmp_path and config.strict and config.metrics_port == 9400
    assert (config.name, config.arch) == ("llm/qwen", "sm_90a")
    assert config.flashinfer_build_log == tmp_path / "builds.jsonl"
    assert config.flashinfer_min_build_seconds == 2.0
    assert Settings.from_env({}) == Settings()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KERNELCACHE_STRICT", "maybe"),
        ("KERNELCACHE_METRICS_PORT", "http"),
        ("KERNELCACHE_POLL_S", "-1"),
    ],
)
def test_a_malformed_variable_is_named(name, value):
    with pytest.raises(SpecError, match=name):
        Settings.from_env({name: value})


def test_install_points_unset_cache_variables_and_disables_jit_only_with_aot(
    tmp_path,
):
    script = (
        "import json, os; from kernelcache import runtime; r = runtime.install(); "
        "print(json.dumps({'set': r.env, 'triton': os.environ['TRITON_CACHE_DIR']}))"
    )

    def installed(generation: Path, **env: str) -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            env=subprocess_env(
                KERNELCACHE_DIR=str(generation), TRITON_CACHE_DIR="/users/own", **env
            ),
            capture_output=True,
            text=True,
            timeout=scaled(120),
        )
        assert proc.returncode == 0, proc.stderr
        assert "imported before" not in proc.stderr  # installed first: nothing to warn of
        return json.loads(proc.stdout)

    with_aot = make_generation(tmp_path / "a", {"flashinfer/aot/decode/decode.so": b"\x7fELF"})
    strict = installed(with_aot, KERNELCACHE_STRICT="1")
    files = with_aot / "files"
    assert strict["triton"] == "/users/own" and "TRITON_CACHE_DIR" not in strict["set"]
    assert strict["set"]["TORCHINDUCTOR_CACHE_DIR"] == str(files / "inductor")
    assert strict["set"]["KERNELCACHE_CUTE_DSL_DIR"] == str(files / "cute-dsl")
    assert strict["set"]["FLASHINFER_WORKSPACE_BASE"] == str(files / "flashinfer")
    assert strict["set"]["FLASHINFER_DISABLE_JIT"] == "1"
    assert "FLASHINFER_DISABLE_JIT" not in installed(with_aot)["set"]  # permissive

    without_aot = make_generation(tmp_path / "b", {"flashinfer/workspace/x.so": b"\x7fELF"})
    assert "FLASHINFER_DISABLE_JIT" not in installed(without_aot, KERNELCACHE_STRICT="1")["set"]


@needs_torch
def test_install_after_importing_inductor_still_serves_inductor_from_the_generation(tmp_path):
    """Importing torch._inductor writes its default cache dir into the environment; install()
    must not take that for the user's choice, while a directory the user named stays, and
    it warns that what inductor read at import stays as it was."""
    generation = make_generation(tmp_path / "g", {"cute-dsl/k.o": b"\x7fELF"})
    script = (
        "import os, torch._inductor.compile_fx; from kernelcache import runtime\n"
        "runtime.install(); print(os.environ['TORCHINDUCTOR_CACHE_DIR'])\n"
    )

    def inductor_dir(**env: str) -> str:
        environment = subprocess_env(KERNELCACHE_DIR=str(generation), **env)
        if not env:
            environment.pop("TORCHINDUCTOR_CACHE_DIR", None)
        proc = subprocess.run(
            [sys.executable, "-c", script],
            env=environment,
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        assert proc.returncode == 0, proc.stderr
        # what cannot be mended any more is said: the compile-worker count was read at import
        assert "torch._inductor was imported before kernelcache.runtime.install()" in proc.stderr
        return proc.stdout.strip()

    assert inductor_dir() == str(generation / "files" / "inductor")
    own = str(tmp_path / "own")
    assert inductor_dir(TORCHINDUCTOR_CACHE_DIR=own) == own


def test_the_init_containers_env_file_names_the_generation(tmp_path):
    """The webhook sets KERNELCACHE_ENV_FILE; the init-container wrote the generation there."""
    generation = make_generation(tmp_path / "store", {"cute-dsl/k.o": b"\x7fELF"})
    env_file = tmp_path / "kernelcache.env"
    env_file.write_text(f"KERNELCACHE_DIR='{generation}'\nKERNELCACHE_NAME='demo name'\n")
    script = (
        "import json; from kernelcache import runtime; r = runtime.install()\n"
        "print(json.dumps([r.manifest.generation, r.config.name]))\n"
    )

    def run(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", script],
            env=subprocess_env(**env),
            capture_output=True,
            text=True,
            timeout=scaled(120),
        )

    proc = run(KERNELCACHE_ENV_FILE=str(env_file))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [generation.name, "demo name"]
    missing = run(KERNELCACHE_ENV_FILE=str(tmp_path / "absent.env"), KERNELCACHE_STRICT="1")
    assert missing.returncode != 0
    assert "absent.env: cannot read" in missing.stderr


@pytest.mark.skipif(not _importable("flashinfer"), reason="flashinfer is not installed")
def test_flashinfer_finds_its_aot_modules_in_the_generation(tmp_path):
    generation = make_generation(tmp_path, {"flashinfer/aot/decode/decode.so": b"\x7fELF"})
    script = (
        "from kernelcache import runtime; runtime.install()\n"
        "from flashinfer.jit import env\n"
        "print(env.get_aot_path('decode'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=subprocess_env(KERNELCACHE_DIR=str(generation)),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(generation / "files/flashinfer/aot/decode/decode.so")


def test_when_imported_runs_after_the_module_and_leaves_it_its_loader(tmp_path, monkeypatch):
    (tmp_path / "kc_probe_module.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("kc_probe_module", lambda module: seen.append(module.VALUE + 1))
    assert seen == []
    import kc_probe_module  # type: ignore[import-not-found]

    assert seen == [42]
    assert type(kc_probe_module.__loader__).__name__ == "SourceFileLoader"
    when_imported("kc_probe_module", lambda module: seen.append(0))  # already imported: now
    assert seen == [42, 0]
    monkeypatch.delitem(sys.modules, "kc_probe_module")


def test_when_imported_survives_a_find_spec_probe_before_the_import(tmp_path, monkeypatch):
    """torch asks ``importlib.util.find_spec("triton")`` before it imports Triton: the probe
    finds the module without running it, and the import after it must still notify, once."""
    import importlib.util

    (tmp_path / "kc_probed_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("kc_probed_module", lambda module: seen.append(module.VALUE))
    assert importlib.util.find_spec("kc_probed_module") is not None
    assert seen == []
    import kc_probed_module  # type: ignore[import-not-found]  # noqa: F401

    assert seen == [1]
    monkeypatch.delitem(sys.modules, "kc_probed_module")
    importlib.import_module("kc_probed_module")  # imported again: callbacks ran already
    assert seen == [1]
    monkeypatch.delitem(sys.modules, "kc_probed_module")


# --------------------------------------------------------------------------- cute-dsl


@pytest.fixture(scope="module")
def cute_generation(tmp_path_factory, demo_build: DemoBuild) -> Path:
    """The example spec built for sm_90a and materialized, as the init-container leaves it."""
    serve = tmp_path_factory.mktemp("cute") / "serve"
    return materialize(verify(demo_build.generation), serve)


@needs_cute
def test_a_warmed_generation_serves_with_zero_cold_compiles(cute_generation):
    proc, samples = serve(
        "--cute", json.dumps(SMALL_WORKLOAD), KERNELCACHE_DIR=str(cute_generation)
    )
    assert proc.returncode == 0, proc.stderr
    assert kernels(samples, "cute-dsl") == {}
    assert total(samples, "kernelcache_cache_hits_total", toolchain="cute-dsl") == 2
    assert total(samples, "kernelcache_stamp_mismatch") == 0
    assert total(samples, "kernelcache_verify_failures_total") == 0
    info = {
        "name": "default/demo",
        "arch": "sm_90a",
        "generation": cute_generation.name,
    }
    assert total(samples, "kernelcache_generation_info", **info) == 1
    assert "cold compile" not in proc.stderr


@needs_cute
def test_without_the_generation_every_kernel_is_a_cold_compile(tmp_path):
    proc, samples = serve(
        "--cute", json.dumps(SMALL_WORKLOAD), KERNELCACHE_CUTE_DSL_DIR=str(tmp_path / "empty")
    )
    assert proc.returncode == 0, proc.stderr
    assert kernels(samples, "cute-dsl") == {"demo_kernels:add": 1, "demo_kernels:scale_tiled": 1}
    assert total(samples, "kernelcache_compile_seconds_count", toolchain="cute-dsl") == 2
    assert total(samples, "kernelcache_cache_hits_total", toolchain="cute-dsl") == 0
    assert "cold compile in serving: cute-dsl kernel demo_kernels:add" in proc.stderr


@needs_cute
def test_strict_mode_refuses_a_kernel_missing_from_the_generation_in_one_line(cute_generation):
    wider = {**SMALL_WORKLOAD, "dtypes": ["float16", "float32"]}  # float32 was never warmed
    proc, _ = serve(
        "--cute", json.dumps(wider), KERNELCACHE_DIR=str(cute_generation), KERNELCACHE_STRICT="1"
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kernelcache.errors.ColdCompileError: cute-dsl: demo_kernels:add in")
    assert "no kernel compiled from this IR" in last and "nearest recorded kernel" in last


@needs_cute
def test_stamp_mismatch_is_a_metric_and_a_line_and_strict_refuses(
    cute_generation, tmp_path, pth_hook
):
    # A setting that changes compiled code, set in serving but not at the build.
    env = {"KERNELCACHE_DIR": str(cute_generation), "CUTE_DSL_LINEINFO": "1"}
    proc, samples = serve("--cute", json.dumps(SMALL_WORKLOAD), **env)
    assert proc.returncode == 0, proc.stderr
    assert total(samples, "kernelcache_stamp_mismatch") == 1
    assert total(samples, "kernelcache_verify_failures_total", reason="stamp_mismatch") == 1
    (line,) = [x for x in proc.stderr.splitlines() if "stamp mismatch" in x]
    assert line.startswith("kernelcache: stamp mismatch: setting/CUTE_DSL_LINEINFO:")
    # It changes what each kernel traces to as well: both kernels compile.
    assert set(kernels(samples, "cute-dsl")) == {"demo_kernels:add", "demo_kernels:scale_tiled"}

    # Strict, installed by the .pth hook at interpreter start: refuses before the script runs.
    env |= pth_hook()
    refused, _ = serve("--cute", json.dumps(SMALL_WORKLOAD), KERNELCACHE_STRICT="1", **env)
    assert refused.returncode == ExitCode.STAMP_MISMATCH, refused.stderr
    assert refused.stdout == ""
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("kernelcache: stamp mismatch: setting/CUTE_DSL_LINEINFO:")


@needs_cute
def test_metrics_endpoint_serves_every_series_with_its_labels(cute_generation, tmp_path, pth_hook):
    port = free_port()
    env = pth_hook() | {
        "KERNELCACHE_DIR": str(cute_generation),
        "KERNELCACHE_METRICS_PORT": str(port),
        "KERNELCACHE_METRICS_ADDRESS": "127.0.0.1",
        "KERNELCACHE_NAME": "llm/demo",
    }
    wider = {**SMALL_WORKLOAD, "tiles": [[32, 32], [64, 64]]}  # one tile size was never warmed
    proc = subprocess.Popen(
        [sys.executable, str(HELPER), "--serve", "--cute", json.dumps(wider)],
        env=subprocess_env(**env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"serving {port}"
        skip_to_metrics(proc.stdout)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            samples = parse(response.read().decode())
    finally:
        proc.communicate(input="", timeout=scaled(60))
    assert (
        samples[
            (
                "kernelcache_cold_compiles_total",
                frozenset({"toolchain": "cute-dsl", "kernel": "demo_kernels:scale_tiled"}.items()),
            )
        ]
        == 1
    )
    assert (
        total(samples, "kernelcache_compile_seconds_bucket", toolchain="cute-dsl", le="+Inf") == 1
    )
    assert total(samples, "kernelcache_cache_hits_total", toolchain="cute-dsl") == 2
    info = {
        "name": "llm/demo",
        "arch": "sm_90a",
        "generation": cute_generation.name,
        "stamp": json.loads((cute_generation / "MANIFEST.json").read_text())["stamp"]["digest"],
    }
    assert samples[("kernelcache_generation_info", frozenset(info.items()))] == 1
    assert samples[("kernelcache_stamp_mismatch", frozenset())] == 0
    for toolchain in metrics.TOOLCHAINS:  # every toolchain's series exist before any event
        assert ("kernelcache_cache_hits_total", frozenset({("toolchain", toolchain)})) in samples


# --------------------------------------------------------------------------- torch.compile


@pytest.fixture(scope="module")
def megacache_run(tmp_path_factory) -> tuple[Samples, Path]:
    """A cold torch.compile of the helper's MLP that saves its Mega-Cache into a generation."""
    tmp = tmp_path_factory.mktemp("torch")
    megacache = tmp / "megacache.bin"
    proc, samples = serve(
        "--torch", "8", "--save-megacache", str(megacache),
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "warm-inductor"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    generation = make_generation(
        tmp / "store", {"torch-compile/megacache.bin": megacache.read_bytes()}, torch="torch"
    )
    return samples, generation


@needs_torch
def test_torch_compile_without_a_cache_is_a_cold_compile_of_the_frame(megacache_run):
    samples, _ = megacache_run
    ((kernel, count),) = kernels(samples, "inductor").items()
    assert kernel.startswith("forward (runtime_serve.py:") and count == 1
    assert total(samples, "kernelcache_compile_seconds_count", toolchain="inductor") == 1


@needs_torch
def test_torch_megacache_serves_a_fresh_process_with_zero_inductor_misses(megacache_run, tmp_path):
    _, generation = megacache_run
    proc, samples = serve(
        "--torch", "8",
        KERNELCACHE_DIR=str(generation), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert kernels(samples, "inductor") == {}
    assert total(samples, "kernelcache_cache_hits_total", toolchain="inductor") == 1


@needs_torch
def test_strict_mode_refuses_an_inductor_miss_before_compiling(megacache_run, tmp_path):
    _, generation = megacache_run
    proc, samples = serve(
        "--torch", "4",  # another batch size: another graph, not in the cache
        KERNELCACHE_DIR=str(generation), KERNELCACHE_STRICT="1",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )  # fmt: skip
    assert proc.returncode != 0 and samples == {}
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("ColdCompileError:")]
    assert line.startswith("ColdCompileError: inductor: cold compile of forward (runtime_serve.py:")
    assert "in strict mode (FX graph not in the cache at" in line


@pytest.mark.gpu
@needs_gpu
def test_torch_compile_on_a_gpu_serves_from_the_megacache(tmp_path):
    megacache = tmp_path / "megacache.bin"
    proc, cold = serve(
        "--torch", "8", "--device", "cuda", "--save-megacache", str(megacache),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cold"),
        TRITON_CACHE_DIR=str(tmp_path / "triton-cold"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len(kernels(cold, "inductor")) == 1
    generation = make_generation(
        tmp_path / "store", {"torch-compile/megacache.bin": megacache.read_bytes()}, torch="torch"
    )
    proc, warm = serve(
        "--torch", "8", "--device", "cuda",
        KERNELCACHE_DIR=str(generation),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-warm"),
        TRITON_CACHE_DIR=str(tmp_path / "triton-warm"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert kernels(warm, "inductor") == {}
    assert total(warm, "kernelcache_cache_hits_total", toolchain="inductor") == 1


@needs_triton
def test_tuned_kernels_from_a_generation_are_final_and_found_in_this_processes_cache(
    tmp_path, monkeypatch
):
    """Inductor's own autotuner, patched as serving patches it. A kernel whose config was a
    hit in the generation's autotune cache is not tuned again; one that was not is. A kernel
    bundled with a cached graph names its module by the warm's staging path; its tuned config
    is looked up beside the module in this process's inductor cache instead."""
    # set first: importing inductor writes its default cache dir into this process's
    # environment, which the tests after this one hand to their children
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    from torch._inductor.runtime import triton_heuristics

    autotuner = triton_heuristics.CachingAutotuner
    tuned, looked_up = [], []
    monkeypatch.setattr(
        autotuner, "coordinate_descent_tuning", lambda self, launcher: tuned.append(launcher)
    )
    monkeypatch.setattr(
        autotuner, "recheck_autotune_cache", lambda self, **_: looked_up.append(self.filename)
    )
    inductor._keep_tuned_configs(triton_heuristics)

    kernel = object.__new__(autotuner)
    kernel.autotune_cache_info = {"autotune_cache_state": "hit"}
    assert kernel.coordinate_descent_tuning("launcher") == "launcher" and tuned == []
    kernel.autotune_cache_info = {"autotune_cache_state": "miss"}
    kernel.coordinate_descent_tuning("launcher")
    assert tuned == ["launcher"]

    kernel.filename = "/store/staging-gone/files/inductor/q3/cq36s62upuwf.py"
    kernel.recheck_autotune_cache(reload_kernel_from_src=None)
    assert looked_up == [str(tmp_path / "inductor" / "q3" / "cq36s62upuwf.py")]


# --------------------------------------------------------------------------- triton


@needs_triton
@pytest.mark.parametrize(
    "launch",
    [
        pytest.param(False, id="compile-for-sm90"),
        pytest.param(True, id="jit-launch", marks=[pytest.mark.gpu, needs_gpu]),
    ],
)
def test_triton_counts_real_compiles_not_disk_hits_and_strict_refuses_first(tmp_path, launch):
    cache = tmp_path / "triton"
    run = ["--launch"] if launch else []
    proc, cold = serve("--triton", "128", *run, TRITON_CACHE_DIR=str(cache))
    assert proc.returncode == 0, proc.stderr
    assert kernels(cold, "triton") == {"vector_add": 1}
    assert total(cold, "kernelcache_compile_seconds_count", toolchain="triton") == 1

    proc, warm = serve("--triton", "128", *run, TRITON_CACHE_DIR=str(cache), KERNELCACHE_STRICT="1")
    assert proc.returncode == 0, proc.stderr
    assert kernels(warm, "triton") == {}
    assert total(warm, "kernelcache_cache_hits_total", toolchain="triton") == 1

    files_before = sorted(p for p in cache.rglob("*") if p.is_file())
    proc, _ = serve("--triton", "256", *run, TRITON_CACHE_DIR=str(cache), KERNELCACHE_STRICT="1")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "kernelcache.errors.ColdCompileError: triton: cold compile of vector_add in "
        f"strict mode (not in the cache at {cache})"
    )
    assert sorted(p for p in cache.rglob("*") if p.is_file()) == files_before  # nothing built


# --------------------------------------------------------------------------- flashinfer


@needs_triton
def test_a_triton_compile_in_another_process_sharing_the_cache_is_counted_once(tmp_path):
    """Inductor's compile workers compile in processes of their own, where this process's
    Triton listener sees nothing; the runtime's poll of the shared Triton cache counts what
    they add, and does not count again what this process compiled itself."""
    cache = tmp_path / "triton"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(HELPER), "--serve", "--triton", "128"],
        env=subprocess_env(
            TRITON_CACHE_DIR=str(cache),
            KERNELCACHE_POLL_S="0.05",
            KERNELCACHE_METRICS_PORT=str(port),
            KERNELCACHE_METRICS_ADDRESS="127.0.0.1",
        ),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def scrape() -> Samples:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return parse(response.read().decode())

    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"serving {port}"
        skip_to_metrics(proc.stdout)
        elsewhere = subprocess.run(  # a worker: the same cache, no kernelcache runtime
            triton_elsewhere(256),
            env=helper_env(TRITON_CACHE_DIR=str(cache)),
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        assert elsewhere.returncode == 0, elsewhere.stderr
        wait_until(lambda: kernels(scrape(), "triton").get("vector_add") == 2, timeout=30)
        time.sleep(0.5)  # ten more polls: nothing is counted twice
        samples = scrape()
    finally:
        _, stderr = proc.communicate(input="", timeout=scaled(60))
    assert kernels(samples, "triton") == {"vector_add": 2}
    assert total(samples, "kernelcache_compile_seconds_count", toolchain="triton") == 1
    assert "cold compile in another process sharing the cache: triton kernel vector_add" in stderr


@needs_triton
def test_processes_started_by_a_serving_process_read_the_relocated_triton_cache(tmp_path):
    """A process the serving process starts without the runtime (an engine's helper, one of
    inductor's compile workers) inherits the relocating cache manager with the cache dir, so
    it finds the generation's kernels; with Triton's own manager it compiles them again over
    the generation's files, in place, where no new entry shows it."""
    staging = tmp_path / "staging"
    child = triton_elsewhere(128)
    compiled = subprocess.run(child, env=helper_env(TRITON_CACHE_DIR=str(staging)))
    assert compiled.returncode == 0
    files = {f"triton/{p.relative_to(staging)}": p.read_bytes() for p in staging.rglob("*.*")}
    shutil.rmtree(staging)  # gone, as the warm's staging dir is
    published = make_generation(tmp_path / "store", files)
    manifest = Store(tmp_path / "store").current_manifest("default/demo/sm_90a")
    assert manifest is not None
    parent = (
        "import os, subprocess, sys\n"
        "from kernelcache import runtime; runtime.install()\n"
        "env = dict(os.environ)\n"
        "if sys.argv[1] == 'stock': env.pop('TRITON_CACHE_MANAGER')\n"
        f"sys.exit(subprocess.run({child!r}, env=env).returncode)\n"
    )
    for manager in ("inherited", "stock"):
        generation = materialize(verify(published), tmp_path / manager)
        (group,) = (generation / "files" / "triton").glob("*/__grp__vector_add.json")
        written = group.read_bytes()
        proc = subprocess.run(
            [sys.executable, "-c", parent, manager],
            env=helper_env(KERNELCACHE_DIR=str(generation)),
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        assert proc.returncode == 0, proc.stderr
        recompiled = group.read_bytes() != written  # rewritten with this copy's paths
        assert recompiled == (manager == "stock")


def test_flashinfer_build_log_counts_real_builds_of_this_process_only(tmp_path):
    """A file-format contract test: the lines are written here as FlashInfer 0.7.x writes them."""
    log = tmp_path / "builds.jsonl"
    pid = os.getpid()

    def line(name: str, seconds: float, of: int = pid) -> str:
        record = {"toolchain": "cuda", "name": name, "seconds": seconds, "pid": of, "time": 1.0}
        return json.dumps(record) + "\n"

    log.write_text(line("kc_test_before_start", 9.0))  # history: not this process's builds
    tail = BuildLogTail(log, min_seconds=0.5)

    def builds() -> dict[str, float]:
        return kernels(parse(metrics.render().decode()), "flashinfer")

    def hits() -> float:
        samples = parse(metrics.render().decode())
        return total(samples, "kernelcache_cache_hits_total", toolchain="flashinfer")

    hits_before = hits()
    with log.open("a") as f:
        f.write(line("kc_test_decode", 12.3))
        f.write(line("kc_test_decode", 0.011))  # a warm load: ninja found it up to date
        f.write(line("kc_test_other_process", 20.0, of=pid + 1))
        f.write("not json\n")
        f.write(line("kc_test_late", 5.0)[:30])  # still being written
    tail.poll()
    assert {k: v for k, v in builds().items() if k.startswith("kc_test")} == {"kc_test_decode": 1}
    assert hits() == hits_before + 1
    with log.open("a") as f:
        f.write(line("kc_test_late", 5.0)[30:])
    tail.poll()
    assert builds()["kc_test_late"] == 1 and "kc_test_before_start" not in builds()


def test_install_tails_the_build_log_named_in_the_environment(tmp_path):
    log = tmp_path / "builds.jsonl"
    script = (
        "import json, os, time\n"
        "from kernelcache import runtime\n"
        "from kernelcache.runtime import metrics\n"
        "runtime.install()\n"
        "with open(os.environ['FLASHINFER_JIT_BUILD_LOG'], 'a') as f:\n"
        "    f.write(json.dumps({'toolchain': 'cuda', 'name': 'page_prefill', 'seconds': 3.5,"
        " 'pid': os.getpid(), 'time': time.time()}) + '\\n')\n"
        "time.sleep(0.5)\n"
        "print(metrics.render().decode())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=subprocess_env(FLASHINFER_JIT_BUILD_LOG=str(log), KERNELCACHE_POLL_S="0.05"),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == 0, proc.stderr
    assert kernels(parse(proc.stdout), "flashinfer") == {"page_prefill": 1}
