"""What every toolchain module declares, and the warm flow written once for all of them.

A toolchain (``kernelcache.toolchains.<name>``) owns both sides of one compiler or engine:
the ``files/`` subdirectories its cache variables point at, its warmers, the serving
environment it needs, how a serving process observes (and in strict mode refuses) its
compiles, and which of its files hold tuning valid for one GPU product only. The registry
(``kernelcache.toolchains``) finds the modules; nothing names them.

The warm flow (``Warmer.run``) is the same for every warmer, the way FlashInfer's ``JitSpec``
owns load-else-build for each of its modules: scoped environment, then the warmer's own
``produce`` step, then count what appeared in its subdirectories, then its ``expect`` checks.
A warmer that was declared but produced nothing is a failed warm, not a success
(``run_warmers``): persistence that fails open fails silently, so we check the files.

Light at import: the init-container and the webhook import the toolchains' names, so torch,
Triton, the DSL and FlashInfer are imported inside functions only.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kernelcache import progress
from kernelcache.deadline import deadline
from kernelcache.errors import KernelCacheError, StorageError, WarmError, one_line
from kernelcache.sources import ABSENT, SourceError, import_problem, module_sources

if TYPE_CHECKING:
    from kernelcache.contract import Settings
    from kernelcache.spec import GpuClass, LearnedKey
    from kernelcache.spec import Warmer as WarmerSpec
    from kernelcache.store import Manifest


@dataclass
class Serving:
    """What ``kernelcache.runtime.install()`` hands each toolchain in a serving process."""

    config: Settings
    files: Path | None  # the generation's files/; None: no generation, compiles only counted
    manifest: Manifest | None
    # Sets a variable unless the user already did (recorded in ``Runtime.env``).
    set_default: Callable[[str, str], None]


@dataclass(frozen=True)
class Toolchain:
    """One toolchain's declarations and its serving side; a module's ``TOOLCHAIN`` is one
    (a subclass where the toolchain does more in serving than point its caches)."""

    name: str
    # Cache variable -> subdirectory of files/ it is pointed at, in a warm and in serving.
    cache_env: Mapping[str, str] = field(default_factory=dict)
    # Set (unless already set) besides the cache variables when serving from a generation.
    serving_settings: Mapping[str, str] = field(default_factory=dict)
    # Files (as named under files/) holding tuning valid for one GPU product only.
    tuning_suffixes: tuple[str, ...] = ()
    tuning_prefixes: tuple[str, ...] = ()
    # The warmer types this toolchain provides (``spec.warmers[].type``).
    warmers: tuple[type[Warmer], ...] = ()
    # (distribution, module): what must install and import for its warmers and serving
    # (``kernelcache doctor`` checks it); None: nothing of its own.
    requires: tuple[str, str] | None = None
    # True: its serving side only reads the subdirectories of its cache variables, and
    # without mapping them executable, so it can use them in place on a read-only, noexec
    # mount (an image volume). False (the default): they are copied where it can write,
    # because it writes there on a hit, or a miss would fail instead of compiling.
    reads_in_place: bool = False

    @property
    def label(self) -> str:
        """How messages name the toolchain: its (first) warmer type, else its name."""
        return self.warmers[0].type if self.warmers else self.name

    def fills(self) -> set[str]:
        """The files/ subdirectories the toolchain's cache variables and warmers fill."""
        return {*self.cache_env.values(), *(sub for w in self.warmers for sub in w.fills)}

    def serving_env(self, serving: Serving, files: Path) -> dict[str, str]:
        """The variables a serving process sets (unless already set) to use ``files``."""
        pointed = {var: str(files / sub) for var, sub in self.cache_env.items()}
        return {**pointed, **self.serving_settings}

    def check_generation(self, manifest: Manifest, strict: bool) -> None:
        """Refuse (strict) or warn about a generation this process cannot use as laid out."""

    @property
    def supported_range(self) -> str:
        """The releases of ``requires`` this toolchain supports, in words ("" when any)."""
        return ""

    def version_problem(self, version: str) -> str | None:
        """Why release ``version`` of ``requires`` is not supported here (None: it is)."""
        return None

    def check_warm(self, config: WarmerSpec) -> None:
        """Refuse, before anything is warmed, an installation this toolchain does not support
        for the warmer ``config`` declares (a release outside its range)."""

    def check_pod(self, manifest: Manifest, environ: Mapping[str, str]) -> None:
        """Refuse, in the init-container, a pod environment the generation cannot serve."""

    def unchecked(self, manifest: Manifest) -> str | None:
        """What of this toolchain's artifacts in ``manifest`` a stamp check cannot judge
        (``verify --check-env``, ``explain … env``): a key only a traced kernel shows."""
        return None

    def place(self, copy: Path, manifest: Manifest, dropped: Sequence[str]) -> dict[str, Any]:
        """In the init-container, after the generation was copied to ``copy`` (``dropped``
        left out): put what must live elsewhere in place, or refuse a copy this toolchain
        could not serve from. Returns what to add to the verify report."""
        return {}

    def observe(self, serving: Serving) -> None:
        """Count this toolchain's compiles in serving (refuse them when strict), installed
        when the application imports the toolchain (``runtime.imports.when_imported``)."""

    def holds_own_default(self, name: str) -> bool:
        """Whether ``name`` holds a value the toolchain wrote for itself, not the user's."""
        return False


