"""As vLLM's fused MoE on Triton: the kernels a forward loads depend on its token count.

Each forward runs two kernels (routed-weight multiply off, then on), each specialized as
vLLM 0.26.0's ``invoke_fused_moe_triton_kernel`` specializes ``fused_moe_kernel``: the
config of the tuned table's entry nearest the token count (its BLOCK_SIZE_M), whether
``tokens * top_k`` is divisible by 16 (Triton specializes integers on it), and the naive
block assignment of tiny batches (``tokens * top_k * 4 <= experts``). A kernel's first load in
a process goes through Triton's compilation listener, as a hit when its entry is in
``TRITON_CACHE_DIR`` and as a compile (which writes the entry) when not; once vLLM's JIT
monitor is armed it is also a JIT event.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.utils import jit_monitor

TABLE = {1: 16, 2: 16, 4: 16, 8: 16, 16: 16, 24: 16, 32: 16, 48: 32, 64: 32, 96: 64,
         128: 64, 256: 64, 512: 128, 1024: 128, 1536: 128, 2048: 128}  # fmt: skip
LOADED: set[str] = set()  # Triton's in-memory cache is per process


@dataclass
class FusedMoEConfig:
    num_experts: int
    experts_per_token: int
    hidden_dim: int
    intermediate_size: int
    in_dtype: Any
    device: str = "cpu"
    router_logits_dtype: Any = None


def kernels_for(tokens: int, config: FusedMoEConfig) -> list[str]:
    nearest = min(TABLE, key=lambda key: abs(key - tokens))
    routed = tokens * config.experts_per_token
    shape = (
        f"BLOCK_SIZE_M={TABLE[nearest]},div16={routed % 16 == 0},"
        f"naive={routed * 4 <= config.num_experts}"
    )
    return [f"fused_moe_kernel[{shape},MUL_ROUTED_WEIGHT={on}]" for on in (False, True)]


def load(kernel: str) -> None:
    if kernel in LOADED:
        return
    LOADED.add(kernel)
    digest = hashlib.sha256(kernel.encode()).hexdigest()[:32]
    entry = base64.b32encode(bytes.fromhex(digest)).decode().rstrip("=")
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache")) / entry
    group = cache / f"__grp__{kernel.partition('[')[0]}.json"
    hit = group.is_file()
    if not hit:
        time.sleep(0.001)  # compiling
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"{kernel.partition('[')[0]}.cubin").write_text(kernel)
        group.write_text(json.dumps({"child_paths": {}}))
    try:
        from triton import knobs
    except ImportError:
        knobs = None
    if knobs is not None and knobs.compilation.listener is not None:
        knobs.compilation.listener(
            src=SimpleNamespace(name=kernel.partition("[")[0]),
            cache_hit=hit,
            metadata={"hash": digest},
            metadata_group={},
            times=None,
        )
    jit_monitor.on_kernel_load(kernel)


class MoERunner:
    """One MoE layer, registered in the compilation config's forward context by its name."""

    def __init__(self, layer_name: str, config: FusedMoEConfig) -> None:
        self.layer_name, self.moe_config = layer_name, config

    def forward(self, hidden_states: Any, router_logits: Any) -> Any:
        tokens = int(hidden_states.shape[0])
        assert hidden_states.shape[1] == self.moe_config.hidden_dim
        assert router_logits.shape == (tokens, self.moe_config.num_experts)
        for kernel in kernels_for(tokens, self.moe_config):
            load(kernel)
        return hidden_states
