"""One observer per toolchain: count every compile a serving process still runs, and refuse
it in strict mode where the toolchain gives us a place to do so before the compile.

Each observer is installed when its toolchain is imported (``imports.when_imported``), never
by importing it here. What each one sees, and what strict mode can enforce:

- **cute-dsl**: ``cutlass.cute.compile`` is routed through kernelcache's disk layer
  (``runtime.cute``), which reports every hit and compile. Strict: refused before compiling.
- **triton**: ``triton.knobs.compilation.listener`` (Triton >= 3.4) is called by
  ``triton.compile`` with ``cache_hit`` telling a load from the on-disk cache from a real
  compile. (``knobs.runtime.jit_cache_hook`` and ``jit_post_compile_hook`` cannot tell them
  apart: both run on every miss of the in-memory kernel cache, disk hits included.) The
  generation's cache is read through ``triton_cache_manager``, which finds a kernel's files
  after the cache moved. Strict: its group lookup refuses a kernel that is not on disk, which
  is where ``triton.compile`` decides to compile; not installed over a ``TRITON_CACHE_MANAGER``
  of the user's (then Triton compiles are counted only).
- **inductor**: dynamo's compile start/end callbacks bracket each frame compile, and the
  FX-graph cache's own counters (``fxgraph_cache_miss``/``_hit``/``_bypass``) say whether it
  compiled. The kernel label is the compiled frame (``forward (model.py:12)``). Strict: the
  FX-graph cache lookup raises on a miss, before lowering. A bypass (a graph inductor will not
  cache) is counted, not refused. The Triton kernels of a missed graph are compiled in
  inductor's compile workers (other processes, by default): here they are that graph's miss. On
  CPU the C++ kernels of a cache hit are rebuilt unless the generation's ``inductor``
  directory holds them: the Mega-Cache carries graphs, not shared objects.
- **flashinfer**: its ``FLASHINFER_JIT_BUILD_LOG`` (one JSON line per module build) is tailed
  by a thread. Warm loads appear there too, as ninja no-ops of ~0.01 s: a line counts as a
  build only from ``min_seconds`` (0.5 s by default) and only for this process's pid. Strict:
  counted only here; FlashInfer itself refuses when ``FLASHINFER_DISABLE_JIT=1``, which strict
  mode sets when the generation holds AOT modules (FlashInfer is pointed at those in either
  mode, ``use_flashinfer_aot``).

These rely on semi-private hooks of torch and Triton; an observer that finds its hook
missing logs one warning and counts nothing, it never breaks the import.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from kernelcache.runtime import metrics
from kernelcache.runtime.imports import when_imported

log = logging.getLogger(__name__)


def _cold_compile_error(message: str) -> Exception:
    # One exception type for every toolchain, so serving code can catch a refusal as such.
    from kernelcache.runtime.cute import ColdCompileError

    return ColdCompileError(message)


# ------------------------------------------------------------------------------ cute-dsl


def watch_cute() -> None:
    """Route ``cutlass.cute.compile`` through the disk layer once the DSL is imported."""
    when_imported("cutlass.cute", _install_cute)


def _install_cute(_: ModuleType) -> None:
    from kernelcache.runtime import cute as disk

    disk.on_event = _on_cute_event
    disk.install()
    disk.dsl_stack()  # read the DSL's distributions now, not on the first request's kernel


def _on_cute_event(kind: str, name: str, seconds: float | None) -> None:
    if kind == "hit":
        metrics.record_hit("cute-dsl")
    else:
        metrics.record_compile("cute-dsl", name, seconds)


# ------------------------------------------------------------------------------ triton


def watch_triton(strict: bool, poll_seconds: float | None = None) -> None:
    """Count Triton's compiles when it is imported; with ``poll_seconds``, also those of other
    processes sharing its cache directory (``TritonCacheWatch``)."""
    when_imported("triton", lambda _: _install_triton(strict, poll_seconds))


def _install_triton(strict: bool, poll_seconds: float | None) -> None:
    try:
        from triton import knobs
    except ImportError:
        log.warning("kernelcache: this Triton has no knobs (needs 3.4+): compiles not counted")
        return
    previous = knobs.compilation.listener

    def listener(**event: Any) -> None:
        if previous is not None:
            previous(**event)
        if event["cache_hit"]:
            metrics.record_hit("triton")
        else:
            kernel = getattr(event["src"], "name", "?")
            compiled_here.add(triton_cache_entry(event["metadata"].get("hash", "")))
            metrics.record_compile("triton", kernel, event["times"].total / 1e6)

    knobs.compilation.listener = listener
    if poll_seconds is not None:
        watch = TritonCacheWatch(Path(knobs.cache.dir))
        poll_forever(watch.poll, poll_seconds, "kernelcache-triton-cache")
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


def poll_forever(poll: Callable[[], None], interval: float, name: str) -> threading.Thread:
    """``poll()`` every ``interval`` seconds in a daemon thread."""

    def follow() -> None:
        while True:
            poll()
            time.sleep(interval)

    thread = threading.Thread(target=follow, name=name, daemon=True)
    thread.start()
    return thread


# ``TRITON_CACHE_MANAGER`` value for processes that use a generation without install().
TRITON_CACHE_MANAGER = "kernelcache.runtime.hooks:GenerationCacheManager"


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
            if strict and (group is None or filename not in group):
                kernel = filename.removesuffix(".json")
                metrics.record_compile("triton", kernel, None)
                raise _cold_compile_error(
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


# ------------------------------------------------------------------------------ inductor


def watch_inductor(strict: bool, megacache: Path | None) -> None:
    """Count dynamo/inductor compiles; load a Mega-Cache when torch is imported."""
    if megacache is not None:
        when_imported("torch", lambda torch: _load_megacache(torch, megacache))
    when_imported("torch._dynamo", _count_dynamo_compiles)
    if strict:
        when_imported("torch._inductor.codecache", _refuse_fx_graph_misses)


def _load_megacache(torch: Any, path: Path) -> None:
    """``torch.compiler.load_cache_artifacts``: fills the local caches before any compile."""
    start = time.perf_counter()
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as exc:  # another torch's format, or a truncated file: compile instead
        log.warning("kernelcache: Mega-Cache %s not loaded: %s: %s", path, type(exc).__name__, exc)
        metrics.record_dropped("inductor", "megacache-unloadable")
        return
    loaded = sum(len(keys) for keys in info.artifacts.values()) if info is not None else 0
    seconds = time.perf_counter() - start
    log.info(
        "kernelcache: Mega-Cache loaded: %d artifacts from %s in %.2f s", loaded, path, seconds
    )


def keep_tuned_configs() -> None:
    """Serving from a generation: a kernel whose config came from the generation's autotune
    cache is not tuned again.

    Under ``coordinate_descent_tuning`` (max-autotune) inductor re-runs coordinate descent at
    a kernel's first launch unless its config is marked ``found_by_coordesc``, and Triton's
    ``Config`` loses that mark when it is copied or unpickled (3.6). Every serving process
    would then re-tune from the saved best config, compile each neighbour it tries, and
    pick its own winner from noisy timings. A cache hit is already the warm's tuned result
    (inductor itself skips its RBLOCK rescaling on a hit for the same reason).

    Kernels that inductor bundled with a cached graph come back as pickled autotuners that
    still name their module by the path it had in the warm's staging dir, and they look up
    their tuned config beside it: a miss wherever that path is gone (every pod), so they
    were tuned and compiled again. Their lookup is made in this process's inductor cache.
    """
    when_imported("torch._inductor.runtime.triton_heuristics", _keep_tuned_configs)


def _keep_tuned_configs(heuristics: ModuleType) -> None:
    autotuner = getattr(heuristics, "CachingAutotuner", None)
    tune = getattr(autotuner, "coordinate_descent_tuning", None)
    if autotuner is None or tune is None:
        log.warning("kernelcache: unknown inductor autotuner: it may re-tune in serving")
        return

    def coordinate_descent_tuning(self: Any, launcher: Any, *args: Any, **kwargs: Any) -> Any:
        if (getattr(self, "autotune_cache_info", None) or {}).get("autotune_cache_state") == "hit":
            return launcher
        return tune(self, launcher, *args, **kwargs)

    autotuner.coordinate_descent_tuning = coordinate_descent_tuning
    recheck = getattr(autotuner, "recheck_autotune_cache", None)
    if recheck is None:  # a torch that bundles no autotuners
        return
    try:
        from torch._inductor.runtime.runtime_utils import cache_dir
    except ImportError:
        log.warning("kernelcache: unknown inductor cache layout: bundled kernels may re-tune")
        return

    def recheck_autotune_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.filename is not None:
            self.filename = kernel_module_in(Path(cache_dir()), self.filename)
        return recheck(self, *args, **kwargs)

    autotuner.recheck_autotune_cache = recheck_autotune_cache


def kernel_module_in(cache: Path, filename: str) -> str:
    """A kernel module's path in the inductor cache ``cache`` (``<cache>/<xx>/<name>.py``,
    where inductor writes every kernel module it loads), wherever it was written first."""
    module = Path(filename)
    return str(cache / module.parent.name / module.name)


class _FrameCompile(threading.local):
    """The dynamo compile in progress on this thread."""

    kernel = ""
    start = 0.0
    counts: tuple[int, int, int] = (0, 0, 0)
    refused = False


_frame = _FrameCompile()


def _fx_graph_counts() -> tuple[int, int, int]:
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return (
        inductor["fxgraph_cache_miss"],
        inductor["fxgraph_cache_bypass"],
        inductor["fxgraph_cache_hit"],
    )


def _frame_name(compile_id: str) -> str:
    """``forward (model.py:12)``: dynamo records each frame it traces as ``name path:line``."""
    try:
        from torch._dynamo.convert_frame import dynamo_tls

        name, _, where = dynamo_tls.traced_frame_infos[-1].partition(" ")
    except (ImportError, AttributeError, IndexError):
        return f"frame {compile_id}"
    return f"{name} ({os.path.basename(where)})"


def _count_dynamo_compiles(dynamo: Any) -> None:
    handler = getattr(dynamo, "callback_handler", None)
    if handler is None:
        log.warning("kernelcache: this torch has no dynamo compile callbacks: not counted")
        return

    def start(args: Any) -> None:
        _frame.kernel = _frame_name(str(args.compile_id))
        _frame.start = time.perf_counter()
        _frame.counts = _fx_graph_counts()
        _frame.refused = False

    def end(_: Any) -> None:
        now = _fx_graph_counts()
        misses, bypasses, hits = (b - a for a, b in zip(_frame.counts, now, strict=True))
        if misses or bypasses:
            seconds = None if _frame.refused else time.perf_counter() - _frame.start
            metrics.record_compile("inductor", _frame.kernel, seconds, count=misses + bypasses)
        if hits:
            metrics.record_hit("inductor", hits)

    handler.register_start_callback(start)
    handler.register_end_callback(end)


def _refuse_fx_graph_misses(codecache: Any) -> None:
    cache = codecache.FxGraphCache
    lookup = getattr(cache, "load_with_key", None)
    if lookup is None:
        log.warning("kernelcache: this torch's FX graph cache has no load_with_key: not refused")
        return

    def load_with_key(*args: Any, **kwargs: Any) -> Any:
        graph, info = lookup(*args, **kwargs)
        if graph is None and info.get("cache_state") == "miss":
            _frame.refused = True
            where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "the default inductor cache")
            raise _cold_compile_error(
                f"inductor: cold compile of {_frame.kernel or 'a graph'} in strict mode "
                f"(FX graph not in the cache at {where})"
            )
        return graph, info

    cache.load_with_key = staticmethod(load_with_key)


# ------------------------------------------------------------------------------ flashinfer


def use_flashinfer_aot(aot_dir: Path) -> None:
    """Make FlashInfer load prebuilt modules from ``aot_dir`` (``<name>/<name>.so``).

    FlashInfer looks for AOT modules under ``flashinfer.jit.env.FLASHINFER_AOT_DIR`` (its
    package's ``data/aot``), read at each lookup; installed jit-cache providers still apply.
    """
    when_imported("flashinfer.jit.env", lambda env: setattr(env, "FLASHINFER_AOT_DIR", aot_dir))


def refuse_flashinfer_cute_dsl_builds() -> None:
    """Strict mode: a FlashInfer CuTe-DSL kernel (b12x) missing from the generation is refused.

    FlashInfer looks for the kernel's ``.o`` first and calls ``JitSpecCuteDsl.build`` only on
    a miss; the refusal names the kernel, which ``FLASHINFER_DISABLE_JIT``'s error does not.
    """
    when_imported("flashinfer.jit.cute_dsl_core", _refuse_cute_dsl_builds)


def _refuse_cute_dsl_builds(module: ModuleType) -> None:
    def build(spec: Any) -> None:
        kernel = spec.name  # <module>/<kernel>
        metrics.record_compile("flashinfer", kernel, None)
        raise _cold_compile_error(
            f"flashinfer: cold compile of {kernel} in strict mode (not in the generation)"
        )

    module.JitSpecCuteDsl.build = build


class BuildLogTail:
    """Counts the module builds that FlashInfer logs to ``FLASHINFER_JIT_BUILD_LOG``.

    The file contract (FlashInfer 0.7.x): one JSON object per line with ``toolchain``,
    ``name``, ``seconds``, ``pid`` and ``time``, appended by every process that shares the
    file. Only this process's lines count, and a line below ``min_seconds`` is a warm load
    (ninja found the module up to date), counted as a cache hit. Reading starts at the end of
    the file as it was when the tail was created: earlier lines are other processes' history.
    """

    def __init__(self, path: Path, min_seconds: float, pid: int | None = None) -> None:
        self.path = path
        self.min_seconds = min_seconds
        self.pid = os.getpid() if pid is None else pid
        try:
            self._offset = path.stat().st_size
        except OSError:
            self._offset = 0
        self._partial = b""

    def poll(self) -> None:
        """Count the lines appended since the last poll (a line still being written waits)."""
        try:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:  # truncated or replaced
                    self._offset, self._partial = 0, b""
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return  # not created yet: nothing was built
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self._count(line)

    def _count(self, line: bytes) -> None:
        try:
            record = json.loads(line)
            if record.get("pid") != self.pid:
                return
            name, seconds = str(record["name"]), float(record["seconds"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return  # not a build record: FlashInfer's format is the contract, not our input
        if seconds >= self.min_seconds:
            metrics.record_compile("flashinfer", name, seconds)
        else:
            metrics.record_hit("flashinfer")

    def start(self, interval: float) -> threading.Thread:
        return poll_forever(self.poll, interval, "kernelcache-flashinfer-log")
