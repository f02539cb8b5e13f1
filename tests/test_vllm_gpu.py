"""The vllm warmer and serving path on a real engine: ``vllm serve`` on a CUDA GPU (skipped
elsewhere), in each configuration ``bench/vllm_coldstart.py`` measures.

The tiny Qwen3-MoE of ``bench/qwen3-moe-tiny`` with random safetensors weights in a model
directory: one generation built by ``kernelcache build``, the warm's cache root removed, the
init-container's command putting it back, and ``vllm serve`` started from it in strict mode
(vLLM's monitor in ``error`` mode, ``FLASHINFER_DISABLE_JIT=1``). ``flashinfer``: FlashInfer's
attention backend and sampler, warmed with dummy weights and served with dummy and real ones,
and with less free GPU memory than vLLM's startup plan recorded. ``triton``: FA3 attention,
Triton MoE, no FlashInfer, real weights throughout. The figures: ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, kernelcache_doc, scaled, subprocess_env
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
BASE: dict[str, Any] = {
    "dtype": "bfloat16",
    "maxModelLen": 2048,
    "maxNumBatchedTokens": 2048,
    "gpuMemoryUtilization": 0.5,
    "skipTokenizerInit": True,
    "promptLengths": [7, 100, 1000, 2000],
    "batchSizes": [1, 3, 16, 64],
    "maxTokens": 8,
}
CONFIGS = {
    "flashinfer": (
        {**BASE, "loadFormat": "dummy", "attentionBackend": "FLASHINFER"},
        {"VLLM_USE_FLASHINFER_SAMPLER": "1"},
    ),
    "triton": ({**BASE, "loadFormat": "auto"}, {"VLLM_USE_FLASHINFER_SAMPLER": "0"}),
}
# The batch sizes whose tokens vLLM itself reproduces from one start to the next. With the
# random safetensors weights, a batched request's greedy tokens change between any two starts
# of vLLM alone (the compile Job's own two passes differed on 10 of the 12 batched shapes on
# the H200, 2026-12-02): how the server's requests fall into engine steps decides near-tied
# tokens. A request alone in the engine answers the same every time; dummy weights answer the
# same in every shape.
REPRODUCIBLE_BATCHES: dict[str, list[int]] = {"flashinfer": BASE["batchSizes"], "triton": [1]}
SWEEP: dict[str, Any] = {
    "prompt_lengths": [7, 100, 1000, 2000],
    "batch_sizes": [1, 3, 16, 64],
    "max_tokens": 8,
}
OUTSIDE = {"prompt_lengths": [1, 33, 777, 1500], "batch_sizes": [2, 5, 48], "max_tokens": 8}


def engine_env(config: str, **overrides: str) -> dict[str, str]:
    from kernelcache.toolchains.vllm.passes import ENGINE_ENV

    env = CONFIGS[config][1]
    return {**subprocess_env(), **ENGINE_ENV, **env, "KERNELCACHE_ARCH": ARCH, **overrides}


@pytest.fixture(scope="module", autouse=True)
def hook():
    """vllm serve's processes load the runtime through its .pth hook, as in an installed image."""
    with runtime_hook():
        yield


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def built(request, tmp_path_factory) -> dict[str, Any]:
    config = request.param
    tmp = tmp_path_factory.mktemp(f"vllm-gpu-{config}")
    model = save_random_weights(REPO / "bench" / "qwen3-moe-tiny" / "config.json", tmp / "model")
    root, store = tmp / "vllm-root", tmp / "store"
    workload = {**CONFIGS[config][0], "model": str(model), "cacheRoot": str(root)}
    doc = kernelcache_doc(
        "vq",
        warmers=[{"type": "vllm", "env": CONFIGS[config][1], "workload": workload}],
        gpuClasses=[{"name": "h200", "arch": ARCH}],
    )
    (tmp / "kc.yaml").write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "build", "-f", str(tmp / "kc.yaml"),
         "--store", str(store)],
        env=engine_env(config), capture_output=True, text=True, timeout=scaled(1800),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = next(store.glob("default/vq/*/*/MANIFEST.json"))
    shutil.rmtree(root)
    return {"config": config, "tmp": tmp, "root": root, "store": store, "manifest": manifest,
            "model": model}  # fmt: skip


