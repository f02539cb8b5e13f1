"""The triton warmer: run the spec's entry points with Triton's caches inside the generation.

Triton keeps two things under ``TRITON_CACHE_DIR``: compiled binaries (a directory per kernel
specialization) and, with autotune caching on (``TRITON_CACHE_AUTOTUNING=1`` or
``@triton.autotune(cache_results=True)``, Triton >= 3.4), the config each autotuned kernel
chose, as ``<kernel>.autotune.json`` in a directory keyed by Triton, the target, the kernel's
source, the tuning key and the configs. Binaries alone are not enough: a serving process
then still benchmarks every config (1.33 s instead of 0.50 s for an 8-config matmul on an
H200), so this warmer turns autotune caching on and checks the results appeared.

Triton never caches a tuning whose configs have a ``pre_hook`` (it cannot serialize the
hook), and says nothing about it: such a kernel re-tunes in every process. The warmer watches
every autotuner that runs and reports those as not cacheable, and a kernel named in the
warmer's ``expect`` list fails the warm unless its autotune result was written.

Triton compiles for the GPU it runs on and has no cross-compile mode, so this warmer runs
only on a node whose GPU is of the target arch (unlike cute-dsl, which builds any arch on a
CPU). The build runs each arch in its own process, and the cache variables are set before
Triton or an entry point is imported: an autotuner reads the caching switch when it is made.

Triton's binary cache does not survive a move on its own: the ``__grp__<kernel>.json`` file
that commits a kernel lists its files by the absolute paths they were written to, and Triton
drops every listed file that is not at that path. Moved from the warm's staging dir into a
generation and then a serving pod, every kernel would compile again (into a read-only mount:
an error). ``kernelcache.runtime`` reads the generation through a cache manager that finds
the files beside the group file instead (``runtime.hooks.triton_cache_manager``).

A serving process uses the generation through ``kernelcache.runtime.install()``, which sets
``TRITON_CACHE_DIR=<generation>/files/triton``, ``TRITON_CACHE_AUTOTUNING=1`` (Triton reads an
autotune result only when caching is on) and that cache manager, in the environment too
(``TRITON_CACHE_MANAGER=kernelcache.runtime.hooks:GenerationCacheManager``) so that the
processes it starts inherit it; without the runtime, set the three yourself.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelcache import progress
from kernelcache.errors import WarmError
from kernelcache.warm import (
    CACHE_ENV,
    Warmer,
    WarmerReport,
    call_entry_points,
    record_growth,
    scoped_env,
    snapshot,
)

log = logging.getLogger(__name__)

SUBDIR = CACHE_ENV["TRITON_CACHE_DIR"]
AUTOTUNE_SUFFIX = ".autotune.json"
# Triton cuts a kernel's name to this many characters in its cache file names.
NAME_LIMIT = 150


@dataclass
class TritonReport(WarmerReport):
    """The warm report plus what Triton's autotuner did."""

    autotuned: list[str] = field(default_factory=list)  # kernels whose tuning was saved
    not_cacheable: list[str] = field(default_factory=list)  # kernels that re-tune every time


# Triton-specific.


def check_arch(arch: str, target: Any) -> None:
    """Refuse to warm ``arch`` on a GPU of another arch: Triton cannot cross-compile."""
    wanted = re.fullmatch(r"sm_([0-9]+)[af]?", arch)
    if target.backend == "cuda" and wanted is not None and int(wanted[1]) == target.arch:
        return
    raise WarmError(
        f"triton warmer: the visible GPU is {target.backend} {target.arch}, not {arch}; "
        "Triton compiles only for the GPU it runs on and cannot cross-compile, so run this "
        f"arch's warm on a {arch} node"
    )


def _visible_target() -> Any:
    """The target Triton compiles for in this process (the current GPU)."""
    from triton.runtime.driver import driver

    try:
        return driver.active.get_current_target()
    except Exception as exc:  # no driver, no device: Triton has nothing to compile for
        raise WarmError(
            f"triton warmer: no GPU visible to Triton ({' '.join(str(exc).split())}); "
            "Triton compiles only for the GPU it runs on and cannot cross-compile"
        ) from exc


def has_pre_hook(autotuner: Any) -> bool:
    """True when Triton will never cache this autotuner's choice (a config has a pre_hook)."""
    return len(autotuner.configs) > 1 and any(c.pre_hook for c in autotuner.configs)