def poll_forever(poll: Callable[[], None], interval: float, name: str) -> threading.Thread:
    """``poll()`` every ``interval`` seconds in a daemon thread (a serving-side watcher)."""

    def follow() -> None:
        while True:
            poll()
            time.sleep(interval)

    thread = threading.Thread(target=follow, name=name, daemon=True)
    thread.start()
    return thread


def make_cache_dirs(files_dir: Path, cache_env: Mapping[str, str]) -> dict[str, str]:
    """The cache variables pointed at subdirectories of ``files_dir`` (created here)."""
    env = {}
    for var, sub in cache_env.items():
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
    report_type: ClassVar[Callable[..., WarmerReport]] = WarmerReport
    # The files/ subdirectories this warmer fills: created before it runs, counted after.
    fills: ClassVar[tuple[str, ...]] = ()
    # False: the report counts the files this warmer added or changed. True: every file of
    # its subdirectories, so a warmer whose kernels an earlier one already left (all hits)
    # still reports what the generation holds for it.
    counts_held: ClassVar[bool] = False

    def __init__(
        self,
        config: WarmerSpec,
        spec_dir: Path | None = None,
        gpu_classes: Sequence[GpuClass] = (),
        learned: Sequence[LearnedKey] = (),
    ) -> None:
        self.config = config
        self.spec_dir = spec_dir
        self.gpu_classes = list(gpu_classes)
        # A line of the warmer's own output that says the disk is full (``volume_full``).
        self.said_full: str | None = None
        # What serving compiled that an earlier generation lacked (``kernelcache.learned``):
        # a warmer that can reproduce a key warms it too.
        self.learned = list(learned)
        # The files/ directories of earlier generations of the same key (the current one
        # first): a warmer whose artifacts are each keyed in full may take the ones whose
        # key has not moved from there instead of compiling them again.
        self.earlier: tuple[Path, ...] = ()

    @property
    def label(self) -> str:
        return " ".join([self.type, ",".join(self.config.entry_points)]).strip()

    def sources(self) -> dict[str, str]:
        """Kernel-source digests this warmer depends on: stamp factors ``source/<name>``."""
        return entry_point_sources(self.type, self.config.entry_points, self.spec_dir)

    def measured_factors(self) -> list[str]:
        """Names of ``measure.MEASURED_FACTORS`` the toolchain keys its artifacts on."""
        return []

    def path_factors(self) -> dict[str, str]:
        """Paths the toolchain bakes into its artifacts (``measure.PATH_FACTORS``), as used."""
        return {}

    def sm_counts(self, arch: str) -> list[int]:
        """SM counts the artifacts are sized for (stamp factor ``gpu/sm_count``); none: any."""
        return []

    def run(self, files_dir: Path, arch: str) -> WarmerReport:
        """Fill ``files_dir`` (the generation's ``files/``) and report what was produced:
        scoped environment, ``produce``, count what appeared, ``check_expected``."""
        for sub in self.fills:
            (files_dir / sub).mkdir(parents=True, exist_ok=True)
        before = {} if self.counts_held else snapshot(files_dir, self.counted_dirs(files_dir))
        report = self.report_type(warmer=self.label)
        start = time.perf_counter()
        with scoped_env({**self.config.env, **self.env(files_dir, arch)}):
            try:
                self.produce(files_dir, arch, report)
            except (KernelCacheError, OSError) as exc:
                full = volume_full(exc, files_dir, self.said_full)
                if full is None:
                    raise
                failed = exc.message if isinstance(exc, KernelCacheError) else self.label
                raise StorageError(f"{one_line(failed)}: {full}", path=str(files_dir)) from exc
        report.seconds = round(time.perf_counter() - start, 3)
        after = snapshot(files_dir, self.counted_dirs(files_dir))
        grown = {path: size for path, size in after.items() if before.get(path) != size}
        record_growth(report, files_dir, grown)
        self.check_expected(report, grown, arch)
        return report

    def would_refuse(self, files_dir: Path, arch: str) -> str | None:
        """Why a strict serving process would refuse a kernel of this warmer from the
        generation at ``files_dir``, whose stamp matches (None: it would serve them all)."""
        with scoped_env({**self.config.env, **self.env(files_dir, arch)}):
            return self.outdated(files_dir, arch)

    def outdated(self, files_dir: Path, arch: str) -> str | None:
        """``would_refuse`` under the warm's environment; the stamp is all most keys hold."""
        return None

    def env(self, files_dir: Path, arch: str) -> dict[str, str]:
        """The variables the warm runs under, over the spec's ``env`` (its caches, say)."""
        return {}

    @abstractmethod
    def produce(self, files_dir: Path, arch: str, report: Any) -> None:
        """Drive the toolchain so that it fills its subdirectories; note what it did."""

    def counted_dirs(self, files_dir: Path) -> Iterable[str]:
        """The subdirectories whose files the report counts."""
        return self.fills

    def check_expected(self, report: Any, grown: Mapping[Path, int], arch: str) -> None:
        """Fail the warm when an artifact the spec declares (``expect``) did not appear."""
        return None


