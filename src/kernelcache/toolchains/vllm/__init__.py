"""vLLM: the engine's whole cache warmed through ``vllm serve`` until a fresh server meets no
JIT, its cache root bound to one absolute path, and, in serving, the warmed shapes loaded
before vLLM's JIT monitor arms, in the process where the model runs.

**Warm.** Each pass is a fresh ``vllm serve`` (``drive``: an API server and its engine core
process, as a serving pod runs them) with the spec's engine arguments as its flags,
``VLLM_CACHE_ROOT`` at the workload's ``cacheRoot`` (the path serving uses too: see the cache
root below), Triton, inductor and FlashInfer caches in the staging generation and vLLM's
startup plan on; then a sweep of completions over every declared prompt length and batch
size with vLLM's own JIT monitor in ``warn`` mode. kernelcache's hooks reach vLLM's processes
through the runtime's ``.pth`` hook (``KERNELCACHE_RUNTIME=1``); each process writes what they
saw to ``KERNELCACHE_VLLM_STATE_DIR`` (``dump``). The first pass compiles (cold); each later
pass is set up as serving is (the forward sizes at which the monitor fired so far run before
it arms, ``KERNELCACHE_VLLM_SIZES``) and must see nothing: no monitor event, no compile
counted by kernelcache. After at most ``maxPasses`` servers the warm fails naming the kernel
that still JITs. The cache root (with vLLM's startup plan) is then copied into
``files/vllm``, the recorded sizes into ``files/vllm-warmup/sizes.json``, the FlashInfer
modules the engine loaded into FlashInfer's prebuilt layout (``keep_flashinfer_modules``), and
vLLM's own ``cache_key_factors.json`` into the report.

**The cache root.** vLLM's compile cache is bound to where it was written: its artifacts name
the cache root, the vLLM install and the model by absolute path, a copy at another path
crashes the engine, and a warm start writes new files into it (a read-only copy crashes it
too). So the generation keeps vLLM's tree under ``files/vllm`` with the root it was built at
as the stamp factor ``vllm/cache_root``, and the init-container copies it back to exactly
that path, writable (``place``). A root is only ever emptied when it is kernelcache's own
(``MARKER``, written before anything else): a path that holds something else is refused,
never cleared. Pure Python, no vLLM: the init-container runs this.

**Serving.** vLLM arms its own JIT monitor (``vllm.utils.jit_monitor.activate``) at the end of
its warm-up. From then on every Triton kernel the process loads for the first time counts as a
JIT, whether it is compiled or read from Triton's disk cache: the monitor listens on Triton's
``jit_post_compile_hook``, which fires on every miss of the in-memory kernel cache. vLLM's
warm-up runs the CUDA-graph sizes and the compile ranges' ends, not every token count a served
batch has, so a fused-MoE kernel specialized for a prefill size the warm-up did not run is
first loaded at the first such request (and ``jit_monitor_mode="error"`` stops the engine
there). No cache on disk can change that; only running the shape before the monitor arms can.
So the fused-MoE specializations the engine's configuration allows are enumerated in the
warm (``coverage``, right after the model loads; with vLLM's fused-MoE tables tuned for the
GPU first where it ships none, ``tuning``) and replayed and checked before the monitor arms
in serving (a missing one fails the start before ready); the warm also records the token
counts of the forwards at which the monitor fired (``WARMUP_FILE``), and in serving one
dummy forward per recorded size runs there too (inside
``Worker.compile_or_warm_up_model``). Strict mode refuses every compile until the monitor
arms (the engine is ready: ``runtime.ready``); after that a compile is served and counted,
and the monitor runs in the mode the engine was given. Every monitor event is counted
(``kernelcache_vllm_jit_events_total``) and kept in ``state.events`` with the token count of
the forward it happened in. The engine's model and the cache root are checked against the
generation's stamp. Whether vLLM applied its startup plan is said (``_plan_checked``): a GPU
with less free memory than the plan recorded profiles instead.

Nothing here imports vLLM: each hook is installed when vLLM's own module is imported.

The rooms: ``passes`` (the warmer: engine passes until none meets a JIT), ``engine`` (one
``vllm serve`` driven through its sweep), ``hooks`` (inside vLLM's processes), ``coverage``
(what the engine's configuration can ask for, enumerated and replayed), ``tuning`` (fused-MoE
tables), ``cache_root`` (vLLM's tree at the path it was built at), ``adapter`` (every vLLM
internal bound, per version family, and the supported range); this module is the
toolchain's face to the rest (serving settings, the init-container's hooks, inspect/explain).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelcache.errors import NotInstalledError, StorageError
from kernelcache.runtime.imports import when_imported
from kernelcache.toolchains.base import Serving, Toolchain
from kernelcache.toolchains.vllm import adapter, coverage, tuning
from kernelcache.toolchains.vllm.cache_root import (
    ENV,
    MODEL_FACTOR,
    PLAN_DIR,
    SUBDIR,
    check_env_root,
    missing,
    place,
    recorded_root,
)
from kernelcache.toolchains.vllm.coverage import Coverage
from kernelcache.toolchains.vllm.hooks import read_sizes, watch
from kernelcache.toolchains.vllm.passes import VllmWarmer

if TYPE_CHECKING:
    from kernelcache.spec import Warmer as WarmerSpec
    from kernelcache.store import Manifest

log = logging.getLogger(__name__)


def coverage_lines(report: Mapping[str, Any]) -> list[str]:
    """``family: what was enumerated`` for each vLLM warmer of a generation's warm report."""
    return [
        f"{family}: {line}"
        for warmer in report.get("warmers") or []
        for family, line in sorted((warmer.get("coverage") or {}).items())
    ]


