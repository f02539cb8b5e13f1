"""The vllm warmer and serving path on a real engine: vLLM on a CUDA GPU (skipped elsewhere).

The tiny Qwen3-MoE of ``bench/qwen3-moe-tiny`` (a config only, dummy weights): one generation
built by ``kernelcache build``, the warm's cache root removed, the init-container's command
putting it back, and engines started from it. The figures: ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import kernelcache_doc, subprocess_env
from tests.helpers.vllm import ARCH, MODEL, drive, verify

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
    "model": str(MODEL),
    "loadFormat": "dummy",
    "dtype": "bfloat16",
    "maxModelLen": 2048,
    "maxNumBatchedTokens": 2048,
    "gpuMemoryUtilization": 0.5,
    "skipTokenizerInit": True,
    "promptLengths": [7, 100, 1000, 2000],
    "batchSizes": [1, 3, 16, 64],
    "maxTokens": 8,
}
SWEEP = {"prompt_lengths": [7, 100, 1000, 2000], "batch_sizes": [1, 3, 16, 64], "max_tokens": 8}


def engine_env(**overrides: str) -> dict[str, str]:
    from kernelcache.toolchains.vllm import ENGINE_ENV

    env = {
        **subprocess_env(),
        **ENGINE_ENV,
        "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
        "KERNELCACHE_ARCH": ARCH,
    }
    return {**env, **overrides}


def engine_args(**changes: object) -> dict[str, object]:
    from kernelcache.toolchains.vllm import engine_job

    return {**engine_job(WORKLOAD)["engine"], **changes}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("vllm-gpu")
    root, store = tmp / "vllm-root", tmp / "store"
    doc = kernelcache_doc(
        "vq",
        warmers=[{"type": "vllm", "workload": {**WORKLOAD, "cacheRoot": str(root)}}],
        gpuClasses=[{"name": "h200", "arch": ARCH}],
    )
    (tmp / "kc.yaml").write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "build", "-f", str(tmp / "kc.yaml"),
         "--store", str(store)],
        env=engine_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = next(store.glob("default/vq/*/*/MANIFEST.json"))
    shutil.rmtree(root)
    return {"tmp": tmp, "root": root, "store": store, "manifest": manifest}


def test_the_warm_covers_the_prefill_kernels_vllms_warm_up_leaves_out(built):
    manifest = json.loads(built["manifest"].read_text())
    report = manifest["report"]["warmers"][0]
    first, last = report["passes"][0], report["passes"][-1]
    assert "fused_moe_kernel" in {e["kernel"] for e in first["jit_events"]}, report["passes"]
    assert report["compiled_by_toolchain"]["triton"]["compiled"] > 0
    assert last["serving"] and last["jit_events"] == [] and last["cold_compiles"] == {}
    assert report["preload_sizes"]
    factors = next(iter(report["cache_key_factors"].values()))
    assert {"code_hash", "compiler_hash", "config_hash"} <= set(factors)
    assert manifest["stamp"]["factors"]["vllm/cache_root"] == str(built["root"])


def test_served_from_another_directory_meets_no_jit_and_answers_as_vllm_alone(built, tmp_path):
    moved = verify(built, tmp_path / "pod", engine_env(VLLM_CACHE_ROOT=str(tmp_path / "moved")))
    assert moved.returncode == 4 and "vllm/cache_root" in moved.stderr
    pod = tmp_path / "pod"
    proc = verify(built, pod, engine_env(VLLM_CACHE_ROOT=str(built["root"])))
    assert proc.returncode == 0, proc.stderr
    env = engine_env(
        VLLM_CACHE_ROOT=str(built["root"]), KERNELCACHE_ENV_FILE=str(pod / "kernelcache.env")
    )
    rc, served, log = drive(
        tmp_path, "served", env, runtime="serving", sweep=SWEEP,
        engine=engine_args(jit_monitor_mode="error"),
    )  # fmt: skip
    assert rc == 0 and served["sweep_error"] is None, log[-3000:]
    assert served["jit_events"] == [] and served["cold_compiles"] == {}
    assert served["torch_compile_seconds"] is not None and served["torch_compile_seconds"] < 5
    # vLLM alone on the same restored cache: the prefill kernels are loaded at the first
    # request, which its own monitor reports; the tokens are the same.
    rc, plain, log = drive(tmp_path, "plain", env, sweep=SWEEP, engine=engine_args())
    assert rc == 0, log[-3000:]
    assert "fused_moe_kernel" in {e["kernel"] for e in plain["jit_events"]}
    assert served["outputs"] == plain["outputs"]
