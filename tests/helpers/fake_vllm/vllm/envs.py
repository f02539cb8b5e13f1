"""As vLLM's: the environment variables the engine reads (the stand-in reads them where it
uses them)."""

from __future__ import annotations

import os

environment_variables = {
    name: (lambda name=name: os.environ.get(name))
    for name in ("VLLM_CACHE_ROOT", "VLLM_ENABLE_STARTUP_PLAN", "VLLM_TUNED_CONFIG_FOLDER")
}
