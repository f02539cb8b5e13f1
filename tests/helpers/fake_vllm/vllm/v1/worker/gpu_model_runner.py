from __future__ import annotations

from typing import Any


class GPUModelRunner:
    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> None:
        self._forward(scheduler_output.total_num_scheduled_tokens)

    def _dummy_run(
        self, num_tokens: int, skip_eplb: bool = False, remove_lora: bool = True
    ) -> None:
        self._forward(num_tokens)

    def _forward(self, num_tokens: int) -> None:
        """Every MoE layer of the model on ``num_tokens`` tokens (kernels load once)."""
        from vllm.model_executor.layers.fused_moe import kernels_for, load

        context = self.vllm_config.compilation_config.static_forward_context
        for name in self.vllm_config.compilation_config.static_all_moe_layers:
            for kernel in kernels_for(num_tokens, context[name].moe_config):
                load(kernel)
