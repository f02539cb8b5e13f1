"""The serving side: use a materialized generation, and observe every compile that still happens.

``install()`` (or ``KERNELCACHE_RUNTIME=1`` with the ``zz_kernelcache_runtime.pth`` hook, which
calls it at interpreter start, so that engines need no code change; the hook belongs in the
site-packages that holds kernelcache and its dependencies) reads one ``contract.Settings`` from
the environment and then:

1. checks the generation's stamp against this environment (``kernelcache_stamp_mismatch``,
   one log line naming the factor; strict mode refuses to start);
2. points every toolchain cache variable of ``kernelcache.warm.CACHE_ENV`` at the
   generation's ``files/<subdir>``, leaving any variable the user already set alone (the
   default an earlier import of ``torch._inductor`` wrote for itself does not count);
3. when the generation holds FlashInfer AOT modules (``FLASHINFER_AOT_SUBDIR``), points
   FlashInfer at them and, in strict mode, sets ``FLASHINFER_DISABLE_JIT=1``;
4. hooks each toolchain when the application imports it (``runtime.hooks``): the CuTe-DSL
   disk layer, Triton's compile listener, dynamo/inductor compile callbacks, the torch
   Mega-Cache (``files/torch-compile/megacache.bin``, loaded when torch is imported unless
   inductor already reads the generation's own ``files/inductor``), inductor's tuned configs
   kept from re-tuning (``observe_torch``), and a tail of FlashInfer's build log; a poll of
   Triton's cache directory counts the compiles of other processes that share it (inductor's
   compile workers), which Triton's listener in this process cannot see;
5. for vLLM (``runtime.vllm``): runs the forward sizes the warm recorded before vLLM's JIT
   monitor arms, arms it in ``error`` mode under strict, counts its events, and checks the
   engine's model and the cache root (``vllm_root``) against the generation's stamp;
6. serves ``/metrics`` when ``KERNELCACHE_METRICS_PORT`` is set.

The environment contract is ``kernelcache.contract``: every ``KERNELCACHE_*`` variable, read
once into a ``contract.Settings`` (a malformed value is one SpecError line naming it), after
the init-container's env file (``KERNELCACHE_ENV_FILE``, ``kernelcache.envfile``) is taken
as defaults.

Nothing here imports torch, Triton, the DSL or FlashInfer; the generation's manifest and
stamp are read with kernelcache's own (pure Python) modules, only when a generation is set.
Pattern: the runtime never takes a workload down because of the cache (warn, count, compile)
unless strict mode asks it to.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kernelcache import envfile
from kernelcache.contract import CacheKey, Settings
from kernelcache.errors import (
    ExitCode,
    KernelCacheError,
    MissingGenerationError,
    StorageError,
)
from kernelcache.runtime import hooks, metrics, vllm
from kernelcache.runtime.metrics import serve_metrics

if TYPE_CHECKING:
    from kernelcache.stamp import FactorDiff
    from kernelcache.store import Manifest

__all__ = [
    "FLASHINFER_AOT_SUBDIR",
    "MEGACACHE_FILE",
    "SERVING_SETTINGS",
    "Runtime",
    "autoinstall",
    "install",
    "observe_torch",
    "serve_metrics",
]

log = logging.getLogger(__name__)

# Set (unless already set) besides the cache directories when serving from a generation.
SERVING_SETTINGS = {
    # Triton reads a saved autotune result only with autotune caching on.
    "TRITON_CACHE_AUTOTUNING": "1",
    # Inductor's kernels are loaded from the generation, not compiled: no compile-worker pool
    # to start (seconds), and a compile that still happens stays in this process, counted.
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
    # Processes this one starts without the runtime (an engine's helpers, compile workers)
    # read the generation's relocated Triton cache too, instead of compiling every kernel.
    "TRITON_CACHE_MANAGER": hooks.TRITON_CACHE_MANAGER,
}

# Written by the torch-compile warmer from torch.compiler.save_cache_artifacts().
MEGACACHE_FILE = "torch-compile/megacache.bin"
# The flashinfer warmer's prebuilt modules, in FlashInfer's own AOT layout
# (``<name>/<name>.so``). Non-empty means FlashInfer can run with JIT disabled; a warm JIT
# workspace (``files/flashinfer`` as FLASHINFER_WORKSPACE_BASE) is not enough for that,
# since FLASHINFER_DISABLE_JIT refuses it too.
FLASHINFER_AOT_SUBDIR = "flashinfer/aot"


@dataclass
class Runtime:
    """What ``install()`` did in this process."""

    config: Settings
    manifest: Manifest | None = None
    # Factors in which the generation's stamp differs from this environment.
    stamp_diffs: list[FactorDiff] = field(default_factory=list)
    # The variables install() set, and their values (the user's own are not listed).
    env: dict[str, str] = field(default_factory=dict)
    metrics_port: int | None = None


_installed: Runtime | None = None


def install(generation_dir: str | os.PathLike[str] | None = None) -> Runtime:
    """Set up this process for serving from a generation (``KERNELCACHE_DIR`` by default).

    Call it before the toolchains are imported (the ``.pth`` hook does), so that their cache
    variables are read after they are pointed at the generation. Cache variables the user
    already set are left as they are. Idempotent: a second call returns the first result.
    Raises SpecError for a malformed variable and, in strict mode only, StampMismatchError or
    the error that makes the generation unusable (missing, unreadable, malformed manifest).
    """
    global _installed
    if _installed is not None:
        return _installed
    envfile.apply()
    config = Settings.from_env()
    if generation_dir is not None:
        config = replace(config, generation_dir=Path(generation_dir))
    runtime = Runtime(config)
    files = None
    if config.generation_dir is not None:
        files = _open_generation(runtime, config.generation_dir)
    if files is not None:
        _point_caches(runtime, files)
    _observe(runtime, files)
    if config.metrics_port:
        runtime.metrics_port = _serve(config)
    _installed = runtime
    return runtime


def _open_generation(runtime: Runtime, directory: Path) -> Path | None:
    """Read and stamp-check the generation; its files/ directory, or None when unusable."""
    from kernelcache import stamp as stamps
    from kernelcache.store import FILES_DIR

    config = runtime.config
    try:
        manifest = _read_manifest(directory)
        here = stamps.check_environment(manifest.stamp, manifest.generation, config.arch)
    except KernelCacheError as exc:
        metrics.record_verify_failure(exc.code.name.lower())
        if config.strict:
            raise
        log.warning("kernelcache: %s; serving without a generation", exc.message)
        return None
    runtime.manifest, runtime.stamp_diffs = manifest, here.diffs
    metrics.set_generation(
        name=config.name or CacheKey.parse(manifest.key).cache,
        arch=config.arch or here.recorded.factors.get("arch", ""),
        generation=manifest.generation,
        stamp=here.recorded.digest,
        mismatch=bool(here.diffs),
    )
    if (error := here.error) is not None:
        metrics.record_verify_failure(error.code.name.lower())
        if config.strict:
            raise error
        # Still used: each toolchain keys its own artifacts, so whatever does not fit this
        # environment misses (and is counted) rather than being loaded.
        log.warning("kernelcache: %s", error.message)
    _check_vllm_root(manifest, config.strict)
    return directory / FILES_DIR


def _check_vllm_root(manifest: Manifest, strict: bool) -> None:
    """vLLM reads its cache at the root it was built at: the init-container put it there."""
    from kernelcache import vllm_root

    root = vllm_root.recorded_root(manifest)
    if root is None or not (lost := vllm_root.missing(manifest, root)):
        return
    error = StorageError(
        f"{root}: the vLLM cache root lacks {len(lost)} of the generation's files, e.g. "
        f"{lost[0]} (kernelcache verify --materialize puts them there)",
        path=str(root),
    )
    if strict:
        raise error
    log.warning("kernelcache: %s; vLLM will compile what is missing", error.message)


def _read_manifest(directory: Path) -> Manifest:
    from kernelcache.store import MANIFEST_NAME, Manifest

    path = directory / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise MissingGenerationError(
            f"{directory}: not a generation ({MANIFEST_NAME} missing)", path=str(path)
        ) from None
    except OSError as exc:
        raise StorageError(f"{path}: cannot read: {exc.strerror}", path=str(path)) from None
    return Manifest.parse(data, str(path))


def _set_default(runtime: Runtime, name: str, value: str) -> None:
    if name not in os.environ or _set_by_inductor(name):
        os.environ[name] = value
        runtime.env[name] = value


def _set_by_inductor(name: str) -> bool:
    """Whether ``name`` holds inductor's own default, written by torch rather than the user.

    Importing ``torch._inductor`` (``compile_fx``, say) sets ``TORCHINDUCTOR_CACHE_DIR`` to
    ``/tmp/torchinductor_<user>`` when it is unset. An application that imports it before
    ``install()`` would otherwise serve from that empty default instead of the generation.
    Inductor reads the variable again at every cache access, so pointing it later works.
    """
    if name != "TORCHINDUCTOR_CACHE_DIR" or "torch._inductor" not in sys.modules:
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch: its default is not known here
        return False
    return os.environ[name] == os.path.abspath(default_cache_dir())


def _point_caches(runtime: Runtime, files: Path) -> None:
    from kernelcache.warm import CACHE_ENV

    if "torch._inductor.config" in sys.modules:
        log.warning(
            "kernelcache: torch._inductor was imported before kernelcache.runtime.install(): "
            "settings inductor reads at import (TORCHINDUCTOR_COMPILE_THREADS=1) do not apply; "
            "install first, or set KERNELCACHE_RUNTIME=1"
        )

    from kernelcache import vllm_root

    # A vLLM cache is read at the absolute root it was built at, never from files/vllm.
    bound = runtime.manifest is not None and vllm_root.recorded_root(runtime.manifest) is not None
    for name, subdir in CACHE_ENV.items():
        if not (bound and name == vllm_root.ENV):
            _set_default(runtime, name, str(files / subdir))
    for name, value in SERVING_SETTINGS.items():
        _set_default(runtime, name, value)
    aot = files / FLASHINFER_AOT_SUBDIR
    if aot.is_dir() and any(aot.iterdir()):
        hooks.use_flashinfer_aot(aot)
        if runtime.config.strict:
            _set_default(runtime, "FLASHINFER_DISABLE_JIT", "1")
    if runtime.env:
        log.info("kernelcache: serving from %s (%s)", files.parent, ", ".join(sorted(runtime.env)))


def _observe(runtime: Runtime, files: Path | None) -> None:
    config = runtime.config
    hooks.watch_cute()
    hooks.watch_triton(config.strict, config.poll_seconds)
    observe_torch(files, config.strict)
    factors = runtime.manifest.stamp.get("factors", {}) if runtime.manifest else {}
    vllm.watch(
        vllm.read_sizes(files) if files is not None else [],
        config.strict,
        factors.get(vllm.MODEL_FACTOR),
    )
    if config.strict:
        hooks.refuse_flashinfer_cute_dsl_builds()
    build_log = config.flashinfer_build_log
    if build_log is None and importlib.util.find_spec("flashinfer") is not None:
        build_log = _default_build_log(config.strict)
        if build_log is not None:
            _set_default(runtime, "FLASHINFER_JIT_BUILD_LOG", str(build_log))
    if build_log is not None:
        tail = hooks.BuildLogTail(build_log, config.flashinfer_min_build_seconds)
        tail.start(config.poll_seconds)


def _default_build_log(strict: bool) -> Path | None:
    """A file for FlashInfer's build log in the temp dir; without a writable one (a read-only
    root and no emptyDir at /tmp), strict mode refuses and permissive counts no builds."""
    try:
        return Path(tempfile.gettempdir()) / f"kernelcache-flashinfer-{os.getpid()}.jsonl"
    except FileNotFoundError:  # tempfile found no writable directory
        message = (
            "no writable temp directory for FlashInfer's build log: mount an emptyDir at "
            "/tmp or set FLASHINFER_JIT_BUILD_LOG to a writable file"
        )
        if strict:
            raise StorageError(message) from None
        log.warning("kernelcache: %s; FlashInfer builds are not counted", message)
        return None


def observe_torch(files: Path | None, strict: bool) -> None:
    """Count dynamo/inductor compiles; with a generation's ``files``, serve inductor from it.

    Also used by the torch-compile warmer's replays, which must see what serving sees.
    """
    hooks.watch_inductor(strict, _megacache_to_load(files) if files is not None else None)
    if files is not None:
        hooks.keep_tuned_configs()


def _megacache_to_load(files: Path) -> Path | None:
    """The generation's Mega-Cache, unless inductor already reads the generation's own cache.

    The warm process's inductor cache (``files/inductor``) holds every artifact of the blob
    plus what the warmer's replays added after it was saved. Loading the blob over it would
    put the first process's autotune results back over the replays' ones, in an order that
    varies per process (the blob can hold several results for one kernel).
    """
    blob = files / MEGACACHE_FILE
    if not blob.is_file():
        return None
    from kernelcache.warm import CACHE_ENV

    own = files / CACHE_ENV["TORCHINDUCTOR_CACHE_DIR"]
    in_use = os.environ.get("TORCHINDUCTOR_CACHE_DIR") == str(own)
    if in_use and own.is_dir() and any(own.iterdir()):
        log.info("kernelcache: inductor reads the generation's own cache; Mega-Cache not loaded")
        return None
    return blob


def _serve(config: Settings) -> int | None:
    try:
        return serve_metrics(config.metrics_port, config.metrics_address)
    except OSError as exc:  # a child process of the server inherits the port: count anyway
        log.warning(
            "kernelcache: /metrics not served on %s:%d: %s",
            config.metrics_address,
            config.metrics_port,
            exc.strerror,
        )
        return None


def autoinstall() -> None:
    """The ``.pth`` hook's entry: ``install()``, with a refusal as one line and an exit code.

    An exception in a ``.pth`` line is printed and then ignored by ``site``, so a refusal
    would not stop the process; this exits instead, as the init-container does.
    """
    try:
        install()
    except KernelCacheError as exc:
        print(f"kernelcache: {exc.message}", file=sys.stderr, flush=True)
        os._exit(int(exc.code))
    except Exception as exc:  # a bug: one line with its type, not a traceback inside site
        print(f"kernelcache: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(int(ExitCode.FAILURE))
