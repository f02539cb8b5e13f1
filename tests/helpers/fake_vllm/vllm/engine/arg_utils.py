"""As vLLM's: imported by ``vllm serve`` before anything else of the engine (the hooks note it);
``EngineArgs`` names the engine arguments ``vllm serve`` takes as flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineArgs:
    model: str = ""
    load_format: str = "auto"
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float = 0.9
    skip_tokenizer_init: bool = False
    attention_backend: str | None = None
    compilation_config: dict[str, Any] = field(default_factory=dict)
