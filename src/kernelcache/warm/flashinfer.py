"""The flashinfer warmer: JIT-build FlashInfer's modules and tune its ops into the generation.

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
import time; ``run`` sets the environment first (the build runs each arch in its own process).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from kernelcache import progress
from kernelcache.errors import WarmError
from kernelcache.warm import (
    CACHE_ENV,
    Warmer,
    WarmerReport,
    dir_usage,
    resolve_entry_point,
    scoped_env,
)

SUBDIR = CACHE_ENV["FLASHINFER_WORKSPACE_BASE"]
AOT_SUBDIR = "aot"
TACTICS_SUBDIR = "tactics"
JIT_SUBDIR = "cached_ops"  # FLASHINFER_JIT_DIR inside the workspace (flashinfer/jit/env.py)

# A ninja run that finds everything up to date takes ~0.01 s; the smallest real nvcc build
# takes seconds. Half a second leaves room for a slow disk stat-ing every header.
NOOP_SECONDS = 0.5

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


def parse_build_log(
    path: str | os.PathLike[str], pid: int | None = None, noop_threshold: float = NOOP_SECONDS
) -> list[BuildRecord]:
    """The records of a FlashInfer build log, oldest first; ``pid`` keeps one process's.

    FlashInfer appends ``{"toolchain","name","seconds","pid","time"}`` per build, and nvcc
    modules log every load that goes through ninja, so a warm load reads as an nvcc "build"
    of ~0.01 s: below ``noop_threshold`` it is a no-op. CuTe-DSL kernels (toolchain
    ``cute_dsl``) are logged only after a compile (a disk hit returns before the build), so
    they are always real. Lines that are not complete records are skipped: the log may be
    shared with other processes, and a reader must never fail on it. A missing file is an
    empty log.
    """
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
            record = BuildRecord(
                toolchain=str(obj["toolchain"]),
                name=str(obj["name"]),
                seconds=float(obj["seconds"]),
                pid=int(obj["pid"]),
                time=float(obj["time"]),
                noop=False,
            )
        except (ValueError, TypeError, KeyError):
            continue
        if pid is not None and record.pid != pid:
            continue
        noop = record.toolchain == "nvcc" and record.seconds < noop_threshold
        records.append(BuildRecord(**{**asdict(record), "noop": noop}))
    return records


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


def serving_env(flashinfer_dir: Path, arch: str) -> dict[str, str]:
    """The variables a serving process sets (before importing FlashInfer) to use a generation.

    The workspace directory FlashInfer looks in is named after the arch list, and on its own
    FlashInfer picks the list from the GPU and CUDA version (sm_120 becomes "120f" with CUDA
    12.9+), so the list the warm used is part of the contract. ``FLASHINFER_DISABLE_JIT`` makes
    a module missing from the AOT layout an error instead of a compile.
    """
    return {
        "FLASHINFER_WORKSPACE_BASE": str(flashinfer_dir),
        "FLASHINFER_CUDA_ARCH_LIST": cuda_arch_list(arch),
        "FLASHINFER_DISABLE_JIT": "1",
    }


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

    def run(self, files_dir: Path, arch: str) -> FlashInferReport:
        expected_modules, expect_tactics = self._declared()
        tune = self.config.workload.get("tune") is True
        if expect_tactics and not tune:
            raise WarmError("flashinfer warmer: expect 'tactics' needs the workload's tune: true")
        base = files_dir / SUBDIR
        base.mkdir(parents=True, exist_ok=True)
        report = FlashInferReport(warmer=self.label, arch_list=cuda_arch_list(arch))
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="kernelcache-flashinfer-") as tmp:
            log = Path(tmp) / "build-log.jsonl"
            env = {
                **self.config.env,
                "FLASHINFER_WORKSPACE_BASE": str(base),
                "FLASHINFER_CUDA_ARCH_LIST": report.arch_list,
                "FLASHINFER_JIT_BUILD_LOG": str(log),
                "CUTE_DSL_ARCH": arch,
                "KERNELCACHE_ARCH": arch,
            }
            with scoped_env(env):
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
        missing = [m for m in expected_modules if m not in report.modules + report.cute_dsl_modules]
        if missing:
            present = report.modules + report.cute_dsl_modules
            built = ", ".join(present[:5]) + (f" (+{len(present) - 5} more)" if present[5:] else "")
            raise WarmError(
                f"flashinfer warmer: declared module {missing[0]} did not appear under "
                f"{report.workspace}/{JIT_SUBDIR} for {arch} (built: {built or 'none'})"
            )
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
        report.seconds = round(time.perf_counter() - start, 3)
        usage = dir_usage(files_dir).get(SUBDIR, {"files": 0, "bytes": 0})
        report.files, report.bytes = usage["files"], usage["bytes"]
        return report

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
