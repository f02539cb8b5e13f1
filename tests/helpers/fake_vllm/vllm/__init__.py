"""A stand-in for vLLM on machines without a GPU: the same hook points, the same path binding.

What it mimics (read from vLLM 0.26.0): ``LLM(**engine_args)`` builds a ``Worker`` that loads
the model and then ``compile_or_warm_up_model()`` runs dummy forwards for the CUDA-graph sizes
and arms ``vllm.utils.jit_monitor`` at its end; a forward loads one "fused-MoE kernel" per
(block size, divisibility) of its token count, and once the monitor is armed a kernel's first
load in the process is a JIT event (a raise in ``error`` mode). The compile cache under
``VLLM_CACHE_ROOT`` names its own absolute path: read from any other root, the engine fails, as
vLLM's does.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from vllm.v1.worker.gpu_worker import Worker

logging.getLogger("vllm").setLevel(logging.INFO)
log = logging.getLogger("vllm.engine")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    ignore_eos: bool = False
    detokenize: bool = True


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class _Output:
    outputs: list[_Completion]


class LLM:
    def __init__(self, model: str, max_num_batched_tokens: int = 2048, **kwargs: object) -> None:
        self.model = model
        self.chunk = max_num_batched_tokens
        root = Path(os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT", "~/.cache/vllm")))
        self.worker = Worker(model, root, str(kwargs.get("dtype", "auto")))
        self.worker.load_model()
        compiled = self.worker.load_or_compile()
        log.info("torch.compile took %.2f s in total", 0.01 if compiled else 0.5)
        self.worker.jit_monitor_mode = str(kwargs.get("jit_monitor_mode", "warn"))
        self.worker.compile_or_warm_up_model()

    def generate(
        self, prompts: list[dict[str, list[int]]], params: SamplingParams, use_tqdm: bool = False
    ) -> list[_Output]:
        tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        while tokens > 0:
            self.worker.model_runner.execute_model(_Scheduled(min(tokens, self.chunk)))
            tokens -= self.chunk
        for _ in range(params.max_tokens):
            self.worker.model_runner.execute_model(_Scheduled(len(prompts)))
        return [
            _Output(
                [
                    _Completion(
                        [(sum(p["prompt_token_ids"]) + i) % 32000 for i in range(params.max_tokens)]
                    )
                ]
            )
            for p in prompts
        ]


@dataclass
class _Scheduled:
    total_num_scheduled_tokens: int


def cache_file(root: Path) -> Path:
    return (
        root / "torch_compile_cache" / "abc123" / "rank_0_0" / "backbone" / "vllm_compile_cache.py"
    )


def write_cache(root: Path, model: str, dtype: str) -> None:
    path = cache_file(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"artifact": str(path.parent / "artifact_0")}))
    (path.parent / "artifact_0").write_bytes(b"compiled graph")
    (path.parent / "cache_key_factors.json").write_text(
        json.dumps({"model": model, "dtype": dtype})
    )
