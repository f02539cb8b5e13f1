"""As vLLM's: the context a forward runs in; a MoE layer's custom op finds itself by index."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    num_tokens: int | None
    moe_layer_index: int = 0


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _current is not None, "Forward context is not set"
    return _current


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Any, vllm_config: Any, num_tokens: int | None = None
) -> Iterator[None]:
    global _current
    previous, _current = _current, ForwardContext(num_tokens)
    try:
        yield
    finally:
        _current = previous
