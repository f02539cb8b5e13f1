"""The vllm warmer and serving path on a real engine: ``vllm serve`` on a CUDA GPU (skipped
elsewhere), FlashInfer's attention backend and sampler on.

The tiny Qwen3-MoE of ``bench/qwen3-moe-tiny`` with random safetensors weights in a model
directory: one generation built by ``kernelcache build`` (warmed with ``loadFormat: dummy``),
the warm's cache root removed, the init-container's command putting it back, and ``vllm
serve`` started from it in strict mode (vLLM's monitor in ``error`` mode,
``FLASHINFER_DISABLE_JIT=1``), with dummy weights, with the real ones, and with less free GPU
memory than vLLM's startup plan recorded. The figures: ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, kernelcache_doc, subprocess_env
from tests.helpers.vllm import ARCH, drive, runtime_hook, save_random_weights, verify

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        shutil.which("nvidia-smi") is None or importlib.util.find_spec("vllm") is None,
        reason="needs vLLM and a CUDA GPU",
    ),
]

# bench/vllm_coldstart.py's traffic: on an H200 its prefills reach a fused-MoE kernel
# specialization vLLM's own warm-up does not load (a smaller sweep may not).
WORKLOAD = {
    "loadFormat": "dummy",
    "dtype": "bfloat16",
    "maxModelLen": 2048,
    "maxNumBatchedTokens": 2048,
    "gpuMemoryUtilization": 0.5,
    "skipTokenizerInit": True,
    "attentionBackend": "FLASHINFER",
    "promptLengths": [7, 100, 1000, 2000],
    "batchSizes": [1, 3, 16, 64],
    "maxTokens": 8,
}
ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
SWEEP = {"prompt_lengths": [7, 100, 1000, 2000], "batch_sizes": [1, 3, 16, 64], "max_tokens": 8}
OUTSIDE = {"prompt_lengths": [1, 33, 777, 1500], "batch_sizes": [2, 5, 48], "max_tokens": 8}


def engine_env(**overrides: str) -> dict[str, str]:
    from kernelcache.toolchains.vllm import ENGINE_ENV

    return {**subprocess_env(), **ENGINE_ENV, **ENV, "KERNELCACHE_ARCH": ARCH, **overrides}


@pytest.fixture(scope="module", autouse=True)
def hook():
    """vllm serve's processes load the runtime through its .pth hook, as in an installed image."""
    with runtime_hook():
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("vllm-gpu")
    model = save_random_weights(REPO / "bench" / "qwen3-moe-tiny" / "config.json", tmp / "model")
    root, store = tmp / "vllm-root", tmp / "store"
    workload = {**WORKLOAD, "model": str(model), "cacheRoot": str(root)}
    doc = kernelcache_doc(
        "vq",
        warmers=[{"type": "vllm", "env": ENV, "workload": workload}],
        gpuClasses=[{"name": "h200", "arch": ARCH}],
    )
    (tmp / "kc.yaml").write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "build", "-f", str(tmp / "kc.yaml"),
         "--store", str(store)],
        env=engine_env(), capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = next(store.glob("default/vq/*/*/MANIFEST.json"))
    shutil.rmtree(root)
    return {"tmp": tmp, "root": root, "store": store, "manifest": manifest, "model": model}


def engine_args(built, **changes: object) -> dict[str, object]:
    from kernelcache.toolchains.vllm import engine_job

    workload = {**WORKLOAD, "model": str(built["model"])}
    return {**engine_job(workload)["engine"], "jit_monitor_mode": "error", **changes}


def test_the_warm_records_flashinfers_modules_and_the_prefill_kernels(built):
    manifest = json.loads(built["manifest"].read_text())
    report = manifest["report"]["warmers"][0]
    first, last = report["passes"][0], report["passes"][-1]
    assert "fused_moe_kernel" in {e["kernel"] for e in first["jit_events"]}, report["passes"]
    assert {b["name"] for b in first["flashinfer_builds"]} >= {"sampling"}
    assert last["serving"] and last["jit_events"] == [] and last["cold_compiles"] == {}
    assert last["flashinfer_builds"] == [] and last["startup_plan"]["applied"]
    paths = {f["path"] for f in manifest["files"]}
    for module in report["flashinfer_modules"]:
        assert f"flashinfer/aot/{module}/{module}.so" in paths
    assert report["arch_list"] == "9.0a" and report["startup_plans"]


def served(built, tmp_path, name, env=None, **changes):
    pod = tmp_path / "pod"
    if not (pod / "kernelcache.env").exists():
        proc = verify(built, pod, engine_env(VLLM_CACHE_ROOT=str(built["root"])))
        assert proc.returncode == 0, proc.stderr
    environment = engine_env(
        VLLM_CACHE_ROOT=str(built["root"]), KERNELCACHE_ENV_FILE=str(pod / "kernelcache.env"),
        KERNELCACHE_STRICT="1", **(env or {}),
    )  # fmt: skip
    return drive(
        tmp_path, name, environment, runtime="serving", sweep=SWEEP, more_sweeps=[OUTSIDE],
        engine=engine_args(built, **changes),
    )  # fmt: skip


def test_served_strict_from_another_directory_meets_no_jit_and_answers_as_cold(built, tmp_path):
    from kernelcache.toolchains.vllm import outputs_digest

    rc, result, log = served(built, tmp_path, "served")
    assert rc == 0 and result["sweep_error"] is None, log[-3000:]
    assert result["jit_events"] == [] and result["cold_compiles"] == {}
    assert result["flashinfer_builds"] == [] and result["monitor_mode"] == "error"
    assert result["torch_compile_seconds"] is not None and result["torch_compile_seconds"] < 5
    cold = json.loads(built["manifest"].read_text())["report"]["warmers"][0]["passes"][0]
    declared = {k: v for k, v in result["outputs"].items() if k.split("x")[0] in {"7", "100",
                "1000", "2000"} and k.split("x")[1] in {"1", "3", "16", "64"}}  # fmt: skip
    assert outputs_digest(declared) == cold["outputs_digest"]


def test_a_generation_warmed_with_dummy_weights_serves_real_ones_with_no_jit(built, tmp_path):
    """loadFormat is no vLLM cache key factor (its LoadConfig hashes nothing in 0.26.0)."""
    rc, result, log = served(built, tmp_path, "real", load_format="auto")
    assert rc == 0 and result["sweep_error"] is None, log[-3000:]
    assert result["jit_events"] == [] and result["cold_compiles"] == {}
    assert "Directly load the compiled graph" in log


def test_less_free_memory_than_the_plan_profiles_and_says_so(built, tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import torch, time; x = torch.empty(4 << 30, dtype=torch.uint8,"
         " device='cuda'); torch.cuda.synchronize(); print('held', flush=True); time.sleep(900)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        rc, result, log = served(built, tmp_path, "less")
    finally:
        holder.kill()
    assert rc == 0 and result["sweep_error"] is None and result["jit_events"] == [], log[-3000:]
    assert result["startup_plan"]["applied"] is False
    assert "kernelcache: vLLM's startup plan from the generation was not applied" in log
