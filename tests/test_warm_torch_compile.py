"""The torch-compile warmer through the real CLI, with real torch.compile.

On the CPU (inductor's C++ backend; needs a C++ compiler) a build keeps PyTorch's Mega-Cache
in the generation; a fresh process that loads it before its first compiled call hits
inductor's FX graph and AOTAutograd caches instead of compiling, and one without it compiles.
The same on a GPU, in max-autotune mode, is marked ``gpu``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kernelcache.errors import ExitCode
from kernelcache.store import Manifest, Store, materialize, verify
from kernelcache.toolchains.inductor import MAX_REPLAYS
from tests.conftest import EXAMPLES, scaled, serve_python, subprocess_env, write_warmer_spec
from tests.conftest import run_kernelcache as kernelcache

HAVE_TORCH = importlib.util.find_spec("torch") is not None
pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")

CPU_WORKLOAD = {
    "batch_sizes": [8],
    "features": 32,
    "hidden": 64,
    "dtype": "float32",
    "device": "cpu",
}
KEY = "default/tc/sm_90a"
# max-autotune on a GPU: GEMM templates benchmarked against cuBLAS, pointwise kernels tuned.
GPU_WORKLOAD = {
    "batch_sizes": [8],
    "features": 256,
    "hidden": 1024,
    "dtype": "bfloat16",
    "device": "cuda",
}


def cuda_available() -> bool:
    if not HAVE_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


def gpu_arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def write_spec(tmp_path: Path, warmer: dict[str, Any], arch: str = "sm_90a") -> Path:
    return write_warmer_spec(tmp_path, {"type": "torch-compile", **warmer}, arch, name="tc")


def serve(cache_dir: Path, workload: dict[str, Any], megacache: Path | None) -> subprocess.Popen:
    """examples/torch_models.py as a fresh serving process with its own empty inductor cache."""
    args = [sys.executable, str(EXAMPLES / "torch_models.py"), "--workload", json.dumps(workload)]
    if megacache is not None:
        args += ["--megacache", str(megacache)]
    return subprocess.Popen(
        args,
        env=subprocess_env(
            TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TRITON_CACHE_DIR=str(cache_dir / "triton")
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def counters_of(proc: subprocess.Popen) -> tuple[int, dict[str, Any]]:
    stdout, stderr = proc.communicate(timeout=scaled(600))
    lines = stdout.strip().splitlines()
    assert lines, stderr
    return proc.returncode, json.loads(lines[-1])


def build(tmp_path: Path, workload: dict[str, Any], arch: str) -> tuple[Path, Manifest]:
    """``kernelcache build`` of the torch_models entry point: the generation and its manifest."""
    spec = write_spec(tmp_path, {"entryPoints": ["torch_models:warm"], "workload": workload}, arch)
    store = Store(tmp_path / "store")
    proc = kernelcache("build", "-f", str(spec), "--store", str(store.root))
    assert proc.returncode == 0, proc.stderr
    key = f"default/tc/{arch}"
    generation, manifest = store.current(key), store.current_manifest(key)
    assert generation is not None and manifest is not None
    return generation, manifest


@pytest.fixture(scope="module")
def cpu_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    """One build of CPU_WORKLOAD for sm_90a, shared: the tests below only read it (the one
    that damages a file does so in its own materialized copy)."""
    return build(tmp_path_factory.mktemp("cpu-build"), CPU_WORKLOAD, "sm_90a")


def serve_both_ways(
    tmp_path: Path, built: tuple[Path, Manifest], workload: dict[str, Any]
) -> tuple[dict, dict, dict]:
    """Serve a build with and without the Mega-Cache (side by side); the three reports."""
    generation, manifest = built
    paths = {f.path for f in manifest.files}
    assert {"torch-compile/megacache.bin", "torch-compile/megacache.json"} <= paths
    assert any(p.startswith("inductor/fxgraph/") for p in paths)
    assert any(p.startswith("inductor/aotautograd/") for p in paths)
    (report,) = manifest.report["warmers"]

    megacache = generation / "files" / "torch-compile" / "megacache.bin"
    with_cache = serve(tmp_path / "served-with", workload, megacache)
    without = serve(tmp_path / "served-without", workload, None)
    code_with, hits = counters_of(with_cache)
    code_without, misses = counters_of(without)
    assert code_with == 0, hits
    assert code_without == 1, misses
    return report, hits, misses


@pytest.mark.slow
def test_build_keeps_the_megacache_and_a_fresh_process_loading_it_compiles_nothing(
    tmp_path, cpu_build
):
    report, served, cold = serve_both_ways(tmp_path, cpu_build, CPU_WORKLOAD)
    assert report["compiled"] == 1
    assert report["kernels"] == ["mlp[float32,32x64,batch=8]"]
    assert report["megacache"] == {"aot_autograd": 1, "inductor": 1}
    assert report["replays"] == [0]  # a fresh process set up as serving compiled nothing
    assert {"inductor", "torch-compile"} <= set(report["dirs"])

    assert served["fxgraph_cache_hit"] >= 1 and served["fxgraph_cache_miss"] == 0
    assert served["autograd_cache_hit"] >= 1 and served["autograd_cache_miss"] == 0
    assert cold["fxgraph_cache_miss"] >= 1 and cold["fxgraph_cache_hit"] == 0


def build_and_materialize(tmp_path: Path, workload: dict[str, Any], arch: str) -> Path:
    """Build, then copy the generation out as the init-container does, elsewhere than the
    warm's staging dir (gone once published, as on another node)."""
    return materialize(verify(build(tmp_path, workload, arch)[0]), tmp_path / "serve")


