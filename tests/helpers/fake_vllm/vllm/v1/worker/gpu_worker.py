from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.startup_plan import maybe_apply_startup_plan, maybe_save_startup_plan

log = logging.getLogger("vllm.worker")


@dataclass
class _ModelConfig:
    model: str
    dtype: str = "bfloat16"
    max_model_len: int = 2048


@dataclass
class _CompilationConfig:
    static_forward_context: dict[str, Any] = field(default_factory=dict)
    static_all_moe_layers: list[str] = field(default_factory=list)
    cudagraph_capture_sizes: list[int] = field(default_factory=lambda: [64, 32, 16, 8, 4, 2, 1])
    compile_sizes: list[int] | None = None
    compile_ranges_endpoints: list[int] | None = None


@dataclass
class _SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int = 256


@dataclass
class _ParallelConfig:
    tensor_parallel_size: int


@dataclass
class _VllmConfig:
    model_config: _ModelConfig
    compilation_config: _CompilationConfig
    scheduler_config: _SchedulerConfig
    parallel_config: _ParallelConfig


def moe_layers(model: str, config: _VllmConfig) -> None:
    """The model's MoE layers (its config.json), registered as vLLM registers them."""
    import torch

    from vllm.model_executor.layers.fused_moe import FusedMoEConfig, MoERunner

    c = json.loads((Path(model) / "config.json").read_text())
    moe = FusedMoEConfig(
        num_experts=c["num_experts"],
        experts_per_token=c["num_experts_per_tok"],
        hidden_dim=c["hidden_size"],
        intermediate_size=c["moe_intermediate_size"],
        in_dtype=torch.bfloat16,
    )
    for layer in range(c["num_hidden_layers"]):
        name = f"model.layers.{layer}.mlp.experts"
        config.compilation_config.static_forward_context[name] = MoERunner(
            name, moe, int(c.get("n_shared_experts") or 0)
        )
        config.compilation_config.static_all_moe_layers.append(name)


@dataclass
class _CacheConfig:
    kv_cache_memory_bytes: int | None = None


@dataclass
class _Snapshot:
    free_memory: int


class Worker:
    def __init__(
        self,
        model: str,
        root: Path,
        dtype: str,
        rank: int = 0,
        world_size: int = 1,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
    ):
        self.dtype, self.rank, self.world_size = dtype, rank, world_size
        self.vllm_config = _VllmConfig(
            _ModelConfig(model, max_model_len=max_model_len),
            _CompilationConfig(),
            _SchedulerConfig(max_num_batched_tokens, max_num_seqs),
            _ParallelConfig(world_size),
        )

        self.cache_config = _CacheConfig()
        free_gib = float(os.environ.get("FAKE_VLLM_FREE_GIB", "139.29"))
        self.init_snapshot = _Snapshot(int(free_gib * 2**30))
        self.root = root
        self.model_runner = GPUModelRunner(self.vllm_config)

    def load_model(self) -> None:
        moe_layers(self.vllm_config.model_config.model, self.vllm_config)

    def load_or_compile(self) -> bool:
        """True when the cache was there; a cache written at another root crashes."""
        import vllm

        path = vllm.cache_file(self.root, self.rank)
        if not path.exists():
            vllm.write_cache(self.root, self.vllm_config.model_config.model, self.dtype, self.rank)
            return False
        artifact = Path(json.loads(path.read_text())["artifact"])
        if not artifact.exists():
            raise FileNotFoundError(f"compiled artifact {artifact} not found")
        aot = self.root / "torch_compile_cache" / "torch_aot_compile"
        aot.mkdir(exist_ok=True)
        (aot / f"written-on-load-{self.rank}").write_text("x")
        return True

    def determine_available_memory(self) -> int:
        maybe_apply_startup_plan(self)
        if self.cache_config.kv_cache_memory_bytes is None:
            log.info("Memory profiling takes 1.00 seconds")
            kv_bytes = self.init_snapshot.free_memory // 2
            maybe_save_startup_plan(self, kv_bytes)
            return kv_bytes
        return self.cache_config.kv_cache_memory_bytes

    def execute_model(self, scheduler_output: Any) -> None:
        self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any) -> None:
        self.model_runner.sample_tokens(grammar_output)

    def compile_or_warm_up_model(self) -> None:
        for size in self.vllm_config.compilation_config.cudagraph_capture_sizes:
            self.model_runner._dummy_run(size)
        from vllm.utils.jit_monitor import activate as activate_jit_monitor

        activate_jit_monitor(mode=getattr(self, "jit_monitor_mode", "warn"))
