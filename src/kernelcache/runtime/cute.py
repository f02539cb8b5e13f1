"""A disk cache for explicit ``cute.compile`` calls.

``cute.compile`` in nvidia-cutlass-dsl never consults the DSL's own file cache, so every
process pays the full MLIR compile for every specialization it meets. This layer keys each
call by what decides the compiled code, exports the object on a miss and
loads it with ``cutlass.cute.runtime.load_module`` on a hit (no MLIR compile at all).

The key is an explicit dict of named factors, saved beside the artifact in ``<key>.json``:
the function's qualified name, digests of its module's source and of every project-local module
that module imports, transitively (``kernelcache.sources``), the argument signature
(tensor dtype/shape/stride/alignment/memory space, scalar types and values), the compile
options, the DSL stack (versions and installed-RECORD digests of the nvidia-cutlass-dsl
distributions), the target arch and the compile-affecting ``CUTE_DSL_*`` settings. A hit means
the ``.o`` exists and the saved factors equal the computed ones. A factor that cannot be
computed (a function without a source file, an argument with no stable description) bypasses
the cache rather than weakening the key.

Beside the key, each kernel keeps a record of what its compile observably read
(``kernelcache.runtime.observe``: modules however imported, files opened or mapped, the
distributions they belong to, variables read), content-addressed in ``observed/<digest>.json``
and named in ``<key>.json``. A hit also needs that record to hold here; strict refuses one
that does not, naming the file or variable, and permissive compiles (counted as stale).

Writes are atomic (temp file in the same directory, then rename; the ``.json`` commit marker
last), so concurrent processes and threads never see half an artifact. A read-only cache
directory (a materialized generation) still serves hits; a miss there compiles in memory.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import blake3

from kernelcache import contract
from kernelcache.errors import ColdCompileError
from kernelcache.runtime import observe

log = logging.getLogger(__name__)

CACHE_DIR_ENV = contract.CUTE_DSL_DIR.name
KEY_FORMAT = "kernelcache.dev/cute-dsl/v3"  # v3: a record of what the compile read
OBSERVED_SUBDIR = "observed"  # the records, by content address
# Fallback only: CUTE_DSL_* settings that say where to write or what to log.
_NON_CODE_SETTING_MARKERS = ("DIR", "PATH", "FILE", "LOG", "DUMP", "PRINT", "KEEP", "CACHE")


class UncacheableError(ValueError):
    """A factor of the key cannot be computed, so the call must bypass the cache."""


@dataclass
class CacheStats:
    """What this process's disk layer did; read by tests, benchmarks and the runtime metrics."""

    hits: int = 0
    misses: int = 0
    persisted: int = 0
    bypassed: int = 0
    stale: int = 0  # hits refused because what the compile read differs here
    compile_seconds: float = 0.0
    load_seconds: float = 0.0
    compiled: list[str] = field(default_factory=list)  # function names compiled on a miss
    unobserved: dict[str, None] = field(default_factory=dict)  # what records could not see


@cache
def dsl_stack() -> dict[str, str]:
    """Versions and RECORD digests of the DSL distributions: a rebuilt DSL is a new key."""
    from importlib.metadata import distributions

    from kernelcache.stamp import distribution_factor, distribution_name

    names = sorted(
        {
            name
            for name in map(distribution_name, distributions())
            if name.startswith(("nvidia-cutlass-dsl", "apache-tvm-ffi"))
        }
    )
    return {name: distribution_factor(name) for name in names}


@cache
def _module_sources(module: str, path: str) -> dict[str, str]:
    """The function's module and every project-local module it imports (``kernelcache.sources``),
    read once per process: the code this process runs is the code it imported first."""
    from kernelcache.sources import ABSENT, SourceError, module_sources, script_sources

    try:
        found = module_sources(module) if module != "__main__" else {}
        if found.get(module, ABSENT) == ABSENT:  # a script, or a module loaded from a path
            found = script_sources(path)
    except SourceError as exc:
        raise UncacheableError(exc.message) from exc
    return found


def _function_factors(fn: Any) -> dict[str, Any]:
    target = inspect.unwrap(getattr(fn, "func", fn))
    if not (inspect.isroutine(target) or inspect.isclass(target)):
        return _instance_factors(target)
    try:
        source = inspect.getsourcefile(target)
    except TypeError as exc:
        raise UncacheableError(f"{target!r} has no source file") from exc
    if not source or not os.path.isfile(source):
        raise UncacheableError(f"{target!r} has no source file")
    return {
        "function": f"{target.__module__}:{target.__qualname__}",
        "source": _module_sources(target.__module__, source),
    }


