"""A disk cache for explicit ``cute.compile`` calls, keyed by what the kernel compiles to.

``cute.compile`` in nvidia-cutlass-dsl never consults the DSL's own file cache, so every
process pays the full MLIR compile for every specialization it meets. This layer exports the
object on a miss and loads it with ``cutlass.cute.runtime.load_module`` on a hit.

The key is the DSL front end's output, not a list of what the kernel might depend on: a
kernel is decided by its closure constants, its ``self``, class attributes another module
set, variables a C extension reads, files a subprocess reads; no list of observable reads
holds them all, the traced IR does. So every call is traced (the DSL's trace-finalize hook
runs after tracing and before the MLIR compile), and the key is an explicit dict of named
factors saved beside the artifact in ``<key>.json``: the digest of the traced module printed
without locations (no host path, line or column enters it; names are the DSL's own and
deterministic), the compile options as the DSL resolved them, its compile-affecting settings,
the target arch and the backend's identity (versions and installed-RECORD digests of the
nvidia-cutlass-dsl distributions, which ship the MLIR pipeline and ptxas). A hit means the
``.o`` exists and the saved factors equal the computed ones; the hook then ends the call
before anything is compiled. A miss in strict mode is refused, naming the kernel, the first
line where its IR differs from the nearest recorded one (``<key>.mlir``, kept beside each
kernel) and, from that kernel's record of what its compile read (``observe``), which input
moved: an explanation, never the key.

Writes are atomic (temp file in the same directory, then rename; the ``.json`` commit marker
last), so concurrent processes and threads never see half an artifact. A read-only cache
directory (a materialized generation) still serves hits; a miss there compiles in memory.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import blake3

from kernelcache import contract
from kernelcache.errors import ColdCompileError, KernelCacheError
from kernelcache.runtime import cute_pipeline, observe

log = logging.getLogger(__name__)

CACHE_DIR_ENV = contract.CUTE_DSL_DIR.name
SUBDIR = "cute-dsl"  # the layer's directory under a generation's files/
KEY_FORMAT = "kernelcache.dev/cute-dsl/v5"  # v5: the pipeline as the compiler receives it
OBSERVED_SUBDIR = "observed"  # what each compile read, by content address: explanations
_SHOWN = 120  # characters of an IR line in a refusal


class UncacheableError(ValueError):
    """The DSL offers no trace hook, so a call cannot be keyed and bypasses the cache."""


@dataclass
class CacheStats:
    """What this process's disk layer did; read by tests, benchmarks and the runtime metrics."""

    hits: int = 0
    adopted: int = 0  # taken over from an earlier generation (a build), then loaded
    misses: int = 0
    persisted: int = 0
    bypassed: int = 0
    trace_seconds: float = 0.0  # from the call to its key: what every lookup pays
    compile_seconds: float = 0.0
    load_seconds: float = 0.0
    compiled: list[str] = field(default_factory=list)  # function names compiled on a miss


@cache
def dsl_stack() -> dict[str, str]:
    """Versions and RECORD digests of the DSL distributions (its MLIR pipeline and ptxas are
    in them): a rebuilt DSL is a new key."""
    from importlib.metadata import distributions

    from kernelcache.measure import distribution_factor, distribution_name

    names = sorted(
        {
            name
            for name in map(distribution_name, distributions())
            if name.startswith(("nvidia-cutlass-dsl", "apache-tvm-ffi"))
        }
    )
    return {name: distribution_factor(name) for name in names}


def normalized_ir(module: Any) -> str:
    """The traced module as text without locations: the DSL attaches the tracing frame's file,
    line and column to every op, and neither where the source lives nor its layout changes
    the code (``CUTE_DSL_LINEINFO``, which compiles them in, is a setting in the key)."""
    return module.operation.get_asm(enable_debug_info=False, assume_verified=True)