def coverage_diffs(left: Mapping[str, Any], right: Mapping[str, Any]) -> list[str]:
    """The coverage of two generations' warms, family by family, where it differs."""

    def by_family(report: Mapping[str, Any]) -> dict[str, str]:
        return dict(line.split(": ", 1) for line in coverage_lines(report))

    a, b = by_family(left), by_family(right)
    return [
        f"{family}: {a.get(family, '(absent)')} != {b.get(family, '(absent)')}"
        for family in sorted(set(a) | set(b))
        if a.get(family) != b.get(family)
    ]


def factor_diffs(left: Mapping[str, Any], right: Mapping[str, Any]) -> list[str]:
    """vLLM's own ``cache_key_factors.json`` of two warm reports, compared in vLLM's words."""

    def flat(report: Mapping[str, Any]) -> dict[tuple[str, str], Any]:
        found: dict[tuple[str, str], Any] = {}
        for warmer in report.get("warmers") or []:
            for file, factors in (warmer.get("cache_key_factors") or {}).items():
                for name, value in factors.items():
                    if isinstance(value, Mapping):
                        found.update({(file, f"{name}.{k}"): v for k, v in value.items()})
                    else:
                        found[(file, name)] = value
        return found

    a, b = flat(left), flat(right)
    return [
        f"{key[1]}: {a.get(key, '(absent)')} != {b.get(key, '(absent)')} ({key[0]})"
        for key in sorted(set(a) | set(b))
        if a.get(key) != b.get(key)
    ]


def _version_checked(check: str) -> Callable[[Any], None]:
    """The hook run when vLLM is imported in a serving process: the installed release against
    the supported range. Refused: one line and the exit code of its class, as the runtime's
    ``.pth`` hook refuses (an exception raised inside an import would be a traceback in
    vLLM's own start-up, and a process left half-hooked)."""

    def checked(_: Any) -> None:
        try:
            said = adapter.check_version(adapter.installed_version(), check, "vllm serving")
        except NotInstalledError as exc:
            print(f"kernelcache: {exc.message}", file=sys.stderr, flush=True)
            os._exit(int(exc.code))
        if said:
            log.warning("kernelcache: %s", said)

    return checked