def _instance_factors(kernel: Any) -> dict[str, Any]:
    """A configured kernel object: its class's source and the configuration it says it has.

    FlashInfer's kernel classes expose ``__cache_key__`` (every setting that changes the
    generated code), the key it memoizes their compiles under in-process.
    """
    config = getattr(kernel, "__cache_key__", None)
    if config is None:
        raise UncacheableError(f"{type(kernel).__qualname__} object has no __cache_key__")
    factors = _function_factors(type(kernel))
    factors["instance"] = describe_argument(tuple(config))
    return factors


def describe_argument(arg: Any) -> str:
    """A stable description of one compile argument; raises UncacheableError when there is none."""
    if isinstance(arg, (bool, int, float, str)) or arg is None:
        return f"{type(arg).__name__}:{arg!r}"
    if isinstance(arg, (tuple, list)):
        return "(" + ",".join(describe_argument(a) for a in arg) + ")"
    kind = type(arg)
    if kind.__module__.startswith("torch") and hasattr(arg, "data_ptr"):
        ptr = arg.data_ptr()
        align = 16 if ptr % 16 == 0 else (ptr & -ptr)
        return (
            f"torch.Tensor<{arg.dtype},{tuple(arg.shape)},{arg.stride()},"
            f"{arg.device.type},align={align}>"
        )
    if hasattr(arg, "element_type") and hasattr(arg, "shape") and hasattr(arg, "stride"):
        parts = [
            f"dtype={arg.element_type.__name__}",
            f"shape={arg.shape}",
            f"stride={arg.stride}",
            f"memspace={getattr(arg, 'memspace', None)}",
        ]
        for attr in ("_assumed_align", "assumed_align", "_use_32bit_stride"):
            if hasattr(arg, attr):
                parts.append(f"{attr.lstrip('_')}={getattr(arg, attr)}")
        return f"Tensor<{','.join(parts)}>"
    if kind.__name__ in ("_FakeStream", "FakeStream", "CUstream"):
        return "stream"
    if kind.__name__ == "_Pointer" and hasattr(arg, "memspace"):  # cute.runtime.make_ptr
        align = getattr(arg, "_assumed_align", None)
        return f"Pointer<dtype={arg.dtype.__name__},memspace={arg.memspace},align={align}>"
    if isinstance(arg, type):  # a dtype such as cutlass.Float16 passed as a constexpr
        return f"type:{arg.__module__}.{arg.__qualname__}"
    text = repr(arg)
    if " at 0x" in text or "object at" in text:
        raise UncacheableError(f"argument of type {kind.__qualname__} has no stable description")
    return f"{kind.__module__}.{kind.__qualname__}:{text}"


def _unpathed(value: str) -> str:
    """Keep the tail of a path (``cu12/lib/libx.so``: the variant) and drop the install prefix.

    Each path of a list (``a.so:b.so``, as ``CUTE_DSL_LIBS`` takes) keeps its own tail.
    """
    return re.sub(r"'?/[^;':]*/([^/;':]+/[^/;':]+/[^/;':]+)'?", r"\1", value)


def _dsl_settings() -> tuple[str, str]:
    """(arch, compile-affecting settings) as the DSL itself keys its JIT cache.

    Read from the DSL's environment manager, which marks each ``CUTE_DSL_*`` setting as
    affecting compile or not and knows the arch it targets (set, or detected from the GPU).
    Path-valued settings are reduced to their variant: install paths are never factors.
    """
    try:
        from cutlass.cutlass_dsl import CuTeDSL

        envar = CuTeDSL._get_dsl().envar
        return str(envar.arch), _unpathed(envar.cache_key_str())
    except (ImportError, AttributeError):  # another DSL version: fall back to the variables
        from kernelcache.errors import NoGpuInfoError
        from kernelcache.stamp import detect_arch

        settings = ";".join(
            f"{k}={v}"
            for k, v in sorted(os.environ.items())
            if k.startswith("CUTE_DSL_") and not any(m in k for m in _NON_CODE_SETTING_MARKERS)
        )
        try:
            return detect_arch(), settings
        except NoGpuInfoError as exc:
            raise UncacheableError(exc.message) from exc


def key_factors(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], options: Any) -> dict:
    """Every factor that decides the compiled code of ``cute.compile(fn, *args, **kwargs)``."""
    arch, settings = _dsl_settings()
    return {
        "format": KEY_FORMAT,
        **_function_factors(fn),
        "args": [describe_argument(a) for a in args],
        "kwargs": {k: describe_argument(v) for k, v in sorted(kwargs.items())},
        "options": "" if options is None else repr(options),
        "dsl": dsl_stack(),
        "arch": arch,
        "settings": settings,
    }


