"""As vLLM's: the wrapper a quant method gets when a modular kernel runs the experts (the
stand-in never wraps one; the tuning unwraps it where vLLM does)."""

from __future__ import annotations

from typing import Any


class FusedMoEModularMethod:
    def __init__(self, old_quant_method: Any, moe_kernel: Any) -> None:
        self.old_quant_method = old_quant_method
        self.moe_kernel = moe_kernel
