"""Warmers: plugins that drive one toolchain with its caches pointed at a staging dir.

Each warmer declares the kernel sources it depends on (they become stamp factors), runs,
and reports what it produced. A warmer that was declared but produced nothing is a failed
warm, not a success: persistence that fails open fails silently, so we check the files.

The env contract: every toolchain's cache variable points at its own subdirectory of the
generation's ``files/``, so whatever runs under a warmer (an entry point, ``vllm serve``, a
script) fills the generation. The same table tells the serving side where to look.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kernelcache import progress
from kernelcache.errors import WarmError, one_line
from kernelcache.sources import ABSENT, SourceError, module_sources
from kernelcache.spec import GpuClass
from kernelcache.spec import Warmer as WarmerSpec
from kernelcache.warm.deadline import deadline

# Cache variable -> subdirectory of files/ it is pointed at during a warm.
CACHE_ENV: dict[str, str] = {
    "KERNELCACHE_CUTE_DSL_DIR": "cute-dsl",  # kernelcache's disk layer for cute.compile
    "CUTE_DSL_CACHE_DIR": "cute-dsl-jit",  # the DSL's own file cache (jit-decorated calls)
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "VLLM_CACHE_ROOT": "vllm",
    "SGLANG_CACHE_DIR": "sglang",
}


def cache_env(files_dir: Path) -> dict[str, str]:
    """The cache variables pointed at subdirectories of ``files_dir`` (created here)."""
    env = {}
    for var, sub in CACHE_ENV.items():
        (files_dir / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(files_dir / sub)
    return env


@dataclass
class WarmerReport:
    """What one warmer did: shown in the build table and kept in the manifest."""

    warmer: str
    seconds: float = 0.0
    kernels: list[str] = field(default_factory=list)
    compiled: int = 0
    files: int = 0
    bytes: int = 0
    dirs: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dir_usage(files_dir: Path) -> dict[str, dict[str, int]]:
    """Files and bytes per toolchain subdirectory, for the warm report."""
    usage: dict[str, dict[str, int]] = {}
    for sub in sorted(p for p in files_dir.iterdir() if p.is_dir()):
        files = [p for p in sub.rglob("*") if p.is_file() and not p.is_symlink()]
        if files:
            usage[sub.name] = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    return usage


class Warmer(ABC):
    """One declared warmer of a spec."""

    type: ClassVar[str]

    def __init__(
        self,
        config: WarmerSpec,
        spec_dir: Path | None = None,
        gpu_classes: Sequence[GpuClass] = (),
    ) -> None:
        self.config = config
        self.spec_dir = spec_dir
        self.gpu_classes = list(gpu_classes)

    @property
    def label(self) -> str:
        return " ".join([self.type, ",".join(self.config.entry_points)]).strip()

    def sources(self) -> dict[str, str]:
        """Kernel-source digests this warmer depends on: stamp factors ``source/<name>``."""
        return entry_point_sources(self.type, self.config.entry_points, self.spec_dir)

    def measured_factors(self) -> list[str]:
        """Names of ``stamp.MEASURED_FACTORS`` the toolchain keys its artifacts on."""
        return []

    def path_factors(self) -> dict[str, str]:
        """Paths the toolchain bakes into its artifacts (``stamp.PATH_FACTORS``), as used."""
        return {}

    def sm_counts(self, arch: str) -> list[int]:
        """SM counts the artifacts are sized for (stamp factor ``gpu/sm_count``); none: any."""
        return []

    @abstractmethod
    def run(self, files_dir: Path, arch: str) -> WarmerReport:
        """Fill ``files_dir`` (the generation's ``files/``) and report what was produced."""


def resolve_entry_point(entry_point: str, spec_dir: Path | None) -> Callable[..., Any]:
    """``module:function`` (or ``module:obj.attr``); the spec's folder is importable first."""
    module_name, _, attr_path = entry_point.partition(":")
    if spec_dir is not None and str(spec_dir) not in sys.path:
        sys.path.insert(0, str(spec_dir))
    try:
        target: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            target = getattr(target, attr)
    except (ImportError, AttributeError) as exc:
        raise WarmError(f"entry point {entry_point}: cannot import: {exc}") from exc
    if not callable(target):
        raise WarmError(f"entry point {entry_point}: not callable")
    return target


# Helpers for the warmers that call Python entry points in-process.


def entry_point_sources(
    kind: str, entry_points: Iterable[str], spec_dir: Path | None
) -> dict[str, str]:
    """Digests of the entry points' modules and of every project-local module they import,
    transitively (``kernelcache.sources``): stamp factors ``source/<module>``."""
    if spec_dir is not None and str(spec_dir) not in sys.path:
        sys.path.insert(0, str(spec_dir))
    modules = sorted({ep.partition(":")[0] for ep in entry_points})
    try:
        digests = module_sources(*modules)
    except SourceError as exc:
        raise WarmError(f"{kind} warmer: cannot key the kernels: {exc.message}") from exc
    for module in modules:
        if digests.get(module, ABSENT) == ABSENT:
            raise WarmError(f"{kind} warmer: cannot digest source: module {module} not found")
    return digests


def call_entry_points(
    kind: str,
    entry_points: Iterable[str],
    spec_dir: Path | None,
    workload: Mapping[str, Any],
    arch: str,
) -> list[str]:
    """Call each entry point with a copy of the workload; the kernel names they return."""
    names: list[str] = []
    for entry_point in entry_points:
        fn = resolve_entry_point(entry_point, spec_dir)
        try:
            returned = fn(dict(workload))
        except (Exception, SystemExit) as exc:  # its exit code is not one of kernelcache's
            detail = (
                f"called sys.exit({exc.code!r})"
                if isinstance(exc, SystemExit)
                else one_line(f"{type(exc).__name__}: {exc}")
            )
            raise WarmError(
                f"{kind} entry point {entry_point} failed for {arch}: {detail}"
            ) from exc
        names.extend(_kernel_names(kind, entry_point, returned))
    return names


def _kernel_names(kind: str, entry_point: str, returned: Any) -> list[str]:
    """What an entry point returned: None, or an iterable of kernel names (strings)."""
    if returned is None:
        return []
    iterable = isinstance(returned, Iterable) and not isinstance(returned, (str, bytes))
    names = list(returned) if iterable else None
    if names is None or not all(isinstance(name, str) for name in names):
        shown = type(returned).__name__ if names is None else "a list holding non-strings"
        raise WarmError(
            f"{kind} entry point {entry_point} returned {shown}: "
            "expected None or a list of kernel names"
        )
    return names


@contextlib.contextmanager
def scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of a warmer, then put the old ones back."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def snapshot(files_dir: Path, subdirs: Iterable[str]) -> dict[Path, int]:
    """Every regular file below the given subdirectories of ``files_dir``, and its size."""
    return {
        p: p.stat().st_size
        for sub in subdirs
        if (files_dir / sub).is_dir()
        for p in (files_dir / sub).rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def record_growth(report: WarmerReport, files_dir: Path, grown: Mapping[Path, int]) -> None:
    """Count the files a warmer added or changed into its report, per subdirectory."""
    report.files, report.bytes = len(grown), sum(grown.values())
    for path, size in grown.items():
        sub = path.relative_to(files_dir).parts[0]
        usage = report.dirs.setdefault(sub, {"files": 0, "bytes": 0})
        usage["files"] += 1
        usage["bytes"] += size


# Warmer type -> "module:Class"; imported only when a spec uses it (torch, triton and
# FlashInfer are heavy, and absent from the init-container image).
WARMERS = {
    "cute-dsl": "kernelcache.warm.cute_dsl:CuteDslWarmer",
    "triton": "kernelcache.warm.triton:TritonWarmer",
    "torch-compile": "kernelcache.warm.torch_compile:TorchCompileWarmer",
    "flashinfer": "kernelcache.warm.flashinfer:FlashInferWarmer",
    "b12x": "kernelcache.warm.b12x:B12xWarmer",
    "vllm": "kernelcache.warm.vllm:VllmWarmer",
    "command": "kernelcache.warm.command:CommandWarmer",
}


def warmer_class(kind: str) -> type[Warmer]:
    module_name, _, class_name = WARMERS[kind].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise WarmError(f"{kind} warmer unavailable here: {exc}") from exc
    cls: type[Warmer] = getattr(module, class_name)
    return cls


def make_warmers(
    configs: list[WarmerSpec], spec_dir: Path | None = None, gpu_classes: Sequence[GpuClass] = ()
) -> list[Warmer]:
    """Each warmer with the GPU classes it compiles for (``gpuClasses``; all when it names none)."""
    return [
        warmer_class(c.type)(c, spec_dir, [g for g in gpu_classes if c.compiles_for(g)])
        for c in configs
    ]


def run_warmers(
    warmers: list[Warmer], files_dir: Path, arch: str, positions: list[int] | None = None
) -> dict[str, Any]:
    """Run every warmer in order; the report that goes into the manifest.

    ``positions``: each warmer's index in ``spec.warmers``, for messages (default: its place
    in ``warmers``, which holds only the arch's warmers when some name GPU classes).
    """
    reports = []
    start = time.perf_counter()
    for done, (index, warmer) in enumerate(
        zip(positions or range(len(warmers)), warmers, strict=True), 1
    ):
        progress.note(f"warmer {done}/{len(warmers)} {warmer.label} for {arch}")
        seconds = warmer.config.timeout_seconds
        late = f"spec.warmers[{index}] ({warmer.label}) ran past timeoutSeconds={seconds}"
        with deadline(seconds, f"{late} for {arch}"):
            report = warmer.run(files_dir, arch)
        if report.files == 0:
            raise WarmError(
                f"spec.warmers[{index}] ({warmer.label}) produced nothing for {arch}: "
                "a declared warmer must leave at least one artifact"
            )
        reports.append(report.to_dict())
    return {
        "arch": arch,
        "seconds": round(time.perf_counter() - start, 3),
        "warmers": reports,
        "dirs": dir_usage(files_dir),
    }