def key_digest(factors: dict) -> str:
    canonical = json.dumps(factors, sort_keys=True, separators=(",", ":")).encode()
    return blake3.blake3(canonical).hexdigest()[:32]


# Told of every lookup that reaches a kernel: ("hit" | "compile" | "refused", function name,
# seconds, None when refused). The serving runtime's metrics subscribe here.
on_event: Callable[[str, str, float | None], None] | None = None


def _report(kind: str, name: str, seconds: float | None) -> None:
    if on_event is not None:
        on_event(kind, name, seconds)


class CuteDiskCache:
    """``compile(fn, *args, **kwargs)`` that loads from ``root`` on a hit and exports on a miss."""

    def __init__(self, root: str | Path, *, strict: bool = False) -> None:
        self.root = Path(root)
        self.strict = strict
        self.stats = CacheStats()
        self._memory: dict[str, Any] = {}
        self._modules: list[Any] = []  # loaded modules stay referenced while their functions live
        self._guard = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._checker = observe.Checker()
        if _writable(self.root):  # only a layer that persists needs records
            observe.start()  # a no-op when install() or the warmer started it, earlier

    def compile(self, fn: Any, *args: Any, options: Any = None, **kwargs: Any) -> Any:
        try:
            with observe.unobserved_block():  # keying reads sources: kernelcache's reads
                factors = key_factors(fn, args, kwargs, options)
        except UncacheableError as exc:
            log.warning("kernelcache: cute.compile bypasses the cache: %s", exc)
            with self._guard:
                self.stats.bypassed += 1
            return self._compile_now(fn, args, kwargs, options, factors=None)
        key = key_digest(factors)
        with self._lock_for(key):
            if key in self._memory:
                return self._memory[key]
            with observe.unobserved_block():  # the layer's own files, not the kernel's
                compiled = self._load(key, factors)
            if compiled is None:
                compiled = self._compile_now(fn, args, kwargs, options, factors=factors)
                with observe.unobserved_block():
                    self._persist(key, factors, compiled)
            self._memory[key] = compiled
            return compiled

    def _lock_for(self, key: str) -> threading.Lock:
        with self._guard:
            return self._key_locks.setdefault(key, threading.Lock())

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.root / f"{key}.o", self.root / f"{key}.json"

    def _load(self, key: str, factors: dict) -> Any | None:
        obj_path, meta_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            return None  # absent or half-written: a miss, never an error
        if meta.get("factors") != factors or not obj_path.is_file():
            return None
        problem = self._checker.check(self.root / OBSERVED_SUBDIR, meta.get("observed"))
        if problem is not None:
            name = factors["function"]
            with self._guard:
                self.stats.stale += 1
            if self.strict:
                _report("refused", name, None)
                raise ColdCompileError(f"cute-dsl: {name} in {self.root} is stale: {problem}")
            log.warning("kernelcache: cute-dsl: %s is stale, compiling: %s", name, problem)
            return None
        from cutlass.cute.runtime import load_module

        start = time.perf_counter()
        module = load_module(str(obj_path), enable_tvm_ffi=bool(meta.get("tvm_ffi")))
        compiled = getattr(module, meta["prefix"])
        seconds = time.perf_counter() - start
        with self._guard:
            self._modules.append(module)
            self.stats.hits += 1
            self.stats.load_seconds += seconds
        _report("hit", factors["function"], seconds)
        return compiled

    def _compile_now(
        self, fn: Any, args: tuple, kwargs: dict, options: Any, *, factors: dict | None
    ) -> Any:
        name = factors["function"] if factors else getattr(fn, "__qualname__", repr(fn))
        if self.strict:
            _report("refused", name, None)
            raise ColdCompileError(
                f"cute-dsl: cold compile of {name} in strict mode (not in the cache at {self.root})"
            )
        import cutlass.cute as cute

        compile_fn = _original_compile or cute.compile
        start = time.perf_counter()
        if options is not None:
            kwargs = {**kwargs, "options": options}
        compiled = compile_fn(fn, *args, **kwargs)
        seconds = time.perf_counter() - start
        with self._guard:
            self.stats.misses += 1
            self.stats.compiled.append(name)
            self.stats.compile_seconds += seconds
        _report("compile", name, seconds)
        return compiled

    def _persist(self, key: str, factors: dict, compiled: Any) -> None:
        """Export atomically; failing to persist costs the next process a compile, no more."""
        obj_path, meta_path = self._paths(key)
        tmp = self.root / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        prefix = f"kc_{key[:24]}"
        module = factors["function"].partition(":")[0]
        try:
            observed = observe.record(self._outputs(), module)
            address, record_bytes = observe.digest(observed)
            with self._guard:
                self.stats.unobserved.update(dict.fromkeys(observed["unobserved"]))
            tmp.mkdir(parents=True)
            tvm_ffi = "--enable-tvm-ffi" in factors["options"]
            if tvm_ffi:  # the TVM-FFI calling convention is generated with the C export
                compiled.export_to_c(str(tmp), key, prefix)
            else:  # the object alone: a C header would need every argument to be C-typed
                (tmp / f"{key}.o").write_bytes(compiled.dump_to_object(prefix))
            os.replace(tmp / f"{key}.o", obj_path)
            record_path = self.root / OBSERVED_SUBDIR / f"{address}.json"
            if not record_path.is_file():  # content-addressed: the same record is the same file
                record_path.parent.mkdir(exist_ok=True)
                (tmp / "record").write_bytes(record_bytes)
                os.replace(tmp / "record", record_path)
            size = obj_path.stat().st_size
            meta = {
                "factors": factors,
                "prefix": prefix,
                "tvm_ffi": tvm_ffi,
                "bytes": size,
                "observed": address,
            }
            (tmp / "meta").write_text(json.dumps(meta, sort_keys=True, indent=1))
            os.replace(tmp / "meta", meta_path)  # the commit marker, last
            with self._guard:
                self.stats.persisted += 1
        except Exception as exc:  # the DSL's export errors are not OSErrors
            log.warning("kernelcache: could not persist %s to %s: %s", key, self.root, exc)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _outputs(self) -> list[str]:
        """Where compiles write, never what they read: this layer and the DSL's own cache."""
        return [str(self.root), *filter(None, [os.environ.get("CUTE_DSL_CACHE_DIR")])]