class Vllm(Toolchain):
    @property
    def supported_range(self) -> str:
        return adapter.SUPPORTED

    def version_problem(self, version: str) -> str | None:
        return adapter.outside(version)

    def check_warm(self, config: WarmerSpec) -> None:
        """The installed vLLM against the supported range (``adapter``), before the warm."""
        check = config.vllm_workload().vllm_version_check
        said = adapter.check_version(adapter.installed_version(), check, "vllm warmer")
        if said:
            log.warning("kernelcache: %s", said)

    def serving_env(self, serving: Serving, files: Path) -> dict[str, str]:
        env = super().serving_env(serving, files)
        # A vLLM cache is read at the absolute root it was built at, never from files/vllm.
        if serving.manifest is not None and recorded_root(serving.manifest) is not None:
            env.pop(ENV)
        return env

    def check_pod(self, manifest: Manifest, environ: Mapping[str, str]) -> None:
        check_env_root(manifest, environ)

    def place(self, copy: Path, manifest: Manifest, dropped: Sequence[str]) -> dict[str, Any]:
        """vLLM's tree back at the root it was built at (``place``)."""
        root = recorded_root(manifest)
        if root is None:
            return {}
        return {"vllm_cache_root": str(root), "vllm_files": place(copy, manifest, root, dropped)}

    def check_generation(self, manifest: Manifest, strict: bool) -> None:
        """vLLM reads its cache at the root it was built at: the init-container put it there."""
        root = recorded_root(manifest)
        if root is None or not (lost := missing(manifest, root)):
            return
        error = StorageError(
            f"{root}: the vLLM cache root lacks {len(lost)} of the generation's files, e.g. "
            f"{lost[0]} (kernelcache verify --materialize puts them there)",
            path=str(root),
        )
        if strict:
            raise error
        log.warning("kernelcache: %s; vLLM will compile what is missing", error.message)

    def observe(self, serving: Serving) -> None:
        config = serving.config
        # Registered before the hooks: a release outside the range may have moved what they
        # wrap, so it is refused when vLLM is imported, before any of them binds. A warm's
        # engine processes (the warm gives them a state directory) are not checked again: the
        # warm checked this install with the spec's choice (``check_warm``).
        if config.vllm_state_dir is None:
            when_imported("vllm", _version_checked(config.vllm_version_check))
        factors = serving.manifest.stamp.get("factors", {}) if serving.manifest else {}
        if config.vllm_sizes is not None:
            sizes = list(config.vllm_sizes)
        else:
            sizes = read_sizes(serving.files) if serving.files is not None else []
        enumerate_coverage = config.vllm_coverage == coverage.ENUMERATE
        if config.vllm_coverage and not enumerate_coverage:
            recorded: Path | None = Path(config.vllm_coverage)
        else:
            recorded = serving.files / coverage.FILE if serving.files is not None else None
        watch(
            sizes,
            config.strict,
            factors.get(MODEL_FACTOR),
            config.vllm_state_dir,
            Coverage.read(recorded) if recorded is not None and not enumerate_coverage else None,
            enumerate_coverage=enumerate_coverage,
            moe_tuning=json.loads(config.vllm_moe_tuning) if config.vllm_moe_tuning else None,
        )


TOOLCHAIN = Vllm(
    # Not read in place: a warm start writes under its root (torch_aot_compile).
    name="vllm",
    cache_env={ENV: SUBDIR, coverage.TUNED_FOLDER_ENV: tuning.SUBDIR},
    # vLLM applies a startup plan only where its fingerprint (GPU name, total memory, ...)
    # matches; kernelcache scopes the files to the GPU product as it does tuning.
    serving_settings={"VLLM_ENABLE_STARTUP_PLAN": "1"},
    # So are FlashInfer's autotuner results that vLLM keeps under its root, and the fused-MoE
    # tables tuned in the compile Job.
    tuning_prefixes=(
        f"{SUBDIR}/{PLAN_DIR}/",
        f"{SUBDIR}/flashinfer_autotune_cache/",
        f"{tuning.SUBDIR}/",
    ),
    warmers=(VllmWarmer,),
    requires=("vllm", "vllm"),
)
