"""The SM arches kernelcache builds for: the one list every arch check uses.

An arch the spec's pattern admits but no toolchain knows (``sm_91``) must be refused when
the spec is read or the node's arch is resolved, not deep inside a warmer. The list is
CuTe DSL's (``cutlass.base_dsl.enums.Arch``, which Triton and FlashInfer's targets are
within) plus Turing's ``sm_75``, which Triton and FlashInfer still build for; a test
compares it with the installed DSL so a new arch is noticed.

Also the GPU's identity as every component spells it: the arch of a compute capability
(``nvidia-smi``'s ``9.0``, GFD's major/minor labels) and one slug per GPU product.
"""

from __future__ import annotations

import re

KNOWN_ARCHES = (
    "sm_75",
    "sm_80", "sm_86", "sm_87", "sm_89",
    "sm_90", "sm_90a",
    "sm_100", "sm_100a", "sm_100f",
    "sm_101", "sm_101a", "sm_101f",
    "sm_103", "sm_103a", "sm_103f",
    "sm_107", "sm_107a", "sm_107f",
    "sm_110", "sm_110a", "sm_110f",
    "sm_120", "sm_120a", "sm_120f",
    "sm_121", "sm_121a", "sm_121f",
)  # fmt: skip


def arch_problem(arch: str) -> str | None:
    """Why ``arch`` cannot be built for (naming the nearest known ones), or None."""
    if arch in KNOWN_ARCHES:
        return None
    near = [a for a in KNOWN_ARCHES if _major(a) == _major(arch)] or KNOWN_ARCHES
    return f"{arch!r} is not an arch any toolchain knows (known: {', '.join(near)})"


def _major(arch: str) -> str:
    """sm_90a -> "9", sm_121f -> "12": the digits but the last (the minor version)."""
    return arch.removeprefix("sm_").rstrip("af")[:-1]


def from_compute_capability(major: int, minor: int) -> str:
    """9.0 -> sm_90a: from Hopper on, arch-specific features need the "a" target, the one
    kernels are built for."""
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def product_slug(product: str) -> str:
    """One spelling of a GPU product: nvidia-smi says "NVIDIA H200", GFD labels say
    "NVIDIA-H200"; both are ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", product.lower()).strip("-")