def key_factors(owner: Any, ir: str, pipeline: str | None = None) -> dict[str, Any]:
    """Every factor that decides the code ``owner`` (the DSL) compiles from traced ``ir``:
    the compile options as its compiler will receive them for this call (``pipeline``: one
    the caller passed), the settings, the arch and the DSL's identity."""
    envar = owner.envar
    return {
        "format": KEY_FORMAT,
        "ir": blake3.blake3(ir.encode()).hexdigest(),
        "options": {
            "pipeline": cute_pipeline.normalised(cute_pipeline.pipeline_of(owner, pipeline)),
            "export": cute_pipeline.export_options(owner),
        },
        "settings": cute_pipeline.settings(envar),
        "arch": str(envar.arch),
        "dsl": dsl_stack(),
    }


def key_digest(factors: dict) -> str:
    canonical = json.dumps(factors, sort_keys=True, separators=(",", ":")).encode()
    return blake3.blake3(canonical).hexdigest()[:32]


def function_name(fn: Any) -> str:
    """``module:qualname`` of what is compiled (a bound method's or an instance's class)."""
    target = getattr(fn, "__func__", fn)
    if not (inspect.isroutine(target) or inspect.isclass(target)):
        target = type(target)
    target = inspect.unwrap(target)
    return f"{target.__module__}:{target.__qualname__}"


_dsl_lock = threading.Lock()


def _supports_trace_hook() -> bool:
    from cutlass.base_dsl.dsl import BaseDSL

    return hasattr(BaseDSL, "trace_finalize_hooks")


# Told of every lookup that reaches a kernel: ("hit" | "compile" | "refused", function name,
# seconds, None when refused). The serving runtime's metrics subscribe here.
on_event: Callable[[str, str, float | None], None] | None = None


def _report(kind: str, name: str, seconds: float | None) -> None:
    if on_event is not None:
        on_event(kind, name, seconds)


@dataclass
class Traced:
    """One call's trace: the function, its key factors, the key and the normalised IR."""

    name: str
    factors: dict[str, Any]
    ir: str
    tvm_ffi: bool  # the calling convention the object is exported with
    key: str = ""

    def __post_init__(self) -> None:
        self.key = key_digest(self.factors)

    @classmethod
    def of(cls, name: str, owner: Any, module: Any, pipeline: str | None = None) -> Traced:
        """The trace the DSL (``owner``) made of ``name`` as ``module`` (``pipeline``: one the
        caller passed to the compile)."""
        ir = normalized_ir(module)
        tvm_ffi = bool(getattr(owner.compile_options, "enable_tvm_ffi", False))
        return cls(name, key_factors(owner, ir, pipeline), ir, tvm_ffi)


class _Replaced(Exception):
    """Carries out of the trace why the pipeline after it cannot be keyed."""


class _Carried(Exception):
    """Carries a result out of the DSL's trace: the compile that would follow is not needed."""

    def __init__(self, value: Any) -> None:
        super().__init__("carried out of the trace")
        self.value = value


