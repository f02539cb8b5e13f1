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
an error). A serving process reads the generation through a cache manager that finds the
files beside the group file instead (``triton_cache_manager``).

A serving process uses the generation through ``kernelcache.runtime.install()``, which sets
``TRITON_CACHE_DIR=<generation>/files/triton``, ``TRITON_CACHE_AUTOTUNING=1`` (Triton reads an
autotune result only when caching is on) and that cache manager, in the environment too
(``TRITON_CACHE_MANAGER=kernelcache.toolchains.triton:GenerationCacheManager``) so that the
processes it starts inherit it; without the runtime, set the three yourself.

Serving counts every compile through ``triton.knobs.compilation.listener`` (Triton >= 3.4),
called by ``triton.compile`` with ``cache_hit`` telling a load from the on-disk cache from a
real compile (``knobs.runtime.jit_cache_hook`` and ``jit_post_compile_hook`` cannot tell them
apart: both run on every miss of the in-memory kernel cache, disk hits included); the warm
uses the same listener (``listen``). Strict: the cache manager's group lookup refuses a
kernel that is not on disk, which is where ``triton.compile`` decides to compile; not
installed over a ``TRITON_CACHE_MANAGER`` of the user's (then Triton compiles are counted
only). A poll of the cache directory counts the compiles of other processes that share it
(inductor's compile workers), which the listener in this process cannot see.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelcache import progress
from kernelcache.errors import ColdCompileError, WarmError
from kernelcache.runtime import metrics, ready
from kernelcache.runtime.imports import when_imported
from kernelcache.toolchains.base import (
    Serving,
    Toolchain,
    Warmer,
    WarmerReport,
    call_entry_points,
    poll_forever,
)

log = logging.getLogger(__name__)

SUBDIR = "triton"
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

        original_run = Autotuner.run

        def compiled(kernel: str, seconds: float, kernel_hash: str) -> None:
            self.compiled.append(kernel)
            progress.compiled("triton", kernel, seconds)

        def run(tuner: Any, *args: Any, **kwargs: Any) -> Any:
            self.autotuners.setdefault(tuner.base_fn.__name__, tuner)
            # An autotuner made before caching was switched on (its module was imported
            # earlier in this process) would tune without saving; the interpreter never saves.
            tuner.cache_results = not knobs.runtime.interpret
            return original_run(tuner, *args, **kwargs)

        with knobs.compilation.scope():
            listen(compiled)
            Autotuner.run = run
            try:
                yield self
            finally:
                Autotuner.run = original_run


def listen(
    on_compile: Callable[[str, float, str], None], on_hit: Callable[[], None] = lambda: None
) -> None:
    """Chain a listener onto ``knobs.compilation.listener``: ``on_compile(kernel, seconds,
    hash)`` for each real compile, ``on_hit()`` for each load from the disk cache."""
    from triton import knobs

    previous = knobs.compilation.listener

    def listener(*, src: Any, cache_hit: bool, **event: Any) -> None:
        if previous is not None:
            previous(src=src, cache_hit=cache_hit, **event)
        if cache_hit:
            on_hit()
            return
        times = event.get("times")
        seconds = times.total / 1e6 if times is not None else 0.0  # microseconds
        kernel_hash = (event.get("metadata") or {}).get("hash", "")
        on_compile(getattr(src, "name", "?"), seconds, kernel_hash)

    knobs.compilation.listener = listener


class TritonWarmer(Warmer):
    type = "triton"
    report_type = TritonReport
    fills = (SUBDIR,)

    def env(self, files_dir: Path, arch: str) -> dict[str, str]:
        return {"TRITON_CACHE_DIR": str(files_dir / SUBDIR), "TRITON_CACHE_AUTOTUNING": "1"}

    def produce(self, files_dir: Path, arch: str, report: TritonReport) -> None:
        try:
            from triton import knobs
        except ImportError as exc:
            raise WarmError(
                f"triton warmer needs Triton >= 3.4 (autotune result caching): {exc}"
            ) from exc
        check_arch(arch, _visible_target())
        # The variables above are enough unless this process set the knobs explicitly.
        with knobs.cache.scope(), knobs.autotuning.scope(), TritonWatch().installed() as watch:
            knobs.cache.dir = str(files_dir / SUBDIR)
            knobs.autotuning.cache = True
            report.kernels = call_entry_points(
                self.type, self.config.entry_points, self.spec_dir, self.config.workload, arch
            )
        report.compiled = len(watch.compiled)
        report.not_cacheable = watch.not_cacheable

    def check_expected(self, report: TritonReport, grown: Mapping[Path, int], arch: str) -> None:
        import triton

        report.autotuned = sorted(
            {
                p.name.removesuffix(AUTOTUNE_SUFFIX)
                for p in grown
                if p.name.endswith(AUTOTUNE_SUFFIX)
            }
        )
        check_expected(self.config.expect, report)
        for name in report.not_cacheable:
            log.warning(
                "triton kernel %s: its autotune configs have a pre_hook, which Triton never "
                "caches; it will re-tune in every serving process (Triton %s)",
                name,
                triton.__version__,
            )


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


# ------------------------------------------------------------------------------ serving


def watch(strict: bool, poll_seconds: float | None = None) -> None:
    """Count Triton's compiles when it is imported; with ``poll_seconds``, also those of other
    processes sharing its cache directory (``TritonCacheWatch``)."""
    when_imported("triton", lambda _: _install(strict, poll_seconds))


def _install(strict: bool, poll_seconds: float | None) -> None:
    try:
        from triton import knobs
    except ImportError:
        log.warning("kernelcache: this Triton has no knobs (needs 3.4+): compiles not counted")
        return

    def compiled(kernel: str, seconds: float, kernel_hash: str) -> None:
        compiled_here.add(triton_cache_entry(kernel_hash))
        metrics.record_compile("triton", kernel, seconds, key=kernel_hash)

    listen(compiled, lambda: metrics.record_hit("triton"))
    if poll_seconds is not None:
        cache_watch = TritonCacheWatch(Path(knobs.cache.dir))
        poll_forever(cache_watch.poll, poll_seconds, "kernelcache-triton-cache")
    if os.environ.get("TRITON_CACHE_MANAGER", TRITON_CACHE_MANAGER) != TRITON_CACHE_MANAGER:
        log.warning(
            "kernelcache: TRITON_CACHE_MANAGER is set: the generation's Triton cache is read by "
            "that manager (not relocated) and Triton compiles are counted, not refused"
        )
        return
    knobs.cache.manager_class = triton_cache_manager(strict)


# Triton cache entries (directory names) of the kernels this process compiled.
compiled_here: set[str] = set()


def triton_cache_entry(kernel_hash: str) -> str:
    """The cache directory Triton files a compiled kernel under: its hash in base32."""
    try:
        return base64.b32encode(bytes.fromhex(kernel_hash)).decode().rstrip("=")
    except ValueError:
        return kernel_hash


class TritonCacheWatch:
    """Counts the Triton compiles of other processes that share this process's Triton cache.

    The listener sees only this process's compiles; inductor's compile workers and an engine's
    helper processes compile elsewhere and are seen only by what they write: Triton files a
    compiled kernel in a new ``<entry>/`` directory, its ``__grp__<kernel>.json`` last. Entries
    present when the watch starts are the generation's. A new entry with a group file that
    this process's listener did not count by the next poll is counted here, once by every
    process that watches the directory, without seconds. One directory listing per poll.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done = self._entries()
        self._grouped: dict[str, list[str]] = {}  # new entries with group files: their kernels

    def _entries(self) -> set[str]:
        try:
            return set(os.listdir(self.root))
        except OSError:
            return set()  # not created yet

    def _kernels(self, entry: str) -> list[str]:
        return [
            group.name.removeprefix("__grp__").removesuffix(".json")
            for group in (self.root / entry).glob("__grp__*.json")
        ]

    def poll(self) -> None:
        for entry, kernels in sorted(self._grouped.items()):
            if entry not in compiled_here:
                for kernel in kernels:
                    metrics.record_compile_elsewhere("triton", kernel)
        self._done |= self._grouped.keys()
        # an entry without a group file is still being written, or holds no kernel (autotune
        # results): looked at again next poll
        new = {entry: self._kernels(entry) for entry in self._entries() - self._done}
        self._grouped = {entry: kernels for entry, kernels in new.items() if kernels}


# ``TRITON_CACHE_MANAGER`` value for processes that use a generation without install().
TRITON_CACHE_MANAGER = "kernelcache.toolchains.triton:GenerationCacheManager"


def triton_cache_manager(strict: bool) -> type:
    """Triton's file cache for a generation: relocatable, and refusing misses when strict.

    A ``__grp__<kernel>.json`` group file lists the kernel's files by the absolute paths they
    were first written to, and Triton drops every listed file that is not at that path: a
    cache moved from the warm's staging dir into a generation and a serving pod would compile
    every kernel again (into a read-only mount: an error). Every file of a kernel sits beside
    its group file, so the file name is enough. In strict mode a kernel the cache does not
    hold raises at the group lookup, the point where ``triton.compile`` decides to compile;
    autotune results and launcher stubs use ``get_file`` and are not affected.
    """
    from triton.runtime.cache import FileCacheManager

    class GenerationCacheManager(FileCacheManager):
        def get_group(self, filename: str) -> dict[str, str] | None:
            group = self._group_beside(filename)
            if ready.refusing(strict) and (group is None or filename not in group):
                kernel = filename.removesuffix(".json")
                metrics.record_compile("triton", kernel, None)
                raise ColdCompileError(
                    f"triton: cold compile of {kernel} in strict mode "
                    f"(not in the cache at {os.path.dirname(self.cache_dir)})"
                )
            return group

        def _group_beside(self, filename: str) -> dict[str, str] | None:
            group_file = self.get_file(f"__grp__{filename}")
            if group_file is None:
                return None
            with open(group_file) as f:
                children = json.load(f).get("child_paths")
            if children is None:
                return None
            found = {name: self._make_path(os.path.basename(p)) for name, p in children.items()}
            return {name: path for name, path in found.items() if os.path.exists(path)}

    return GenerationCacheManager


def __getattr__(name: str) -> Any:
    # Made on first use: it subclasses Triton's cache manager, and this module must import
    # where Triton is absent.
    if name == "GenerationCacheManager":
        cls = globals()[name] = triton_cache_manager(strict=False)
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Triton(Toolchain):
    def observe(self, serving: Serving) -> None:
        watch(serving.config.strict, serving.config.poll_seconds)


TOOLCHAIN = Triton(
    # Not read in place: its FileCacheManager makes a kernel's directory at every lookup, so a
    # miss on a read-only tree raises instead of compiling, and its launchers are dlopen'ed
    # (an image volume is noexec).
    name="triton",
    cache_env={"TRITON_CACHE_DIR": SUBDIR},
    serving_settings={
        # Triton reads a saved autotune result only with autotune caching on.
        "TRITON_CACHE_AUTOTUNING": "1",
        # Processes this one starts without the runtime (an engine's helpers, compile
        # workers) read the generation's relocated Triton cache too, instead of compiling.
        "TRITON_CACHE_MANAGER": TRITON_CACHE_MANAGER,
    },
    tuning_suffixes=(AUTOTUNE_SUFFIX,),  # the config each autotuned kernel chose
    warmers=(TritonWarmer,),
    requires=("triton", "triton"),
)
