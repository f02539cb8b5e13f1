from __future__ import annotations

from typing import Any

from vllm.utils import jit_monitor

# Kernels loaded in this process (Triton's in-memory cache is per process, not per rank).
LOADED: set[str] = set()


def kernel_for(num_tokens: int) -> str:
    block = 16 if num_tokens <= 64 else 128
    return f"fused_moe_kernel[BLOCK_SIZE_M={block},div16={num_tokens % 16 == 0}]"


class GPUModelRunner:
    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> None:
        self._forward(scheduler_output.total_num_scheduled_tokens)

    def _dummy_run(
        self, num_tokens: int, skip_eplb: bool = False, remove_lora: bool = True
    ) -> None:
        self._forward(num_tokens)

    def _forward(self, num_tokens: int) -> None:
        kernel = kernel_for(num_tokens)
        if kernel not in LOADED:
            LOADED.add(kernel)
            jit_monitor.on_kernel_load(kernel)