def _raised(exc: BaseException) -> BaseException | None:
    """The ``_Carried``, ``_Replaced`` or ``ColdCompileError`` the hook raised, under the
    DSL's wrapping."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None or isinstance(seen, (_Carried, _Replaced, ColdCompileError)):
            return seen
        seen = seen.__cause__ or getattr(seen, "cause", None)
    return None


class CuteDiskCache:
    """``compile(fn, *args, **kwargs)`` that loads from ``root`` on a hit and exports on a miss."""

    def __init__(
        self, root: str | Path, *, strict: bool = False, earlier: Sequence[Path] = ()
    ) -> None:
        self.root = Path(root)
        self.strict = strict
        # Earlier generations' files/ directories (a build's): a kernel whose key has not
        # moved is taken from there, each file checked against that generation's manifest.
        self.earlier = tuple(earlier)
        self.stats = CacheStats()
        self._memory: dict[str, Any] = {}
        self._modules: list[Any] = []  # loaded modules stay referenced while their functions live
        self._guard = threading.Lock()
        self._writable = _writable(self.root)
        if self._writable:  # records explain a later miss; only a layer that persists keeps them
            observe.start()  # a no-op when install() or the warmer started it, earlier

    def compile(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``cute.compile(fn, *args, **kwargs)`` through the cache."""
        return self.compile_with(None, fn, args, kwargs)

    def compile_with(self, selected: Any, fn: Any, args: tuple, kwargs: dict) -> Any:
        """``cute.compile[selected](fn, *args, **kwargs)`` through the cache (``selected``:
        the bracket form's options, such as ``cute.OptLevel(1)``; None for none)."""
        name = function_name(fn)

        def compile_it() -> Any:
            return _compile_with(fn, args, kwargs, selected)

        try:
            if not _supports_trace_hook():
                raise UncacheableError("this nvidia-cutlass-dsl has no trace-finalize hook")
        except (ImportError, UncacheableError) as exc:
            return self._bypass(name, exc, compile_it)
        traced: list[Traced] = []
        start = 0.0

        def at_trace(owner: Any, module: Any, _: str) -> None:
            with observe.unobserved_block():  # keying and loading: the layer's reads
                replaced = cute_pipeline.replaced_pipeline(owner)
                if replaced is not None:
                    raise _Replaced(replaced)
                found = Traced.of(name, owner, module, kwargs.get("pipeline"))
                traced.append(found)
                with self._guard:
                    self.stats.trace_seconds += time.perf_counter() - start
                compiled = self._memory.get(found.key)
                if compiled is None:
                    compiled = self._load(found)
                if compiled is not None:
                    self._memory[found.key] = compiled  # one load per key and process
                    raise _Carried(compiled)
                if self.strict:
                    _report("refused", name, None)
                    raise ColdCompileError(self._refusal(found))

        replaced: _Replaced | None = None
        with _dsl_lock:  # the DSL traces through shared state: one call at a time
            start = time.perf_counter()
            try:
                hooked = {**kwargs, "trace_finalize_hooks": at_trace}
                compiled = _compile_with(fn, args, hooked, selected)
            except Exception as exc:
                raised = _raised(exc)
                if isinstance(raised, _Carried):
                    return raised.value
                if isinstance(raised, ColdCompileError):
                    raise raised from None
                if not isinstance(raised, _Replaced):
                    raise
                replaced = raised
            if replaced is None and not traced:
                # a path the hook does not reach (a device function, say)
                why = UncacheableError("the DSL compiled it without tracing through the hook")
                return self._bypass(name, why, lambda: compiled)
            if replaced is None:
                self._counted(name, time.perf_counter() - start)
                with observe.unobserved_block():
                    self._persist(traced[-1], compiled)
                self._memory[traced[-1].key] = compiled
                return compiled
        # compiled as the replaced pipeline compiles it (strict: refused), never cached
        why = UncacheableError(f"its compile pipeline cannot be keyed: {replaced}")
        return self._bypass(name, why, compile_it)

    def _bypass(self, name: str, why: Exception, compile_it: Callable[[], Any]) -> Any:
        """A call that cannot be keyed: compiled, never cached (refused when strict)."""
        log.warning("kernelcache: cute.compile of %s bypasses the cache: %s", name, why)
        with self._guard:
            self.stats.bypassed += 1
        if self.strict:
            _report("refused", name, None)
            raise ColdCompileError(f"cute-dsl: {name} cannot be keyed in strict mode: {why}")
        start = time.perf_counter()
        compiled = compile_it()
        self._counted(name, time.perf_counter() - start)
        return compiled

    def _paths(self, key: str) -> tuple[Path, Path, Path]:
        return self.root / f"{key}.o", self.root / f"{key}.json", self.root / f"{key}.mlir"

    def _load(self, traced: Traced) -> Any | None:
        obj_path, meta_path, _ = self._paths(traced.key)
        meta = _read_meta(meta_path)
        if meta is None and self._adopt(traced):
            meta = _read_meta(meta_path)
        if meta is None or meta.get("factors") != traced.factors or not obj_path.is_file():
            return None  # absent, half-written or tampered: a miss, never an error
        from cutlass.cute.runtime import load_module

        start = time.perf_counter()
        module = load_module(str(obj_path), enable_tvm_ffi=bool(meta.get("tvm_ffi")))
        compiled = getattr(module, meta["prefix"])
        seconds = time.perf_counter() - start
        with self._guard:
            self._modules.append(module)
            self.stats.hits += 1
            self.stats.load_seconds += seconds
        _report("hit", traced.name, seconds)
        return compiled

    def _adopt(self, traced: Traced) -> bool:
        """Copy ``traced``'s kernel from the first earlier generation that has it under the
        same factors, every file as that generation's manifest records it (the ``.json``
        commit marker last); False when none has it whole."""
        if not self._writable:
            return False
        for files_dir in self.earlier:
            there = files_dir / SUBDIR
            meta = _read_meta(there / f"{traced.key}.json")
            if meta is None or meta.get("factors") != traced.factors:
                continue
            names = [f"{traced.key}.o", f"{traced.key}.mlir"]
            if isinstance(meta.get("observed"), str):
                names.append(f"{OBSERVED_SUBDIR}/{meta['observed']}.json")
            if _copied_as_recorded(files_dir, [*names, f"{traced.key}.json"], self.root):
                with self._guard:
                    self.stats.adopted += 1
                return True
        return False

    def _counted(self, name: str, seconds: float) -> None:
        with self._guard:
            self.stats.misses += 1
            self.stats.compiled.append(name)
            self.stats.compile_seconds += seconds
        _report("compile", name, seconds)

    def _refusal(self, traced: Traced) -> str:
        """One line: the kernel, the first difference from the nearest recorded kernel, and
        which input its record says moved since."""
        line = (
            f"cute-dsl: {traced.name} in {self.root}: no kernel compiled from this IR "
            f"(ir {traced.factors['ir'][:12]}); strict mode refuses a cold compile"
        )
        nearest = self._nearest(traced)
        if nearest is None:
            return f"{line}; no kernel of {traced.name} is recorded there"
        key, meta, ir = nearest
        line += f"; nearest recorded kernel {key}: {_first_difference(traced, meta, ir)}"
        moved = observe.Checker().check(self.root / OBSERVED_SUBDIR, meta.get("observed"))
        if moved is not None:
            return f"{line}; since its compile: {moved}"
        return f"{line}; no input its compile was seen to read has moved"

    def _nearest(self, traced: Traced) -> tuple[str, dict[str, Any], str] | None:
        """The recorded kernel of the same function whose IR differs in the fewest lines."""
        mine = Counter(traced.ir.splitlines())
        best: tuple[int, str, dict[str, Any], str] | None = None
        for meta_path in sorted(self.root.glob("*.json")):
            meta = _read_meta(meta_path)
            if meta is None or meta.get("function") != traced.name:
                continue
            try:
                ir = (self.root / f"{meta_path.stem}.mlir").read_text()
            except OSError:
                ir = ""
            theirs = Counter(ir.splitlines())
            distance = sum(((mine - theirs) + (theirs - mine)).values())
            if best is None or distance < best[0]:
                best = (distance, meta_path.stem, meta, ir)
        return None if best is None else best[1:]

    def _persist(self, traced: Traced, compiled: Any) -> None:
        """Export atomically; failing to persist costs the next process a compile, no more."""
        if not self._writable:
            log.warning(
                "kernelcache: %s is read-only: %s compiled, not kept", self.root, traced.name
            )
            return
        obj_path, meta_path, ir_path = self._paths(traced.key)
        tmp = self.root / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        prefix = f"kc_{traced.key[:24]}"
        try:
            observed = observe.record(self._outputs(), traced.name.partition(":")[0])
            address, record_bytes = observe.digest(observed)
            tmp.mkdir(parents=True)
            if traced.tvm_ffi:  # the TVM-FFI calling convention is generated with the C export
                compiled.export_to_c(str(tmp), traced.key, prefix)
            else:  # the object alone: a C header would need every argument to be C-typed
                (tmp / f"{traced.key}.o").write_bytes(compiled.dump_to_object(prefix))
            os.replace(tmp / f"{traced.key}.o", obj_path)
            (tmp / "ir").write_text(traced.ir)
            os.replace(tmp / "ir", ir_path)
            record_path = self.root / OBSERVED_SUBDIR / f"{address}.json"
            if not record_path.is_file():  # content-addressed: the same record is the same file
                record_path.parent.mkdir(exist_ok=True)
                (tmp / "record").write_bytes(record_bytes)
                os.replace(tmp / "record", record_path)
            meta = {
                "factors": traced.factors,
                "function": traced.name,
                "prefix": prefix,
                "tvm_ffi": traced.tvm_ffi,
                "bytes": obj_path.stat().st_size,
                "observed": address,
            }
            (tmp / "meta").write_text(json.dumps(meta, sort_keys=True, indent=1))
            os.replace(tmp / "meta", meta_path)  # the commit marker, last
            with self._guard:
                self.stats.persisted += 1
        except Exception as exc:  # the DSL's export errors are not OSErrors
            log.warning("kernelcache: could not persist %s to %s: %s", traced.key, self.root, exc)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _outputs(self) -> list[str]:
        """Where compiles write, never what they read: this layer and the DSL's own cache."""
        return [str(self.root), *filter(None, [os.environ.get("CUTE_DSL_CACHE_DIR")])]