def engine_args(built, **changes: object) -> dict[str, object]:
    from kernelcache.toolchains.vllm.passes import engine_job

    workload = {**CONFIGS[built["config"]][0], "model": str(built["model"])}
    return {**engine_job(workload)["engine"], "jit_monitor_mode": "error", **changes}


def test_the_warm_records_its_modules_and_the_prefill_kernels(built):
    manifest = json.loads(built["manifest"].read_text())
    report = manifest["report"]["warmers"][0]
    first, last = report["passes"][0], report["passes"][-1]
    assert "fused_moe_kernel" in {e["kernel"] for e in first["jit_events"]}, report["passes"]
    assert last["serving"] and last["jit_events"] == [] and last["cold_compiles"] == {}
    assert last["flashinfer_builds"] == [] and last["startup_plan"]["applied"]
    assert report["arch_list"] == "9.0a" and report["startup_plans"]
    paths = {f["path"] for f in manifest["files"]}
    if built["config"] == "flashinfer":
        assert {b["name"] for b in first["flashinfer_builds"]} >= {"sampling"}
        for module in report["flashinfer_modules"]:
            assert f"flashinfer/aot/{module}/{module}.so" in paths
    else:
        assert report["flashinfer_modules"] == [] and not first["flashinfer_builds"]


def served(built, tmp_path, name, env=None, **changes):
    pod = tmp_path / "pod"
    if not (pod / "kernelcache.env").exists():
        proc = verify(built, pod, engine_env(built["config"], VLLM_CACHE_ROOT=str(built["root"])))
        assert proc.returncode == 0, proc.stderr
    environment = engine_env(
        built["config"], VLLM_CACHE_ROOT=str(built["root"]),
        KERNELCACHE_ENV_FILE=str(pod / "kernelcache.env"), KERNELCACHE_STRICT="1", **(env or {}),
    )  # fmt: skip
    return drive(
        tmp_path, name, environment, runtime="serving", sweep=SWEEP, more_sweeps=[OUTSIDE],
        engine=engine_args(built, **changes),
    )  # fmt: skip


def test_served_strict_from_another_directory_meets_no_jit_and_answers_as_cold(built, tmp_path):
    from kernelcache.toolchains.vllm.engine import differing_outputs

    rc, result, log = served(built, tmp_path, "served")
    assert rc == 0 and result["sweep_error"] is None, log[-3000:]
    assert result["jit_events"] == [] and result["cold_compiles"] == {}
    assert result["flashinfer_builds"] == [] and result["monitor_mode"] == "error"
    assert result["torch_compile_seconds"] is not None and result["torch_compile_seconds"] < 5
    cold = json.loads(built["manifest"].read_text())["report"]["warmers"][0]["passes"][0]
    declared = {f"{n}x{b}" for n in SWEEP["prompt_lengths"] for b in SWEEP["batch_sizes"]}
    assert set(cold["output_digests"]) == declared
    batches = REPRODUCIBLE_BATCHES[built["config"]]
    reproducible = {
        k: v for k, v in cold["output_digests"].items() if int(k.split("x")[1]) in batches
    }
    assert len(reproducible) == len(SWEEP["prompt_lengths"]) * len(batches)
    assert differing_outputs(result["outputs"], reproducible) == []


def test_a_generation_warmed_with_dummy_weights_serves_real_ones_with_no_jit(built, tmp_path):
    """loadFormat is no vLLM cache key factor (its LoadConfig hashes nothing in 0.26.0)."""
    if built["config"] != "flashinfer":
        pytest.skip("this configuration is warmed with the real weights")
    rc, result, log = served(built, tmp_path, "real", load_format="auto")
    assert rc == 0 and result["sweep_error"] is None, log[-3000:]
    assert result["jit_events"] == [] and result["cold_compiles"] == {}
    assert "Directly load the compiled graph" in log


def test_less_free_memory_than_the_plan_profiles_and_says_so(built, tmp_path):
    if built["config"] != "flashinfer":
        pytest.skip("one configuration shows it")
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