def serve_from_generation(
    generation: Path, workload: dict[str, Any], **env: str
) -> tuple[int, dict[str, Any], str]:
    """examples/torch_models.py through ``kernelcache.runtime``: exit code, counters, stderr."""
    run = serve_python(
        EXAMPLES / "torch_models.py",
        "--workload",
        json.dumps(workload),
        **{"KERNELCACHE_DIR": str(generation), **env},
    )
    return run.returncode, json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


@pytest.mark.slow
def test_serving_reads_the_generations_inductor_cache_without_reloading_the_blob(
    tmp_path, cpu_build
):
    """The runtime serves inductor from the materialized ``files/inductor`` and leaves the
    Mega-Cache alone (loading it would put the first warm process's autotune results back
    over what the replays wrote). The blob is damaged here to show whether it was read: served
    from the generation's own cache, nothing notices; pointed at a cache dir of the user's,
    the runtime loads the blob, torch says it cannot, and the model compiles."""
    generation = materialize(
        verify(cpu_build[0]), tmp_path / "serve"
    )  # off the staging dir, as a pod
    blob = generation / "files" / "torch-compile" / "megacache.bin"
    blob.write_bytes(blob.read_bytes()[:100])

    code, counters, stderr = serve_from_generation(generation, CPU_WORKLOAD)
    assert code == 0, stderr
    assert counters["fxgraph_cache_hit"] >= 1 and counters["fxgraph_cache_miss"] == 0
    assert counters["runtime_compiles"] == 0
    assert "un-pickle cache artifacts" not in stderr  # torch's own line for a damaged blob

    code, counters, stderr = serve_from_generation(
        generation, CPU_WORKLOAD, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "own")
    )
    assert code == 1 and counters["fxgraph_cache_miss"] >= 1
    assert counters["runtime_compiles"] >= 1
    assert "Failed to un-pickle cache artifacts" in stderr


def test_a_warm_that_compiles_nothing_fails_in_one_line(tmp_path):
    (tmp_path / "idle_model.py").write_text("def warm(workload):\n    return []\n")
    spec = write_spec(tmp_path, {"entryPoints": ["idle_model:warm"]})
    proc = kernelcache("warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", "sm_90a")
    assert proc.returncode == ExitCode.WARM_FAILED
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "torch-compile idle_model:warm produced no cache artifacts for sm_90a" in lines[0]
    assert Store(tmp_path / "s").current(KEY) is None


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (max-autotune compiles for it)")
def test_max_autotune_on_the_gpu_is_served_from_the_megacache(tmp_path):
    built = build(tmp_path, GPU_WORKLOAD, gpu_arch())
    report, served, cold = serve_both_ways(tmp_path, built, GPU_WORKLOAD)
    assert report["compiled"] == 1 and report["megacache"]["inductor"] == 1
    assert "triton" in report["dirs"]
    assert report["replays"][-1] == 0  # tuned kernels are not tuned again in serving
    assert served["fxgraph_cache_hit"] >= 1 and served["fxgraph_cache_miss"] == 0
    assert cold["fxgraph_cache_miss"] >= 1
    assert served["seconds"] < cold["seconds"]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (max-autotune tunes on it)")
def test_a_copy_of_a_max_autotune_generation_serves_without_compiling_or_tuning(tmp_path):
    """Max-autotune tunes the pointwise kernels at their first launch, and inductor bundles
    them with the cached graph under the path they had in the warm's staging dir. A fresh
    process serving a copy of the generation, that path gone, finds every tuned config: the
    runtime counts no Triton compile (a kernel tuned again compiles its new configs)."""
    workload = {**GPU_WORKLOAD, "model": "block", "seq": 128, "heads": 4}  # norms: reductions
    generation = build_and_materialize(tmp_path, workload, gpu_arch())
    code, counters, stderr = serve_from_generation(generation, workload)
    assert code == 0, stderr
    assert counters["fxgraph_cache_hit"] >= 1 and counters["runtime_compiles"] == 0


@pytest.mark.slow
def test_replays_stop_after_the_limit_and_say_serving_may_still_compile(tmp_path):
    """A model that meets another shape in every process never settles: the warm replays it
    MAX_REPLAYS times, reports each replay's compiles and warns, instead of looping. Its graph
    is a view: each process still misses inductor's FX graph cache (a compile, as serving
    counts it), but no C++ kernel is built (a gcc run of about 4 CPU-s in each of the four
    processes, which this test is not about)."""
    (tmp_path / "restless_model.py").write_text(
        "import os\n"
        "import torch\n\n\n"
        "def warm(workload):\n"
        "    size = 8 + os.getpid() % 997  # another shape in every process\n"
        "    torch.compile(lambda x: x.view(-1)[1:])(torch.ones(size))\n"
        "    return [f'slice[{size}]']\n"
    )
    spec = write_spec(tmp_path, {"entryPoints": ["restless_model:warm"]})
    proc = kernelcache("warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", "sm_90a")
    assert proc.returncode == 0, proc.stderr
    manifest = Store(tmp_path / "s").current_manifest(KEY)
    assert manifest is not None
    (report,) = manifest.report["warmers"]
    assert report["replays"] == [1] * MAX_REPLAYS
    assert f"may still compile (compiles in {MAX_REPLAYS} replays: [1, 1, 1])" in proc.stderr
