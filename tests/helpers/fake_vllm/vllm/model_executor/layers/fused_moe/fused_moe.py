"""As vLLM 0.26.0's ``fused_moe.fused_moe``: how a config is picked for a token count."""

from __future__ import annotations

import functools
import json
import os
from typing import Any


def get_config_file_name(
    E: int, N: int, dtype: str | None, block_shape: list[int] | None = None
) -> str:
    device_name = os.environ.get("FAKE_VLLM_GPU", "NVIDIA H200").replace(" ", "_")
    if "H200" in device_name.split("_"):
        device_name = "NVIDIA_H200"
    dtype_selector = "" if not dtype else f",dtype={dtype}"
    return f"E={E},N={N},device_name={device_name}{dtype_selector}.json"


@functools.lru_cache
def get_moe_configs(E: int, N: int, dtype: str | None) -> dict[int, Any] | None:
    name = get_config_file_name(E, N, dtype)
    paths = []
    if folder := os.environ.get("VLLM_TUNED_CONFIG_FOLDER"):
        paths.append(os.path.join(folder, name))
    paths.append(os.path.join(os.path.dirname(os.path.realpath(__file__)), "configs", name))
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                table = json.load(f)
            table.pop("triton_version", None)
            return {int(key): value for key, value in table.items()}
    return None


def get_default_config(
    M: int, E: int, N: int, K: int, topk: int, dtype: str | None, block_shape: Any = None
) -> dict[str, int]:
    """vLLM's default for bf16/fp16 on a CUDA GPU."""
    block_m = 16 if M <= 32 else 32 if M <= 96 else 64 if M <= 512 else 128
    return {
        "BLOCK_SIZE_M": block_m,
        "BLOCK_SIZE_N": 64 if M <= 64 else 128,
        "BLOCK_SIZE_K": 128 if M <= 64 else 64,
        "GROUP_SIZE_M": 16 if M // max(E, 1) > 128 else 1,
        "SPLIT_K": 1,
        "num_warps": 4 if M <= 128 else 8,
        "num_stages": 4 if M <= 32 else 3,
    }


def try_get_optimal_moe_config(
    w1_shape: tuple[int, ...],
    w2_shape: tuple[int, ...],
    top_k: int,
    dtype: str | None,
    M: int,
    block_shape: Any = None,
) -> dict[str, int]:
    from vllm.model_executor.layers.fused_moe import get_config

    if override := get_config():
        return override
    E, _, N = w2_shape
    configs = get_moe_configs(E, N, dtype)
    if configs:
        return configs[min(configs.keys(), key=lambda x: abs(x - M))]
    return get_default_config(M, E, N, w1_shape[2], top_k, dtype, block_shape)
