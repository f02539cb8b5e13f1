"""As vLLM's: the platform the engine runs on (a CUDA GPU, unless ``FAKE_VLLM_PLATFORM``)."""

from __future__ import annotations

import os


class Platform:
    def is_cuda(self) -> bool:
        return os.environ.get("FAKE_VLLM_PLATFORM", "cuda") == "cuda"
