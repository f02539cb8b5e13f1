"""As vLLM's: one plan per fingerprint (config, GPU name, rank) under the cache root, applied
only when free memory is at least the baseline it recorded; otherwise memory is profiled."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("vllm.startup_plan")


def gpu_name() -> str:
    return os.environ.get("FAKE_VLLM_GPU", "NVIDIA H200")


def compute_plan_fingerprint(worker: Any) -> str:
    factors = [worker.vllm_config.model_config.model, worker.dtype, gpu_name(), worker.rank,
               worker.world_size]  # fmt: skip
    return hashlib.sha256(json.dumps(factors).encode()).hexdigest()[:16]


def _plan_path(worker: Any) -> Path:
    return worker.root / "startup_plan" / f"startup_plan_{compute_plan_fingerprint(worker)}.json"


def maybe_apply_startup_plan(worker: Any) -> None:
    if os.environ.get("VLLM_ENABLE_STARTUP_PLAN") != "1":
        return
    try:
        plan = json.loads(_plan_path(worker).read_text())
    except FileNotFoundError:
        return
    free = worker.init_snapshot.free_memory
    if free < plan["free_memory_baseline"]:
        logger.info("Startup plan not applied: current free memory is below the baseline")
        return
    logger.info("Applying persisted startup plan. Memory profiling will be skipped.")
    worker.cache_config.kv_cache_memory_bytes = plan["kv_cache_memory_bytes"]


def maybe_save_startup_plan(worker: Any, kv_cache_memory_bytes: int) -> None:
    if os.environ.get("VLLM_ENABLE_STARTUP_PLAN") != "1":
        return
    path = _plan_path(worker)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "kv_cache_memory_bytes": kv_cache_memory_bytes,
                "free_memory_baseline": worker.init_snapshot.free_memory,
            }
        )
    )
