"""The serving side: use a materialized generation, and observe every compile that still happens.

``install()`` (or ``KERNELCACHE_RUNTIME=1`` with the ``zz_kernelcache_runtime.pth`` hook, which
calls it at interpreter start, so that engines need no code change; the hook belongs in the
site-packages that holds kernelcache and its dependencies) reads one ``contract.Settings`` from
the environment and then:

1. checks the generation's stamp against this environment (``kernelcache_stamp_mismatch``,
   one log line naming the factor; strict mode refuses to start);
2. lets each toolchain check the generation's layout (``Toolchain.check_generation``: vLLM's
   cache root holds the generation's files);
3. sets each toolchain's serving environment (``Toolchain.serving_env``: its cache variables
   at the generation's ``files/<subdir>``, or, for a toolchain that only reads them, at the
   verified read-only mount that ``KERNELCACHE_IN_PLACE_DIR`` names, its fixed settings,
   FlashInfer's arch list and, in strict mode with AOT modules, ``FLASHINFER_DISABLE_JIT=1``),
   leaving any variable the user already set alone (a default a toolchain wrote for itself
   does not count);
4. lets each toolchain hook itself when the application imports it
   (``Toolchain.observe``): the CuTe-DSL disk layer, Triton's compile listener and cache
   manager, dynamo/inductor compile callbacks and the torch Mega-Cache, a tail of
   FlashInfer's build log, vLLM's JIT monitor with the warmed forward sizes before it arms
   (``kernelcache.toolchains.<name>`` says what each one counts and refuses);
5. serves ``/metrics`` when ``KERNELCACHE_METRICS_PORT`` is set.

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

import logging
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kernelcache import envfile
from kernelcache.contract import IN_PLACE_DIR, CacheKey, Settings
from kernelcache.errors import (
    ExitCode,
    KernelCacheError,
    MissingGenerationError,
    StorageError,
)
from kernelcache.runtime import learning, metrics
from kernelcache.runtime.metrics import serve_metrics
from kernelcache.toolchains import toolchains
from kernelcache.toolchains.base import Serving, Toolchain

if TYPE_CHECKING:
    from kernelcache.stamp import FactorDiff
    from kernelcache.store import Manifest

__all__ = [
    "Runtime",
    "autoinstall",
    "install",
    "serve_metrics",
]

log = logging.getLogger(__name__)


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
    serving = Serving(config, files, runtime.manifest, lambda n, v: _set_default(runtime, n, v))
    if files is not None:
        _point_caches(runtime, serving, files)
    for toolchain in toolchains():
        toolchain.observe(_serving_for(toolchain, serving))
    if config.metrics_port:
        learning.share(config.metrics_port)
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
        _check_in_place(config.in_place_dir, directory)
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
    for toolchain in toolchains():
        toolchain.check_generation(manifest, config.strict)
    return directory / FILES_DIR


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


def _check_in_place(mount: Path | None, directory: Path) -> None:
    """The mount that the toolchains reading in place are pointed at must hold the very
    generation that the init-container verified there and copied the rest of: the same
    manifest bytes (a container without the image volume mounted has none)."""
    from kernelcache.store import MANIFEST_NAME

    if mount is None:
        return
    try:
        same = (mount / MANIFEST_NAME).read_bytes() == (directory / MANIFEST_NAME).read_bytes()
    except OSError:
        same = False
    if not same:
        raise StorageError(
            f"{IN_PLACE_DIR.name}={mount}: does not hold the generation at {directory} (mount "
            "its image volume in this container at that path)",
            path=str(mount),
        )


def _set_default(runtime: Runtime, name: str, value: str) -> None:
    if name not in os.environ or any(t.holds_own_default(name) for t in toolchains()):
        os.environ[name] = value
        runtime.env[name] = value


def _serving_for(toolchain: Toolchain, serving: Serving) -> Serving:
    """What ``toolchain`` is handed: the generation's files/ on the read-only mount the
    init-container verified and left them on (``KERNELCACHE_IN_PLACE_DIR``) when it only
    reads them, else the copy."""
    mount = serving.config.in_place_dir
    if serving.files is None or mount is None or not toolchain.reads_in_place:
        return serving
    return replace(serving, files=mount / serving.files.name)  # files/ on the mount


def _point_caches(runtime: Runtime, serving: Serving, files: Path) -> None:
    in_place = []
    for toolchain in toolchains():
        own = _serving_for(toolchain, serving)
        for name, value in toolchain.serving_env(own, own.files or files).items():
            _set_default(runtime, name, value)
        if own.files != files:
            in_place.append(toolchain.name)
    if runtime.env:
        log.info(
            "kernelcache: serving from %s (%s)%s",
            files.parent,
            ", ".join(sorted(runtime.env)),
            f"; {', '.join(in_place)} in place from {serving.config.in_place_dir}"
            if in_place
            else "",
        )


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