def trace(fn: Any, *args: Any, **kwargs: Any) -> Traced:
    """What ``cute.compile(fn, *args, **kwargs)`` is keyed by, traced and not compiled."""
    return trace_with(None, fn, args, kwargs)


def trace_with(selected: Any, fn: Any, args: tuple, kwargs: dict) -> Traced:
    """What ``cute.compile[selected](fn, *args, **kwargs)`` is keyed by, traced and not
    compiled; ``UncacheableError`` when it cannot be keyed."""
    name = function_name(fn)

    def at_trace(owner: Any, module: Any, _: str) -> None:
        replaced = cute_pipeline.replaced_pipeline(owner)
        if replaced is not None:
            raise _Replaced(replaced)
        raise _Carried(Traced.of(name, owner, module, kwargs.get("pipeline")))

    with _dsl_lock:
        try:
            _compile_with(fn, args, {**kwargs, "trace_finalize_hooks": at_trace}, selected)
        except Exception as exc:
            raised = _raised(exc)
            if isinstance(raised, _Carried):
                return raised.value
            if isinstance(raised, _Replaced):
                raise UncacheableError(
                    f"{name}: its compile pipeline cannot be keyed: {raised}"
                ) from None
            raise
    raise UncacheableError(f"{name}: the DSL compiled it without tracing through the hook")


