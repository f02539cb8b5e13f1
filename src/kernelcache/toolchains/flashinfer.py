"""FlashInfer: JIT-build its modules and tune its ops into the generation, and count in serving
the module builds its build log records.

FlashInfer compiles each kernel family with nvcc the first time a process calls it (10-12 s
per module on an H200) and profiles tunable ops on every process start unless a tactics file
says what to pick. This warmer calls the spec's entry points with FlashInfer's caches pointed
at ``files/flashinfer`` and leaves three things there:

- the JIT workspace, ``.cache/flashinfer/<version>/<arch-dir>/cached_ops/<module>/``, which a
  serving process with the same ``FLASHINFER_WORKSPACE_BASE`` and ``FLASHINFER_CUDA_ARCH_LIST``
  reuses (ninja finds it up to date; FlashInfer's CuTe-DSL kernels live there too);
- ``aot/<module>/<module>.so``, the layout FlashInfer loads prebuilt modules from. Only this
  survives ``FLASHINFER_DISABLE_JIT=1``, which refuses a warm workspace: see ``use_aot_dir``;
- ``tactics/<gpu-product>.json``, the autotuner's cache for one GPU product, when the workload
  says ``tune: true``.

FlashInfer fails open: a tactics file stamped for another GPU is silently not saved into, and
with a module's sources missing every tactic is skipped, no file is written and the process
exits 0. So every declared artifact (``expect``: ``module:<name>``, ``tactics``) is checked
after the run, and a missing one fails the warm with one line naming it.

FlashInfer reads its cache variables when it is imported, so nothing here imports it at module
import time; the warm sets the environment first (the build runs each arch in its own process).

Serving (``FlashInfer.serving_env``, ``FlashInfer.observe``): FlashInfer is pointed at the
generation's workspace with the arch list the warm used and, when the generation holds AOT
modules, at those; strict mode then sets ``FLASHINFER_DISABLE_JIT=1``, so FlashInfer itself
refuses a module missing from them. Its ``FLASHINFER_JIT_BUILD_LOG`` (one JSON line per
module build) is tailed by a thread (``BuildLogTail``), counting this process's builds only
and a ninja no-op as a cache hit (``parse_build_log`` and the tail read a line by one rule,
``build_record``). FlashInfer 0.6.x (vLLM 0.26.0's) writes no build log: there
``watch_jit`` times ``JitSpec.build`` and records every module ``build_and_load`` loads, which
a vllm warm keeps (its engine's modules, laid out prebuilt) and the init-container checks
(``FlashInfer.place``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kernelcache import contract, progress
from kernelcache.errors import StorageError, WarmError
from kernelcache.runtime import metrics
from kernelcache.runtime.imports import when_imported
from kernelcache.toolchains.base import (
    Serving,
    Toolchain,
    Warmer,
    WarmerReport,
    poll_forever,
    resolve_entry_point,
    scoped_env,
)

if TYPE_CHECKING:
    from kernelcache.store import Manifest

log = logging.getLogger(__name__)

SUBDIR = "flashinfer"  # FLASHINFER_WORKSPACE_BASE
AOT_SUBDIR = "aot"
TACTICS_SUBDIR = "tactics"
JIT_SUBDIR = "cached_ops"  # FLASHINFER_JIT_DIR inside the workspace (flashinfer/jit/env.py)

# A ninja run that finds everything up to date takes ~0.01 s; the smallest real nvcc build
# takes seconds. Half a second leaves room for a slow disk stat-ing every header. One rule
# for the warm and for serving, where KERNELCACHE_FLASHINFER_MIN_BUILD_S can change it.
NOOP_SECONDS: float = contract.FLASHINFER_MIN_BUILD_S.default

# Values FlashInfer's autotuner records when it cannot identify the GPU: a file stamped so
# is ignored on load (and replaced on the next tuned save).
_INDETERMINATE_GPU = (None, "unknown", "None")
_ARCH = re.compile(r"^sm_([0-9]{1,2})([0-9])([af]?)$")


@dataclass(frozen=True)
class BuildRecord:
    """One line of ``FLASHINFER_JIT_BUILD_LOG``, classified as a real build or a no-op."""

    toolchain: str
    name: str
    seconds: float
    pid: int
    time: float
    noop: bool


def build_record(line: str | bytes, noop_threshold: float = NOOP_SECONDS) -> BuildRecord | None:
    """One line of a FlashInfer build log, or None when it is not a complete record.

    FlashInfer appends ``{"toolchain","name","seconds","pid","time"}`` per build, and its
    ninja-driven modules log every load that goes through ninja, so a warm load reads as a
    "build" of ~0.01 s: below ``noop_threshold`` it is a no-op. CuTe-DSL kernels (toolchain
    ``cute_dsl``) are logged only after a compile (a disk hit returns before the build), so
    they are always real. The log may be shared with other processes and is FlashInfer's
    format, not our input: a reader never fails on a line.
    """
    try:
        obj = json.loads(line)
        toolchain, seconds = str(obj["toolchain"]), float(obj["seconds"])
        return BuildRecord(
            toolchain=toolchain,
            name=str(obj["name"]),
            seconds=seconds,
            pid=int(obj["pid"]),
            time=float(obj["time"]),
            noop=toolchain != "cute_dsl" and seconds < noop_threshold,
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def parse_build_log(
    path: str | os.PathLike[str], pid: int | None = None, noop_threshold: float = NOOP_SECONDS
) -> list[BuildRecord]:
    """The records of a FlashInfer build log, oldest first; ``pid`` keeps one process's.

    Each line is read by ``build_record``; a missing file is an empty log.
    """
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    records = [build_record(line, noop_threshold) for line in text.splitlines()]
    return [r for r in records if r is not None and (pid is None or r.pid == pid)]


def cuda_arch_list(arch: str) -> str:
    """``FLASHINFER_CUDA_ARCH_LIST`` for one SM arch: sm_90a -> "9.0a", sm_120a -> "12.0a".

    FlashInfer splits the list on spaces and each entry on "."; a suffix given is kept as is
    (``flashinfer/compilation_context.py``), so the workspace directory is named after exactly
    this target ("90a", "100a", "120a"). Without a suffix FlashInfer adds its own choice.
    """
    match = _ARCH.match(arch)
    if match is None:
        raise WarmError(f"flashinfer warmer: {arch!r} is not an arch like sm_90a")
    major, minor, suffix = match.groups()
    return f"{major}.{minor}{suffix}"


def gpu_slug(product: str) -> str:
    """A file name for a GPU product: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", product.lower()).strip("-")


