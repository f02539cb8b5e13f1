"""As vLLM's: armed once at the end of warm-up, then every first kernel load is an event."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.jit_monitor")
_active = False
_mode = "warn"


def activate(*, mode: str = "warn", verbose: bool = False) -> None:
    global _active, _mode
    _active, _mode = True, mode
    logger.info("Kernel JIT monitor activated; mode=%s.", mode)


def is_active() -> bool:
    return _active


def _handle_jit_event(*, backend: str, event: str, fn_name: str, detail: str | None = None) -> None:
    message = f"{backend} {event} during inference: {fn_name}"
    if _mode == "error":
        raise RuntimeError(message)
    logger.warning(message)


def on_kernel_load(fn_name: str) -> None:
    if _active:
        _handle_jit_event(backend="Triton", event="kernel JIT compilation", fn_name=fn_name)
