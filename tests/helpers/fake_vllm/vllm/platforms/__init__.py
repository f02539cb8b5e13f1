"""As vLLM's: the platform the engine runs on (``interface.Platform``)."""

from __future__ import annotations

from vllm.platforms.interface import Platform

current_platform = Platform()
