"""CuTe-DSL: explicit ``cute.compile`` calls through kernelcache's disk layer, and the DSL's own
file cache for jit-decorated calls.

Warm: the cute-dsl warmer imports the spec's entry points and lets them compile through the
disk layer (``kernelcache.runtime.cute``) into ``files/cute-dsl``. It runs for any arch on a
CPU-only machine: the build runs each arch in its own process with ``CUTE_DSL_ARCH`` set
before the DSL is imported (the variable is read at import).

Serving: ``cutlass.cute.compile`` is routed through the disk layer once the DSL is imported,
which traces each call, keys it by its IR and reports every hit and compile. Strict: a kernel
whose IR is missing from the layer is refused before compiling (``ColdCompileError``). A
build calls the current generation up to date only when a strict lookup of every kernel it
declares would load (``CuteDslWarmer.outdated``).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from kernelcache import progress
from kernelcache.errors import ColdCompileError, WarmError
from kernelcache.runtime import metrics
from kernelcache.runtime.cute import CACHE_DIR_ENV, SUBDIR, CuteDiskCache
from kernelcache.runtime.imports import when_imported
from kernelcache.toolchains.base import Serving, Toolchain, Warmer, WarmerReport, call_entry_points

if TYPE_CHECKING:
    from kernelcache.store import Manifest

log = logging.getLogger(__name__)

JIT_SUBDIR = "cute-dsl-jit"  # the DSL's own file cache (jit-decorated calls)


class CuteDslWarmer(Warmer):
    type = "cute-dsl"
    fills = (SUBDIR,)
    counts_held = True

    def sources(self) -> dict[str, str]:
        """None: each kernel is keyed by its traced IR, which a build traces again before it
        calls a generation up to date (``outdated``); a source factor in the stamp could only
        throw a generation away for an edit that changes no kernel (a comment, a move)."""
        return {}

    def produce(self, files_dir: Path, arch: str, report: WarmerReport) -> None:
        def on_compile(name: str, seconds: float) -> None:
            progress.compiled(self.type, name, seconds)

        # A kernel an earlier generation holds under the same key is taken from there: a
        # build compiles only the kernels whose keys moved.
        with self._routed(
            files_dir, files_dir / SUBDIR, on_compile=on_compile, earlier=self.earlier
        ) as cache:
            report.kernels = self._call(arch)
            if cache.stats.bypassed:
                raise WarmError(
                    f"cute-dsl warmer: {cache.stats.bypassed} compile(s) could not be keyed "
                    "and were not cached (see the warnings above)"
                )
            report.compiled = cache.stats.misses

    def outdated(self, files_dir: Path, arch: str) -> str | None:
        """Trace every kernel and look it up in ``files_dir`` as a strict serving process
        would: the first refusal, or None when every one would load."""
        with self._routed(files_dir, files_dir / SUBDIR, strict=True):
            try:
                self._call(arch)
            except WarmError as exc:
                if isinstance(exc.__cause__, ColdCompileError):
                    return str(exc.__cause__)
                raise
        return None

    def _call(self, arch: str) -> list[str]:
        return call_entry_points(
            self.type, self.config.entry_points, self.spec_dir, self.config.workload, arch
        )

    @contextlib.contextmanager
    def _routed(
        self,
        files_dir: Path,
        root: Path,
        *,
        strict: bool = False,
        on_compile: Callable[[str, float], None] | None = None,
        earlier: tuple[Path, ...] = (),
    ) -> Iterator[CuteDiskCache]:
        """``cute.compile`` through the disk layer at ``root`` for a block, observed (each
        kernel's record explains a later miss) from before any entry point is imported."""
        from kernelcache.runtime import cute as cute_cache
        from kernelcache.runtime import observe

        observe.start(exclude=[files_dir])
        cute_cache.install()
        previous = cute_cache.on_event

        def on_event(kind: str, name: str, seconds: float | None) -> None:
            if kind == "compile" and seconds is not None and on_compile is not None:
                on_compile(name, seconds)
            if previous is not None:
                previous(kind, name, seconds)

        cute_cache.on_event = on_event
        try:
            with cute_cache.cache_dir(root, strict=strict, earlier=earlier) as cache:
                yield cache
        finally:
            cute_cache.on_event = previous
            cute_cache.uninstall()


class CuteDsl(Toolchain):
    def observe(self, serving: Serving) -> None:
        when_imported("cutlass.cute", _install)

    def unchecked(self, manifest: Manifest) -> str | None:
        """Kernels keyed by their traced IR: no stamp says whether they still load."""
        kernels = sum(1 for e in manifest.files if _KERNEL_RECORD.fullmatch(e.path))
        if not kernels:
            return None
        return (
            f"{kernels} CuTe-DSL kernel(s) are keyed by their traced IR, which a stamp check "
            "does not trace: whether they load here is not known (a serving process traces "
            "each, and strict refuses one whose key moved; `kernelcache build --dry-run` "
            "traces them as the build does)"
        )


_KERNEL_RECORD = re.compile(rf"{SUBDIR}/[0-9a-f]{{32}}\.json")


def _install(_: ModuleType) -> None:
    from kernelcache.runtime import cute as disk

    disk.on_event = on_event
    disk.install()
    disk.dsl_stack()  # read the DSL's distributions now, not on the first request's kernel


def on_event(kind: str, name: str, seconds: float | None) -> None:
    """The disk layer's report of a hit or a compile, counted in the serving metrics."""
    if kind == "hit":
        metrics.record_hit("cute-dsl")
    else:
        metrics.record_compile("cute-dsl", name, seconds)


TOOLCHAIN = CuteDsl(
    name="cute-dsl",
    cache_env={CACHE_DIR_ENV: SUBDIR, "CUTE_DSL_CACHE_DIR": JIT_SUBDIR},
    # A hit reads a kernel's .json and its .o, whose bytes the DSL links in memory (no
    # mmap of the file: a noexec mount serves it); only a miss writes, and on a read-only
    # tree it is compiled and then not persisted (a warning), as the DSL's own file cache
    # does with an IR it cannot dump.
    reads_in_place=True,
    warmers=(CuteDslWarmer,),
    requires=("nvidia-cutlass-dsl", "cutlass"),
)