def tactics_file(flashinfer_dir: Path, product: str) -> Path:
    """Where the tactics for ``product`` live under a generation's ``files/flashinfer``."""
    return flashinfer_dir / TACTICS_SUBDIR / f"{gpu_slug(product)}.json"


def check_tactics(path: Path, gpu: str) -> int:
    """The number of tuned entries FlashInfer will use from ``path`` on ``gpu``.

    FlashInfer ignores a whole file whose ``_metadata.gpu`` names another GPU (and declines
    to save into it), so a file that exists is not enough: raises WarmError when FlashInfer
    would not use it.
    """
    if not path.is_file():
        raise WarmError(
            f"flashinfer warmer: tactics file {_shown(path)} did not appear: FlashInfer tuned "
            "nothing (no tunable op ran under autotune, or every tactic was skipped)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        meta = data["_metadata"]
        stamped = meta.get("gpu")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise WarmError(
            f"flashinfer warmer: tactics file {_shown(path)} is not a FlashInfer autotuner "
            "cache (no _metadata)"
        ) from None
    if stamped in _INDETERMINATE_GPU:
        raise WarmError(
            f"flashinfer warmer: tactics file {_shown(path)} is stamped for an unknown GPU: "
            "FlashInfer will ignore it"
        )
    if stamped not in (gpu, "*"):
        raise WarmError(
            f"flashinfer warmer: tactics file {_shown(path)} is stamped for {stamped}, this "
            f"GPU is {gpu}: FlashInfer will ignore it"
        )
    records = data.get("_records")
    namespaced = sum(len(r) for r in records.values()) if isinstance(records, dict) else 0
    return sum(1 for key in data if not key.startswith("_")) + namespaced


def built_modules(jit_dir: Path) -> list[str]:
    """nvcc modules with a linked library: ``<jit_dir>/<name>/<name>.so``."""
    return sorted(so.parent.name for so in jit_dir.glob("*/*.so") if so.stem == so.parent.name)


def cute_dsl_modules(jit_dir: Path) -> list[str]:
    """FlashInfer CuTe-DSL module directories whose ``meta.json`` commit marker exists."""
    return sorted(meta.parent.name for meta in jit_dir.glob("*/meta.json"))


def aot_layout(workspace: Path, target: Path) -> list[str]:
    """Copy every built nvcc module of ``workspace`` to ``target/<name>/<name>.so``.

    ``workspace`` is FlashInfer's ``FLASHINFER_WORKSPACE_DIR``
    (``<base>/.cache/flashinfer/<version>/<arch-dir>``). The target layout is the one
    FlashInfer's own AOT build writes (``copy_built_kernels`` in ``flashinfer/aot.py``) and
    ``get_aot_artifacts`` reads (``flashinfer/jit/env.py``); the ``.so`` alone is loaded, none
    of the objects or ninja files beside it. Copies, not links: a generation holds no links.
    Returns the module names, sorted.
    """
    jit_dir = workspace / JIT_SUBDIR
    names = built_modules(jit_dir)
    for name in names:
        dest = target / name / f"{name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(jit_dir / name / f"{name}.so", dest)
    return names


def serving_env(
    flashinfer_dir: Path, arch: str | None, *, strict: bool = True, arch_list: str | None = None
) -> dict[str, str]:
    """The variables a serving process sets (before importing FlashInfer) to use a generation.

    The workspace directory FlashInfer looks in is named after the arch list, and on its own
    FlashInfer picks the list from the GPU and CUDA version (sm_120 becomes "120f" with CUDA
    12.9+), so the list the warm used is part of the contract: ``arch_list`` as the warm
    recorded it, else the one this warmer uses for ``arch``; neither: FlashInfer picks.
    ``strict``: ``FLASHINFER_DISABLE_JIT``, which makes a module missing from the AOT layout
    an error instead of a compile (the one place kernelcache decides it).
    """
    env = {"FLASHINFER_WORKSPACE_BASE": str(flashinfer_dir)}
    chosen = arch_list or (cuda_arch_list(arch) if arch else None)
    if chosen:
        env["FLASHINFER_CUDA_ARCH_LIST"] = chosen
    if strict:
        env["FLASHINFER_DISABLE_JIT"] = "1"
    return env


def recorded_arch_list(manifest: Manifest | None) -> str | None:
    """The ``FLASHINFER_CUDA_ARCH_LIST`` the generation's warmers used, when they agree."""
    warmers = manifest.report.get("warmers") if manifest is not None else None
    lists = {
        report["arch_list"]
        for report in (warmers if isinstance(warmers, list) else ())
        if isinstance(report, Mapping)
        and isinstance(report.get("arch_list"), str)
        and report["arch_list"]
    }
    return lists.pop() if len(lists) == 1 else None


def use_aot_dir(aot_dir: Path) -> None:
    """Make FlashInfer load prebuilt modules from ``aot_dir``, in this process.

    FlashInfer 0.7.x has no environment variable for it: prebuilt modules are looked up in
    the module attribute ``flashinfer.jit.env.FLASHINFER_AOT_DIR`` (the package's own
    ``data/aot``), read on every lookup, then in an installed ``flashinfer-jit-cache``.
    Call this before the first FlashInfer op; a module already loaded stays as it was.
    """
    from flashinfer.jit import env as jit_env

    jit_env.FLASHINFER_AOT_DIR = Path(aot_dir)


def visible_gpu() -> tuple[str, str] | None:
    """(product name, arch) of the current CUDA device, named as FlashInfer names it.

    The name comes from ``torch.cuda.get_device_name``, the call FlashInfer's autotuner uses
    for ``_metadata.gpu``, so the two compare equal. None without a usable GPU.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return torch.cuda.get_device_name(index), f"sm_{major}{minor}{'a' if major >= 9 else ''}"


@dataclass
class FlashInferReport(WarmerReport):
    """The warm report, plus what FlashInfer built, skipped, laid out and tuned."""

    arch_list: str = ""
    workspace: str = ""  # relative to files/
    modules: list[str] = field(default_factory=list)
    cute_dsl_modules: list[str] = field(default_factory=list)
    builds: list[dict[str, Any]] = field(default_factory=list)
    noops: list[dict[str, Any]] = field(default_factory=list)
    aot: list[str] = field(default_factory=list)
    tactics: dict[str, Any] | None = None


class FlashInferWarmer(Warmer):
    type = "flashinfer"
    report_type = FlashInferReport
    fills = (SUBDIR,)
    counts_held = True

    def env(self, files_dir: Path, arch: str) -> dict[str, str]:
        return {
            "FLASHINFER_WORKSPACE_BASE": str(files_dir / SUBDIR),
            "FLASHINFER_CUDA_ARCH_LIST": cuda_arch_list(arch),
            "CUTE_DSL_ARCH": arch,
            "KERNELCACHE_ARCH": arch,
        }

    def produce(self, files_dir: Path, arch: str, report: FlashInferReport) -> None:
        _, expect_tactics = self._declared()
        tune = self.config.workload.get("tune") is True
        if expect_tactics and not tune:
            raise WarmError("flashinfer warmer: expect 'tactics' needs the workload's tune: true")
        base = files_dir / SUBDIR
        report.arch_list = cuda_arch_list(arch)
        with tempfile.TemporaryDirectory(prefix="kernelcache-flashinfer-") as tmp:
            log = Path(tmp) / "build-log.jsonl"
            with scoped_env({"FLASHINFER_JIT_BUILD_LOG": str(log)}):
                jit_env = import_flashinfer(base)
                gpu = _tuning_gpu(arch) if tune else None
                tactics = tactics_file(base, gpu) if gpu is not None else None
                for entry_point in self.config.entry_points:
                    report.kernels.extend(self._call(entry_point, arch, tactics))
            records = parse_build_log(log)
        workspace = Path(jit_env.FLASHINFER_WORKSPACE_DIR)
        report.workspace = workspace.relative_to(files_dir).as_posix()
        report.modules = built_modules(workspace / JIT_SUBDIR)
        report.cute_dsl_modules = cute_dsl_modules(workspace / JIT_SUBDIR)
        if tactics is not None and gpu is not None:
            entries = check_tactics(tactics, gpu)
            report.tactics = {
                "file": tactics.relative_to(files_dir).as_posix(),
                "gpu": gpu,
                "entries": entries,
            }
        report.aot = aot_layout(workspace, base / AOT_SUBDIR)
        report.builds = [asdict(r) for r in records if not r.noop]
        for record in records:  # the build log is read after the entry points return
            if not record.noop:
                progress.compiled(f"flashinfer/{record.toolchain}", record.name, record.seconds)
        report.noops = [asdict(r) for r in records if r.noop]
        report.compiled = len(report.builds)

    def check_expected(
        self, report: FlashInferReport, grown: Mapping[Path, int], arch: str
    ) -> None:
        """Every declared ``module:<name>`` was built (nvcc or CuTe-DSL); a declared tactics
        file was checked as it was tuned (``check_tactics``)."""
        expected_modules, _ = self._declared()
        present = report.modules + report.cute_dsl_modules
        missing = [m for m in expected_modules if m not in present]
        if missing:
            built = ", ".join(present[:5]) + (f" (+{len(present) - 5} more)" if present[5:] else "")
            raise WarmError(
                f"flashinfer warmer: declared module {missing[0]} did not appear under "
                f"{report.workspace}/{JIT_SUBDIR} for {arch} (built: {built or 'none'})"
            )

    def _declared(self) -> tuple[list[str], bool]:
        """The ``expect`` entries: module names, and whether a tactics file is declared."""
        modules, tactics = [], False
        for entry in self.config.expect:
            kind, _, name = entry.partition(":")
            if kind == "module" and name:
                modules.append(name)
            elif entry == "tactics":
                tactics = True
            else:
                raise WarmError(
                    f"flashinfer warmer: expect entry {entry!r} is neither 'module:<name>' "
                    "nor 'tactics'"
                )
        return modules, tactics

    def _call(self, entry_point: str, arch: str, tactics: Path | None) -> list[str]:
        """Call one entry point, under FlashInfer's autotuner when tuning."""
        fn = resolve_entry_point(entry_point, self.spec_dir)
        tuning: AbstractContextManager[Any] = nullcontext()
        if tactics is not None:
            from flashinfer.autotuner import autotune

            tuning = autotune(True, cache=str(tactics))
        try:
            with tuning:
                names = fn(dict(self.config.workload))
        except Exception as exc:
            raise WarmError(
                f"entry point {entry_point} failed for {arch}: {type(exc).__name__}: "
                f"{_summary(exc)}"
            ) from exc
        return list(names or [])


def import_flashinfer(base: Path) -> ModuleType:
    """FlashInfer's env module, checked to point at ``base``.

    Its cache paths are fixed at import: a FlashInfer imported earlier in this process (by
    another warmer's code, say) writes elsewhere, and the warm would look successful.
    """
    try:
        from flashinfer.jit import env as jit_env
    except ImportError as exc:
        raise WarmError(f"flashinfer warmer: flashinfer is not importable here: {exc}") from exc
    if Path(jit_env.FLASHINFER_BASE_DIR).resolve() != base.resolve():
        raise WarmError(
            "flashinfer warmer: flashinfer was imported in this process before the warmer set "
            f"FLASHINFER_WORKSPACE_BASE (it writes to {jit_env.FLASHINFER_BASE_DIR}); "
            "run the warm in a fresh process"
        )
    return jit_env


def _tuning_gpu(arch: str) -> str:
    """The GPU product tuning runs on; tactics measured on another arch would be wrong."""
    gpu = visible_gpu()
    if gpu is None:
        raise WarmError(f"flashinfer warmer: tune: true needs a {arch} GPU, and none is visible")
    product, gpu_arch = gpu
    if gpu_arch.rstrip("af") != arch.rstrip("af"):
        raise WarmError(
            f"flashinfer warmer: tune: true for {arch}, but the visible GPU is {product} "
            f"({gpu_arch}): tactics are measured on the GPU they are for"
        )
    return product


def _summary(exc: BaseException) -> str:
    """One line for a multi-line error: a ninja failure puts its cause deep in the output."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    cause = next((line for line in lines[1:] if "error" in line.lower()), None)
    return f"{lines[0]} {cause}" if cause else lines[0]


def _shown(path: Path) -> str:
    """A tactics file as messages name it: ``tactics/<gpu>.json``."""
    return f"{path.parent.name}/{path.name}"


# ------------------------------------------------------------------------------ serving


@dataclass
class Loads:
    """The FlashInfer modules this process loaded (``JitSpec.build_and_load``), and built."""

    modules: dict[str, str] = field(default_factory=dict)  # name -> "aot" | "jit"
    builds: list[dict[str, Any]] = field(default_factory=list)  # real builds: name, seconds


loads = Loads()


def watch_jit(module: Any, noop_threshold: float = NOOP_SECONDS) -> None:
    """Record every module ``JitSpec.build_and_load`` loads, and count the real builds.

    FlashInfer 0.6.x writes no build log, so this is where its nvcc builds are seen: a
    ``build`` (ninja) that takes ``noop_threshold`` or more is a build (metrics and
    ``loads.builds``), a faster one found the module up to date. The modules loaded are
    what a warm records: serving with ``FLASHINFER_DISABLE_JIT`` needs each one prebuilt.
    """
    spec_class = module.JitSpec
    build, build_and_load = spec_class.build, spec_class.build_and_load

    def build_timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = build(self, *args, **kwargs)
        seconds = time.perf_counter() - start
        if seconds >= noop_threshold:
            loads.builds.append({"name": self.name, "seconds": round(seconds, 3)})
            metrics.record_compile("flashinfer", self.name, seconds)
        return result

    def build_and_load_recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Only nvcc modules can be prebuilt (0.7.x's CuTe-DSL specs have no is_aot).
        aot = bool(getattr(self, "is_aot", False))
        result = build_and_load(self, *args, **kwargs)
        loads.modules.setdefault(self.name, "aot" if aot else "jit")
        return result

    spec_class.build = build_timed
    spec_class.build_and_load = build_and_load_recorded


class BuildLogTail:
    """Counts the module builds that FlashInfer logs to ``FLASHINFER_JIT_BUILD_LOG``.

    The file contract (FlashInfer 0.7.x): one JSON object per line (``build_record``),
    appended by every process that shares the file. Only this process's lines count, and a
    no-op (ninja found the module up to date) is counted as a cache hit. Reading starts at
    the end of the file as it was when the tail was created: earlier lines are other
    processes' history.
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
            record = build_record(line, self.min_seconds)
            if record is None or record.pid != self.pid:
                continue
            if not record.noop and any(b["name"] == record.name for b in loads.builds):
                continue  # counted where it was built (watch_jit)
            if record.noop:
                metrics.record_hit("flashinfer")
            else:
                metrics.record_compile("flashinfer", record.name, record.seconds)

    def start(self, interval: float) -> threading.Thread:
        """Poll in a thread; a forked child (vLLM's engine core) gets a tail of its own, for
        its own builds, since a fork keeps no thread but the caller's."""

        def in_child() -> None:
            child = BuildLogTail(self.path, self.min_seconds)
            child.start(interval)

        os.register_at_fork(after_in_child=in_child)
        return poll_forever(self.poll, interval, "kernelcache-flashinfer-log")


def default_build_log(strict: bool) -> Path | None:
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


def aot_modules_dir(files: Path) -> Path | None:
    """The generation's prebuilt modules (``files/flashinfer/aot``), when it holds any: then
    FlashInfer can run with JIT disabled (a warm JIT workspace is not enough for that, since
    ``FLASHINFER_DISABLE_JIT`` refuses it too)."""
    aot = files / SUBDIR / AOT_SUBDIR
    return aot if aot.is_dir() and any(aot.iterdir()) else None


def recorded_modules(manifest: Manifest) -> list[str]:
    """The FlashInfer modules a generation's warmers recorded as loaded (a vllm warm's
    ``flashinfer_modules``): each must be prebuilt in its AOT layout."""
    warmers = manifest.report.get("warmers")
    return sorted(
        {
            name
            for report in (warmers if isinstance(warmers, list) else ())
            if isinstance(report, Mapping)
            for name in report.get("flashinfer_modules") or ()
            if isinstance(name, str)
        }
    )


class FlashInfer(Toolchain):
    def place(self, copy: Path, manifest: Manifest, dropped: Sequence[str]) -> dict[str, Any]:
        """Refuse a copy lacking a module the warm loaded: with ``FLASHINFER_DISABLE_JIT`` it
        would fail at the first request that needs it, not at start-up."""
        from kernelcache.store import FILES_DIR

        modules = recorded_modules(manifest)
        aot = copy / FILES_DIR / SUBDIR / AOT_SUBDIR
        if lost := [m for m in modules if not (aot / m / f"{m}.so").is_file()]:
            raise StorageError(
                f"{copy}: FlashInfer module {lost[0]} that the warm loaded is not in the "
                f"generation ({SUBDIR}/{AOT_SUBDIR}/{lost[0]}/{lost[0]}.so): FlashInfer with "
                "JIT disabled would fail the first request needing it; rebuild the generation",
                path=str(aot / lost[0]),
            )
        return {"flashinfer_modules": len(modules)} if modules else {}

    def serving_env(self, serving: Serving, files: Path) -> dict[str, str]:
        strict = serving.config.strict and aot_modules_dir(files) is not None
        return serving_env(
            files / SUBDIR, None, strict=strict, arch_list=recorded_arch_list(serving.manifest)
        )

    def observe(self, serving: Serving) -> None:
        config = serving.config
        aot = aot_modules_dir(serving.files) if serving.files is not None else None
        if aot is not None:
            when_imported("flashinfer.jit.env", lambda _: use_aot_dir(aot))
        threshold = config.flashinfer_min_build_seconds
        when_imported("flashinfer.jit.core", lambda module: watch_jit(module, threshold))
        build_log = config.flashinfer_build_log
        if build_log is None and importlib.util.find_spec("flashinfer") is not None:
            build_log = default_build_log(config.strict)
            if build_log is not None:
                serving.set_default("FLASHINFER_JIT_BUILD_LOG", str(build_log))
        if build_log is not None:
            BuildLogTail(build_log, config.flashinfer_min_build_seconds).start(config.poll_seconds)


TOOLCHAIN = FlashInfer(
    # Not read in place: its JIT takes a file lock in the workspace and runs ninja there even
    # for a built module, and its AOT modules are dlopen'ed (an image volume is noexec).
    name="flashinfer",
    cache_env={"FLASHINFER_WORKSPACE_BASE": SUBDIR},
    tuning_prefixes=(f"{SUBDIR}/{TACTICS_SUBDIR}/",),  # the autotuner's tactics per product
    warmers=(FlashInferWarmer,),
    requires=("flashinfer-python", "flashinfer"),
)
