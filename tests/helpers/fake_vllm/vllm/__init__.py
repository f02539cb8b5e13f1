"""A stand-in for vLLM on machines without a GPU: the same hook points, processes and paths.

What it mimics (read from vLLM 0.26.0): ``vllm serve MODEL`` (``vllm.entrypoints.cli.main``)
is an API server that starts an engine core process (forked unless
``VLLM_WORKER_MULTIPROC_METHOD=spawn``); there one ``Worker`` per tensor-parallel rank loads
the model, loads or compiles its graphs (``rank_<r>_0`` under the cache root), sizes its KV
cache (``determine_available_memory``, which applies a persisted startup plan when
``VLLM_ENABLE_STARTUP_PLAN=1`` and free memory is at least the plan's baseline), and
``compile_or_warm_up_model()`` runs dummy forwards for the CUDA-graph sizes and arms
``vllm.utils.jit_monitor`` at its end. A forward loads one "fused-MoE kernel" per (block size,
divisibility) of its token count, and once the monitor is armed a kernel's first load in the
process is a JIT event (a raise in ``error`` mode, which kills the engine core: the request
fails and ``/health`` answers 500). The compile cache names its own absolute path: read from
any other root, the engine fails, as vLLM's does.

``FAKE_VLLM_GPU`` (default "NVIDIA H200") and ``FAKE_VLLM_FREE_GIB`` (default 139.29) stand
for the GPU's name and free memory.
"""

from __future__ import annotations

import json
from pathlib import Path


def cache_file(root: Path, rank: int = 0) -> Path:
    return (
        root
        / "torch_compile_cache"
        / "abc123"
        / f"rank_{rank}_0"
        / "backbone"
        / "vllm_compile_cache.py"
    )


def write_cache(root: Path, model: str, dtype: str, rank: int = 0) -> None:
    path = cache_file(root, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"artifact": str(path.parent / "artifact_0")}))
    (path.parent / "artifact_0").write_bytes(b"compiled graph")
    (path.parent / "cache_key_factors.json").write_text(
        json.dumps({"model": model, "dtype": dtype})
    )


class SamplingParams:
    """As vLLM's: how a request samples (the stand-in samples nothing)."""

    def __init__(self, max_tokens: int | None = 16, temperature: float = 1.0, **_: object):
        self.max_tokens, self.temperature = max_tokens, temperature
