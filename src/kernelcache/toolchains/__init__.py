"""The toolchains kernelcache drives, one module each, found here rather than listed.

Every module of this package (``base`` aside) declares ``TOOLCHAIN``, a
``base.Toolchain``: its cache variables and ``files/`` subdirectories, its warmers, its
serving environment and observers, its tuning-scoped files. Adding a toolchain is adding a
module; this registry, the warm (``kernelcache.build``), the init-container and the serving
runtime (``kernelcache.runtime.install``) read the declarations from here.

The modules are imported on first use, not with this package, and stay light at import
(torch, Triton, the DSL and FlashInfer are imported inside their functions).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kernelcache.errors import SpecError, WarmError

if TYPE_CHECKING:
    from kernelcache.spec import GpuClass, LearnedKey
    from kernelcache.spec import Warmer as WarmerSpec
    from kernelcache.toolchains.base import Toolchain, Warmer

__all__ = [
    "cache_env",
    "in_place_dirs",
    "is_tuning_file",
    "make_warmers",
    "serving_settings",
    "toolchains",
    "warmer_class",
]


@functools.cache
def toolchains() -> tuple[Toolchain, ...]:
    """Every toolchain of this package, by name."""
    found = []
    for module_info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        toolchain = getattr(module, "TOOLCHAIN", None)
        if toolchain is not None:
            found.append(toolchain)
    return tuple(sorted(found, key=lambda t: t.name))


def cache_env() -> dict[str, str]:
    """Cache variable -> subdirectory of files/ it is pointed at, for every toolchain."""
    return {var: sub for t in toolchains() for var, sub in t.cache_env.items()}


def in_place_dirs() -> frozenset[str]:
    """The files/ subdirectories a serving pod may read in place from a read-only mount: those
    of the cache variables of toolchains that only read them (``Toolchain.reads_in_place``).
    Every other file is copied; a subdirectory is one toolchain's (``cache_env``)."""
    return frozenset(sub for t in toolchains() if t.reads_in_place for sub in t.cache_env.values())


def check_warmer_env(warmers: Sequence[WarmerSpec], source: str) -> None:
    """Refuse a warmer ``env`` that sets a cache variable: the warm points each one into the
    generation, so the value given would be dropped without a word."""
    owned = cache_env()
    for i, warmer in enumerate(warmers):
        for var in warmer.env:
            if var in owned:
                raise SpecError(
                    f"{source}: spec.warmers[{i}].env.{var}: kernelcache points it at the "
                    f"generation's files/{owned[var]}; remove it from env",
                    path=source,
                )


def check_installed(
    warmers: Sequence[WarmerSpec],
    source: str,
    *,
    import_them: bool,
    positions: Sequence[int] | None = None,
) -> None:
    """Every package the warmers need (their toolchain's ``requires``) is here, checked
    before any warmer runs: a missing one is a missing package (exit 13) at the start, not
    a failed warm (exit 11) after the warmers before it compiled. ``import_them``: imported
    (the warm process, which imports them anyway; a broken install fails here too), else
    found without importing (a parent that runs each warm in its own process).
    ``positions``: each warmer's index in ``spec.warmers`` (an arch's warmers are a subset)."""
    import importlib.util

    from kernelcache.errors import NotInstalledError, one_line

    for i, warmer in zip(positions or range(len(warmers)), warmers, strict=True):
        owner = next(t for t in toolchains() if any(w.type == warmer.type for w in t.warmers))
        if owner.requires is None:
            continue
        dist, module = owner.requires
        problem = None
        if importlib.util.find_spec(module) is None:
            problem = f"{dist} is not installed (no module {module})"
        elif import_them:
            try:
                importlib.import_module(module)
            except Exception as exc:  # what an installed package raises at import is its own
                problem = f"{dist} is installed but import {module} fails: {one_line(exc)}"
        if problem is not None:
            raise NotInstalledError(
                f"{source}: spec.warmers[{i}] ({warmer.type}): {problem}",
                path=source,
                field=f"spec.warmers[{i}].type",
            )


def serving_settings() -> dict[str, str]:
    """Every toolchain's fixed serving settings (``Toolchain.serving_settings``)."""
    return {name: value for t in toolchains() for name, value in t.serving_settings.items()}


def is_tuning_file(path: str) -> bool:
    """Whether ``path`` (as named under files/) holds tuning valid for one GPU product."""
    return any(
        path.endswith(t.tuning_suffixes) or path.startswith(t.tuning_prefixes) for t in toolchains()
    )


def warmer_class(kind: str) -> type[Warmer]:
    """The warmer of a ``spec.warmers[].type``."""
    for toolchain in toolchains():
        for warmer in toolchain.warmers:
            if warmer.type == kind:
                return warmer
    raise WarmError(f"{kind} warmer: no toolchain provides it")


def make_warmers(
    configs: list[WarmerSpec],
    spec_dir: Path | None = None,
    gpu_classes: Sequence[GpuClass] = (),
    learned: Sequence[LearnedKey] = (),
) -> list[Warmer]:
    """Each warmer with the GPU classes it compiles for (``gpuClasses``; all when it names
    none) and what serving learned; its toolchain checks the installation first
    (``Toolchain.check_warm``: a vLLM outside the range is refused before any stamp)."""
    for config in configs:
        for toolchain in toolchains():
            if any(w.type == config.type for w in toolchain.warmers):
                toolchain.check_warm(config)
    return [
        warmer_class(c.type)(c, spec_dir, [g for g in gpu_classes if c.compiles_for(g)], learned)
        for c in configs
    ]