@dataclass
class TritonWatch:
    """What Triton did while installed: real compiles and the autotuners that ran."""

    compiled: list[str] = field(default_factory=list)  # kernel name per compile (no disk hit)
    autotuners: dict[str, Any] = field(default_factory=dict)  # kernel name -> Autotuner

    @property
    def not_cacheable(self) -> list[str]:
        return sorted(name for name, tuner in self.autotuners.items() if has_pre_hook(tuner))

    @contextlib.contextmanager
    def installed(self) -> Iterator[TritonWatch]:
        """Hook Triton's compilation listener and ``Autotuner.run`` for the duration."""
        from triton import knobs
        from triton.runtime.autotuner import Autotuner

        previous = knobs.compilation.listener
        original_run = Autotuner.run

        def listener(*, src: Any, cache_hit: bool, **kwargs: Any) -> None:
            if not cache_hit:
                self.compiled.append(src.name)
                times = kwargs.get("times")
                seconds = times.total / 1e6 if times is not None else 0.0  # microseconds
                progress.compiled("triton", src.name, seconds)
            if previous is not None:
                previous(src=src, cache_hit=cache_hit, **kwargs)

        def run(tuner: Any, *args: Any, **kwargs: Any) -> Any:
            self.autotuners.setdefault(tuner.base_fn.__name__, tuner)
            # An autotuner made before caching was switched on (its module was imported
            # earlier in this process) would tune without saving; the interpreter never saves.
            tuner.cache_results = not knobs.runtime.interpret
            return original_run(tuner, *args, **kwargs)

        with knobs.compilation.scope():
            knobs.compilation.listener = listener
            Autotuner.run = run
            try:
                yield self
            finally:
                Autotuner.run = original_run


class TritonWarmer(Warmer):
    type = "triton"

    def run(self, files_dir: Path, arch: str) -> WarmerReport:
        target = files_dir / SUBDIR
        target.mkdir(parents=True, exist_ok=True)
        before = snapshot(files_dir, [SUBDIR])
        report = TritonReport(warmer=self.label)
        start = time.perf_counter()
        cache_env = {"TRITON_CACHE_DIR": str(target), "TRITON_CACHE_AUTOTUNING": "1"}
        with scoped_env({**self.config.env, **cache_env}):
            try:
                import triton
                from triton import knobs
            except ImportError as exc:
                raise WarmError(
                    f"triton warmer needs Triton >= 3.4 (autotune result caching): {exc}"
                ) from exc
            check_arch(arch, _visible_target())
            # The variables above are enough unless this process set the knobs explicitly.
            with knobs.cache.scope(), knobs.autotuning.scope(), TritonWatch().installed() as watch:
                knobs.cache.dir = str(target)
                knobs.autotuning.cache = True
                report.kernels = call_entry_points(
                    self.type, self.config.entry_points, self.spec_dir, self.config.workload, arch
                )
        report.seconds = round(time.perf_counter() - start, 3)
        report.compiled = len(watch.compiled)
        new = {p: size for p, size in snapshot(files_dir, [SUBDIR]).items() if p not in before}
        record_growth(report, files_dir, new)
        report.autotuned = sorted(
            {p.name.removesuffix(AUTOTUNE_SUFFIX) for p in new if p.name.endswith(AUTOTUNE_SUFFIX)}
        )
        report.not_cacheable = watch.not_cacheable
        check_expected(self.config.expect, report)
        for name in report.not_cacheable:
            log.warning(
                "triton kernel %s: its autotune configs have a pre_hook, which Triton never "
                "caches; it will re-tune in every serving process (Triton %s)",
                name,
                triton.__version__,
            )
        return report


def check_expected(expect: Iterable[str], report: TritonReport) -> None:
    """Fail when a kernel the spec names left no autotune result, saying why when known."""
    for name in expect:
        if name in report.not_cacheable:
            raise WarmError(
                f"triton warmer: expected kernel {name} cannot be cached: its autotune configs "
                "have a pre_hook, which Triton never saves, so it would re-tune in every process"
            )
        if name[:NAME_LIMIT] not in report.autotuned:
            raise WarmError(
                f"triton warmer: expected kernel {name} left no autotune result (it did not run, "
                "or ran with a single config)"
            )