def moved_since(root: Path) -> dict[str, str]:
    """Per function recorded under ``root``: the first input its compile read that differs in
    this process (``observe``), for ``kernelcache explain``. An explanation only: whether a
    kernel still loads is decided by its traced IR."""
    moved: dict[str, str] = {}
    checker = observe.Checker()
    for meta_path in sorted(root.glob("*.json")):
        meta = _read_meta(meta_path)
        if meta is None or not isinstance(meta.get("function"), str):
            continue
        problem = checker.check(root / OBSERVED_SUBDIR, meta.get("observed"))
        if problem is not None:
            moved.setdefault(meta["function"], problem)
    return moved


def _compile_with(fn: Any, args: tuple, kwargs: dict, selected: Any) -> Any:
    """The DSL's own ``cute.compile[selected](fn, *args, **kwargs)``, with options of this
    call's own: the DSL's ``cute.compile`` keeps one options object for every call made
    without a bracket and appends a raw ``CUTE_DSL_COMPILER_OPT`` token to it on each, so its
    n-th compile carries the token n times. Through the cache each call compiles what the
    first call of a fresh process would."""
    import cutlass.cute as cute

    compile_fn: Any = _original_compile or cute.compile
    if hasattr(type(compile_fn), "__getitem__"):
        compile_fn = compile_fn[() if selected is None else selected]
    elif selected is not None:
        raise UncacheableError(f"cute.compile is {compile_fn!r}: it takes no bracket options")
    return compile_fn(fn, *args, **kwargs)