# A full volume (or quota), as errno and as the C library words it in a tool's output.
_FULL = (errno.ENOSPC, errno.EDQUOT)
FULL_WORDS = tuple(os.strerror(code) for code in _FULL)


def volume_full(exc: BaseException, files_dir: Path, said: str | None = None) -> str | None:
    """Why a failed warm was a full disk, in words (None: it was not, as far as is known).

    A warmer's failure line names the warmer ("sh exited with 1"); the cause is a full disk
    when an error in its chain is ENOSPC or EDQUOT (a Python warmer), when the warmer's own
    output said so (``said``: a command, a compiler), or when the generation's volume has no
    block left now.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL:
            where = f" writing {seen.filename}" if seen.filename else ""
            return f"no space left{where} ({errno.errorcode[seen.errno]}: {seen.strerror})"
        seen = seen.__cause__ or seen.__context__
    if said is not None:
        return f"no space left on device (its output: {one_line(said)[:200]})"
    try:
        free = os.statvfs(files_dir)
    except OSError:
        return None
    if free.f_bavail == 0:
        return f"no space left on device: {files_dir} has no free block"
    return None


def resolve_entry_point(entry_point: str, spec_dir: Path | None) -> Callable[..., Any]:
    """``module:function`` (or ``module:obj.attr``); the spec's folder is importable first."""
    module_name, _, attr_path = entry_point.partition(":")
    if spec_dir is not None and str(spec_dir) not in sys.path:
        sys.path.insert(0, str(spec_dir))
    try:
        target: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            target = getattr(target, attr)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # the module is here; something it imports is not
            raise WarmError(f"entry point {entry_point}: cannot import: {exc}") from exc
        raise WarmError(not_found(f"entry point {entry_point}", module_name)) from exc
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
            raise WarmError(not_found(f"{kind} warmer", module))
    return digests


def not_found(who: str, module: str) -> str:
    """The line for a kernel module not found here, and where it was looked for."""
    return (
        f"{who}: cannot import {module}, beside the spec or on sys.path: {import_problem(module)}"
    )


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
        step = f"warmer {done}/{len(warmers)} {warmer.label}"
        progress.note(f"{step} for {arch}")
        seconds = warmer.config.timeout_seconds
        late = f"spec.warmers[{index}] ({warmer.label}) ran past timeoutSeconds={seconds}"
        with deadline(seconds, f"{late} for {arch}"), progress.heartbeat(step, seconds):
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
