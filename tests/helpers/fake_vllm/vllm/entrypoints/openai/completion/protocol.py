"""As vLLM's: the fields of a ``/v1/completions`` request the warm sends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CompletionRequest:
    model: str
    prompt: Any
    max_tokens: int = 16
    temperature: float = 1.0
    ignore_eos: bool = False
    return_token_ids: bool | None = None