def _writable(root: Path) -> bool:
    """Whether this layer can persist under ``root`` (its nearest existing folder)."""
    for folder in (root, *root.parents):
        if folder.exists():
            return os.access(folder, os.W_OK)
    return False


_default: CuteDiskCache | None = None
_original_compile: Callable[..., Any] | None = None


def default_cache() -> CuteDiskCache:
    """The process-wide cache at ``$KERNELCACHE_CUTE_DSL_DIR`` (``KERNELCACHE_STRICT=1``)."""
    global _default
    root = Path(
        os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "kernelcache" / "cute-dsl"
    )
    if _default is None or _default.root != root:
        _default = CuteDiskCache(root, strict=contract.STRICT.read(os.environ))
    return _default


def compile(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Drop-in for ``cute.compile`` backed by the process-wide disk cache."""
    return default_cache().compile(fn, *args, **kwargs)


class _PatchedCompile:
    """Stands in for ``cute.compile``, including the ``cute.compile[options](...)`` form."""

    def __init__(self, options: Any = None) -> None:
        self._options = options

    def __getitem__(self, options: Any) -> _PatchedCompile:
        return _PatchedCompile(options)

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._options is not None:
            kwargs.setdefault("options", self._options)
        return default_cache().compile(fn, *args, **kwargs)


def install() -> None:
    """Route ``cutlass.cute.compile`` through the disk cache, for code you do not own.

    Code that bound ``compile`` before this call (``from cutlass.cute import compile``) keeps
    the original; call ``install()`` before importing such modules.
    """
    global _original_compile
    default_cache()  # a writable one observes from now: before the callers import kernels
    import cutlass.cute as cute

    if _original_compile is None:
        _original_compile = cute.compile
        setattr(cute, "compile", _PatchedCompile())  # noqa: B010 - a module attribute swap


def uninstall() -> None:
    global _original_compile
    if _original_compile is not None:
        import cutlass.cute as cute

        setattr(cute, "compile", _original_compile)  # noqa: B010
        _original_compile = None


@contextlib.contextmanager
def cache_dir(root: str | Path, *, strict: bool = False) -> Iterator[CuteDiskCache]:
    """Point the process-wide cache at ``root`` for a block (the warmer's staging dir)."""
    global _default
    saved_env, saved_cache = os.environ.get(CACHE_DIR_ENV), _default
    os.environ[CACHE_DIR_ENV] = str(root)
    _default = CuteDiskCache(root, strict=strict)
    try:
        yield _default
    finally:
        _default = saved_cache
        if saved_env is None:
            os.environ.pop(CACHE_DIR_ENV, None)
        else:
            os.environ[CACHE_DIR_ENV] = saved_env
