"""As vLLM's fused MoE on Triton: the kernels a forward loads depend on its token count.

Each forward runs two kernels (routed-weight multiply off, then on), each specialized as
vLLM 0.26.0's ``invoke_fused_moe_triton_kernel`` specializes ``fused_moe_kernel``: the
config vLLM picks for the token count (``fused_moe.try_get_optimal_moe_config``: an
``override_config``, else the nearest entry of a table in ``VLLM_TUNED_CONFIG_FOLDER`` or
shipped in ``configs/`` for the GPU product, else vLLM's default), whether
``tokens * top_k`` is divisible by 16 (Triton specializes integers on it), and the naive
block assignment of tiny batches (``tokens * top_k * 4 <= experts``). A kernel's first load in
a process goes through Triton's compilation listener, as a hit when its entry is in
``TRITON_CACHE_DIR`` and as a compile (which writes the entry) when not; once vLLM's JIT
monitor is armed it is also a JIT event.

``FAKE_VLLM_MOE_MS`` (unset: no time) stands for the GPU time of a forward: that many
milliseconds times 1 + how many doublings its tiles are away from the best ones for its
token count (``cost``), so that a tuner has something to find.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.utils import jit_monitor

LOADED: set[str] = set()  # Triton's in-memory cache is per process
_config: dict[str, Any] | None = None


@contextlib.contextmanager
def override_config(config: dict[str, Any]) -> Iterator[None]:
    global _config
    old, _config = _config, config
    try:
        yield
    finally:
        _config = old


def get_config() -> dict[str, Any] | None:
    return _config


@dataclass
class FusedMoEConfig:
    num_experts: int
    experts_per_token: int
    hidden_dim: int
    intermediate_size: int
    in_dtype: Any
    device: str = "cpu"
    router_logits_dtype: Any = None


class UnquantizedFusedMoEMethod:
    """vLLM's quant method of bf16/fp16 experts (Triton's fused MoE on a GPU)."""


def chosen(tokens: int, config: FusedMoEConfig) -> dict[str, Any]:
    """The config vLLM runs the layer's kernels with for ``tokens`` tokens."""
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    experts, hidden, n = config.num_experts, config.hidden_dim, config.intermediate_size
    return try_get_optimal_moe_config(
        (experts, 2 * n, hidden), (experts, hidden, n), config.experts_per_token, None, tokens
    )


def kernels_for(tokens: int, config: FusedMoEConfig) -> list[str]:
    tiles_of = chosen(tokens, config)
    routed = tokens * config.experts_per_token
    tiles = ",".join(f"{name}={tiles_of[name]}" for name in sorted(tiles_of) if name != "SPLIT_K")
    shape = f"{tiles},div16={routed % 16 == 0},naive={routed * 4 <= config.num_experts}"
    return [f"fused_moe_kernel[{shape},MUL_ROUTED_WEIGHT={on}]" for on in (False, True)]


def best_for(tokens: int) -> dict[str, int]:
    """The tiles this stand-in's GPU runs fastest for ``tokens`` tokens."""
    small = tokens <= 32
    return {
        "BLOCK_SIZE_M": 16 if small else 64,
        "BLOCK_SIZE_N": 128,
        "BLOCK_SIZE_K": 64,
        "GROUP_SIZE_M": 1 if small else 16,
        "num_warps": 4 if small else 8,
        "num_stages": 4 if small else 3,
    }


def cost(tokens: int, config: dict[str, Any]) -> float:
    """1 + how far each tile is from the best one, in doublings."""
    return round(1 + sum(abs(math.log2(config[k] / v)) for k, v in best_for(tokens).items()), 6)


MODULE = "vllm.model_executor.layers.fused_moe.fused_moe"


def load(kernel: str, module: str = MODULE) -> None:
    if kernel in LOADED:
        return
    LOADED.add(kernel)
    digest = hashlib.sha256(kernel.encode()).hexdigest()[:32]
    entry = base64.b32encode(bytes.fromhex(digest)).decode().rstrip("=")
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    try:
        from triton import knobs
    except ImportError:
        knobs = None
    if knobs is not None and knobs.cache.dir:
        cache = Path(knobs.cache.dir)
    group = cache / entry / f"__grp__{kernel.partition('[')[0]}.json"
    hit = group.is_file()
    if not hit:
        time.sleep(0.001)  # compiling
        group.parent.mkdir(parents=True, exist_ok=True)
        (group.parent / f"{kernel.partition('[')[0]}.cubin").write_text(kernel)
        group.write_text(json.dumps({"child_paths": {}}))
    if knobs is not None and knobs.compilation.listener is not None:
        knobs.compilation.listener(
            src=SimpleNamespace(
                name=kernel.partition("[")[0],
                fn=SimpleNamespace(fn=SimpleNamespace(__module__=module)),
            ),
            cache_hit=hit,
            metadata={"hash": digest},
            metadata_group={},
            times=None,
        )
    jit_monitor.on_kernel_load(kernel)


class RoutedExperts:
    """As vLLM's: a MoE layer's experts, their weights and quant method."""

    def __init__(self, experts: int, hidden: int, n: int) -> None:
        self.w13_weight = SimpleNamespace(shape=(experts, 2 * n, hidden))
        self.w2_weight = SimpleNamespace(shape=(experts, hidden, n))
        self.quant_method = UnquantizedFusedMoEMethod()


class MoERunner:
    """One MoE layer, registered in the compilation config's forward context by its name."""

    def __init__(self, layer_name: str, config: FusedMoEConfig, shared_experts: int = 0) -> None:
        self.layer_name, self.moe_config = layer_name, config
        self.shared_experts = shared_experts
        self.shared_output: Any = None  # the model's forward takes it; from outside, it stays
        experts, hidden, n = config.num_experts, config.hidden_dim, config.intermediate_size
        self.routed_experts = RoutedExperts(experts, hidden, n)

    @property
    def _quant_method(self) -> Any:
        return self.routed_experts.quant_method

    def forward(self, hidden_states: Any, router_logits: Any) -> Any:
        tokens = int(hidden_states.shape[0])
        assert hidden_states.shape[1] == self.moe_config.hidden_dim
        assert router_logits.shape == (tokens, self.moe_config.num_experts)
        for kernel in kernels_for(tokens, self.moe_config):
            load(kernel)
        if self.shared_experts:
            self.shared_output = hidden_states
        if step_ms := float(os.environ.get("FAKE_VLLM_MOE_MS", "0")):
            time.sleep(step_ms * cost(tokens, chosen(tokens, self.moe_config)) / 1000)
        return hidden_states
