"""SGLang: its cache directory in the generation, for a command warmer that runs its warm-up.

Nothing is observed in serving yet: the toolchains SGLang drives (Triton, inductor,
FlashInfer) are counted by their own modules.
"""

from __future__ import annotations

from kernelcache.toolchains.base import Toolchain

TOOLCHAIN = Toolchain(
    name="sglang", cache_env={"SGLANG_CACHE_DIR": "sglang"}, requires=("sglang", "sglang")
)