def _copied_as_recorded(files_dir: Path, names: list[str], root: Path) -> bool:
    """Copy ``names`` from ``files_dir/cute-dsl`` into ``root`` (in order, each by rename),
    each only when its bytes are the ones its generation's manifest lists."""
    from kernelcache.store import digest_file
    from kernelcache.store.manifest import load_manifest

    try:
        recorded = {e.path: e.digest for e in load_manifest(files_dir.parent).files}
    except Exception:  # an unreadable earlier generation offers nothing
        return False
    sources = [files_dir / SUBDIR / name for name in names]
    try:
        pairs = list(zip(sources, names, strict=True))
        if any(digest_file(p) != recorded.get(f"{SUBDIR}/{n}") for p, n in pairs):
            return False
        for source, name in pairs:
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                shutil.copyfile(source, tmp)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)  # a staging directory keeps no half copy
    except (OSError, KernelCacheError):  # a file gone or unreadable: compiled instead
        return False
    return True


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _first_difference(traced: Traced, meta: dict[str, Any], ir: str) -> str:
    """The first factor, else the first IR line, where ``traced`` differs from a record."""
    recorded = meta.get("factors") or {}
    for factor, value in traced.factors.items():
        if factor != "ir" and recorded.get(factor) != value:
            return f"its {factor} {_pair(str(recorded.get(factor)), str(value))}"
    theirs, mine = ir.splitlines(), traced.ir.splitlines()
    matcher = difflib.SequenceMatcher(None, theirs, mine, autojunk=False)
    for tag, i1, _, j1, _ in matcher.get_opcodes():
        if tag != "equal":
            was = theirs[i1].strip() if i1 < len(theirs) else "(end)"
            now = mine[j1].strip() if j1 < len(mine) else "(end)"
            return f"IR line {j1 + 1} {_pair(was, now)}"
    return "the same IR (its other factors differ)"


def _pair(was: str, now: str) -> str:
    """``was X, here Y``, each shown around where they first differ."""
    at = next(
        (i for i, (a, b) in enumerate(zip(was, now, strict=False)) if a != b),
        min(len(was), len(now)),
    )
    return f"was {_clip(was, at)}, here {_clip(now, at)}"


def _clip(text: str, at: int) -> str:
    """``text`` around character ``at`` (where it first differs), at most ``_SHOWN`` long."""
    start = max(0, min(at - _SHOWN // 3, len(text) - _SHOWN))
    shown = text[start : start + _SHOWN]
    return repr(("…" if start else "") + shown + ("…" if start + _SHOWN < len(text) else ""))


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
    """Stands in for ``cute.compile``, including the ``cute.compile[options](...)`` form: the
    bracket's options are the DSL's own bracket options in the compile (a string
    ``options=`` stays a keyword, as the DSL takes it)."""

    def __init__(self, options: Any = None) -> None:
        self._options = options

    def __getitem__(self, options: Any) -> _PatchedCompile:
        return _PatchedCompile(options)

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return default_cache().compile_with(self._options, fn, args, kwargs)


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
def cache_dir(
    root: str | Path, *, strict: bool = False, earlier: Sequence[Path] = ()
) -> Iterator[CuteDiskCache]:
    """Point the process-wide cache at ``root`` for a block (the warmer's staging dir;
    ``earlier``: earlier generations' files/ directories it may take unmoved kernels from)."""
    global _default
    saved_env, saved_cache = os.environ.get(CACHE_DIR_ENV), _default
    os.environ[CACHE_DIR_ENV] = str(root)
    _default = CuteDiskCache(root, strict=strict, earlier=earlier)
    try:
        yield _default
    finally:
        _default = saved_cache
        if saved_env is None:
            os.environ.pop(CACHE_DIR_ENV, None)
        else:
            os.environ[CACHE_DIR_ENV] = saved_env
