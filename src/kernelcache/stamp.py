"""The key factors of a cache generation, and the digests derived from them.

A stamp is a flat map of named factors (``arch``, ``python_abi``, ``dist/torch``, ...), each a
canonical string. A cache generation is valid for an environment exactly when the environment's
stamp has the same digest, and ``explain`` names the factors that differ when it does not.

Host- and path-derived values are never factors, by construction: nothing here reads HOME, the
working directory, PATH, the hostname, TMPDIR, a pod IP or node name, the time, a PID, a cache
directory or any absolute path into a factor value. Every such value differs between the pod
that builds a cache and the pods that serve from it, so a factor derived from one never matches:
peers lost whole caches to a pod IP in a hash, to a ``cuda_home`` that depended on PATH, and to
path-valued environment variables. Paths are only used to *find* things (a RECORD, torch's
``version.py``, ``nvidia-smi``), and the factor holds what was found, never where.

Collecting must work in a slim init-container without torch, CUDA or any DSL, and must stay
cheap, so installed packages are described from their metadata (``importlib.metadata`` and file
reads) and are never imported.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import blake3

from kernelcache import contract
from kernelcache.arch import arch_problem, from_compute_capability
from kernelcache.documents import load_json
from kernelcache.errors import (
    ManifestError,
    NoGpuInfoError,
    NotInstalledError,
    SpecError,
    StampMismatchError,
    and_more,
)
from kernelcache.settings import SETTING_PREFIX, compile_settings
from kernelcache.sources import (
    ABSENT,
    SourceError,
    find_spec_without_import,
    import_problem,
    module_sources,
)

__all__ = [
    "DEFAULT_DISTRIBUTIONS",
    "TUNE_SCOPED",
    "FactorDiff",
    "Stamp",
    "collect",
    "detect_arch",
    "detect_gpu_product",
    "distribution_factor",
    "distribution_name",
    "explain",
    "file_digest",
    "from_json",
    "record_digest",
    "to_json",
    "workload_digest",
]

DEFAULT_DISTRIBUTIONS: tuple[str, ...] = (
    "torch",
    "triton",
    "flashinfer-python",
    "flashinfer-cubin",
    "flashinfer-jit-cache",
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12",
    "nvidia-cutlass-dsl-libs-cu13",
    "apache-tvm-ffi",
    "cuda-python",
    "cuda-bindings",
    "vllm",
    "sglang",
    "deep-gemm",
)

# Autotune results are valid for one GPU product; compiled kernels for every product of an arch.
TUNE_SCOPED: frozenset[str] = frozenset({"gpu_product"})

# Bumping this deliberately invalidates every stamp digest (a change in how factors are read).
_SCHEME = "kernelcache.stamp/1"

_CUDA_RUNTIME_DISTRIBUTIONS = (
    "nvidia-cuda-runtime-cu12",
    "nvidia-cuda-runtime-cu13",
    "nvidia-cuda-runtime",
)
_TORCH_CUDA_LINE = re.compile(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", re.MULTILINE)
_ARCH_FORMAT = re.compile(r"^sm_[0-9]{2,3}[af]?$")
_COMPUTE_CAP = re.compile(r"^([0-9]+)\.([0-9])$")
# Files an installer writes into a .dist-info: they describe the install, not the wheel
# (who installed it, whether it was asked for by name, the URL or local path it came from).
_INSTALLER_FILES = frozenset({"INSTALLER", "REQUESTED", "direct_url.json"})
_LONG_HEX = re.compile(r"\b([0-9a-f]{12})[0-9a-f]{4,}\b")

NVIDIA_SMI_TIMEOUT_S = 10.0


def _tagged(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


@dataclass(frozen=True)
class Stamp:
    """Factor name -> canonical string value, kept sorted and read-only."""

    factors: Mapping[str, str]

    def __post_init__(self) -> None:
        items = dict(self.factors)
        for name, value in items.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"factor name {name!r} is not a non-empty string")
            if not isinstance(value, str):
                raise ValueError(f"factor {name}: value {value!r} is not a string")
        if items.get("gpu_product") == "":
            raise ValueError("factor gpu_product is empty; omit it instead")
        object.__setattr__(self, "factors", MappingProxyType(dict(sorted(items.items()))))

    def __reduce__(self) -> tuple[type[Stamp], tuple[dict[str, str]]]:
        # A mapping proxy does not pickle; warmers hand stamps to worker processes.
        return (Stamp, (dict(self.factors),))

    def factor_digests(self) -> dict[str, str]:
        """Name -> digest of (name, value), so a manifest can name the factor that changed."""
        return {
            name: _tagged(_canonical_json([name, value])) for name, value in self.factors.items()
        }

    @property
    def digest(self) -> str:
        """The key of the generation: every factor, tuning included."""
        return _digest_of(self.factor_digests())

    @property
    def compile_digest(self) -> str:
        """The key of the compiled kernels, valid across the GPU products of one arch."""
        digests = self.factor_digests()
        return _digest_of({n: d for n, d in digests.items() if n not in TUNE_SCOPED})

    def to_dict(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "compile_digest": self.compile_digest,
            "factors": dict(self.factors),
            "factor_digests": self.factor_digests(),
        }

    @classmethod
    def from_dict(cls, d: Any) -> Stamp:
        """Rebuild a stamp; stored digests are recomputed, never trusted."""
        if not isinstance(d, Mapping):
            raise ManifestError(f"stamp: expected an object, got {type(d).__name__}")
        factors = d.get("factors")
        if not isinstance(factors, Mapping):
            raise ManifestError("stamp.factors: expected an object of strings")
        try:
            stamp = cls(factors)
        except ValueError as exc:
            raise ManifestError(f"stamp.factors: {exc}") from None
        stored = d.get("factor_digests")
        if not isinstance(stored, Mapping):
            raise ManifestError("stamp.factor_digests: expected an object of strings")
        recomputed = stamp.factor_digests()
        for name in sorted(set(stored) | set(recomputed)):
            if stored.get(name) != recomputed.get(name):
                raise ManifestError(
                    f"stamp.factor_digests[{name}]: stored {stored.get(name)!r} does not match "
                    f"the factor ({recomputed.get(name) or 'no such factor'})"
                )
        for key in ("digest", "compile_digest"):
            if d.get(key) != getattr(stamp, key):
                raise ManifestError(
                    f"stamp.{key}: stored {d.get(key)!r} does not match the factors "
                    f"({getattr(stamp, key)})"
                )
        return stamp


def _digest_of(factor_digests: Mapping[str, str]) -> str:
    return _tagged(_canonical_json([_SCHEME, sorted(factor_digests.items())]))


@dataclass(frozen=True)
class FactorDiff:
    """One factor that differs; ``None`` means the factor is absent on that side."""

    name: str
    left: str | None
    right: str | None

    def describe(self, sides: tuple[str, str] | None = None) -> str:
        """``name: left != right``; ``sides`` labels each value with where it comes from."""
        if sides is None:
            return f"{self.name}: {_show(self.left)} != {_show(self.right)}"
        return f"{self.name}: {_show(self.left)} ({sides[0]}) != {_show(self.right)} ({sides[1]})"


# How every diff labels its sides (``explain``, ``verify --check-env``, the runtime).
ENVIRONMENT_SIDE = "this environment"


def generation_side(generation: str) -> str:
    return f"generation {generation[:16]}"


def _show(value: str | None) -> str:
    if value is None:
        return "(no such factor)"
    return _LONG_HEX.sub(r"\1..", value) if value else '""'


def explain(left: Stamp, right: Stamp) -> list[FactorDiff]:
    """Exactly the factors that were added, removed or changed, sorted by name."""
    names = sorted(set(left.factors) | set(right.factors))
    return [
        FactorDiff(name, left.factors.get(name), right.factors.get(name))
        for name in names
        if left.factors.get(name) != right.factors.get(name)
    ]


def to_json(stamp: Stamp) -> str:
    return json.dumps(stamp.to_dict(), sort_keys=True, indent=2) + "\n"


def from_json(text: str) -> Stamp:
    try:
        data = load_json(text, "stamp", ManifestError)
    except ValueError as exc:
        raise ManifestError(f"stamp: not valid JSON ({exc})") from None
    return Stamp.from_dict(data)


def collect(
    *,
    arch: str | None = None,
    gpu_product: str | None = None,
    distributions: Iterable[str] | None = DEFAULT_DISTRIBUTIONS,
    sources: Mapping[str, str] | None = None,
    workload: object = None,
    extra: Mapping[str, str] | None = None,
    measured: Iterable[str] = (),
    sm_counts: Iterable[int] = (),
    paths: Mapping[str, str] | None = None,
    settings: Iterable[str] = (),
    ask_triton: bool = False,
) -> Stamp:
    """The stamp of this environment for a build or a check.

    ``gpu_product`` is detected only when the visible GPUs are of the target arch: a build for
    another arch says nothing about the product it will be tuned on. ``distributions=None``
    means the defaults. ``measured`` names factors of ``MEASURED_FACTORS`` a warmer depends on;
    ``sm_counts`` are the SM counts kernels were sized for (``gpu/sm_count``). ``paths``
    are the paths an engine bakes into its artifacts (``PATH_FACTORS``), as the warm used them.
    The toolchain settings that change compiled code (``kernelcache.settings``) are ``setting/``
    factors; ``settings`` names variables to measure besides, ``ask_triton`` lets Triton name
    its own.
    """
    target = detect_arch(arch)
    if gpu_product is None:
        gpu_product = detect_gpu_product(target)
    elif not gpu_product:
        raise SpecError("gpu_product is empty; leave it out to detect it, or name the product")
    factors = {"arch": target, "cuda_runtime": _cuda_runtime(), "python_abi": _python_abi()}
    if gpu_product is not None:
        factors["gpu_product"] = gpu_product
    for name in DEFAULT_DISTRIBUTIONS if distributions is None else distributions:
        factors[f"dist/{_canonical_name(name)}"] = distribution_factor(name)
    for name, digest in (sources or {}).items():
        factors[f"source/{name}"] = _declared("source", name, digest)
    if workload is not None:
        factors["workload"] = workload_digest(workload)
    for key, value in (extra or {}).items():
        factors[f"extra/{key}"] = _declared("extra", key, value)
    for name in measured:
        factors[name] = MEASURED_FACTORS[name]()
    if counts := sorted(set(sm_counts)):
        factors[SM_COUNT_FACTOR] = ",".join(map(str, counts))
    for name, value in (paths or {}).items():
        if name not in PATH_FACTORS:
            raise SpecError(f"{name}: not a path factor (known: {', '.join(PATH_FACTORS)})")
        factors[name] = value
    factors.update(compile_settings(also=settings, ask_triton=ask_triton))
    return Stamp(factors)


def environment_stamp(recorded: Stamp, arch: str | None = None) -> Stamp:
    """This environment's stamp for comparison with ``recorded``.

    Recomputes what an environment decides (arch, Python ABI, CUDA runtime, every recorded
    distribution, the kernel sources as importable here, the toolchain settings: those set
    here and every one recorded) and carries over what the
    build declared (workload, model, engine image) and the GPU product, which scopes only
    tuning results and is checked against the node separately.
    """
    factors = recorded.factors
    sources = _kernel_sources(factors)
    here = collect(
        arch=arch or factors.get("arch"),
        distributions=[n.removeprefix("dist/") for n in factors if n.startswith("dist/")],
        sources=sources,
        extra={n.removeprefix("extra/"): v for n, v in factors.items() if n.startswith("extra/")},
        measured=[n for n in factors if n in MEASURED_FACTORS],
        settings=[n.removeprefix(SETTING_PREFIX) for n in factors if n.startswith(SETTING_PREFIX)],
    )
    measured = {n: v for n, v in here.factors.items() if n not in TUNE_SCOPED}
    carried = {n for n, measure in PATH_FACTORS.items() if measure is None}
    declared = {
        n: v for n, v in factors.items() if n == "workload" or n in TUNE_SCOPED or n in carried
    }
    if SM_COUNT_FACTOR in factors:
        declared[SM_COUNT_FACTOR] = _sm_count_here(factors[SM_COUNT_FACTOR])
    return Stamp({**measured, **declared})


def _kernel_sources(recorded: Mapping[str, str]) -> dict[str, str]:
    """The recorded kernel modules as found here, with every project-local module they import
    now (one added since the build is a factor added); one that cannot be read is a mismatch.

    A module the build read that is not found here at all is no stale kernel but an import
    that would fail (a PYTHONPATH, a folder not copied): its own error, naming the module,
    the import's error and where it was looked for, not a rebuild to ask for."""
    modules = [n.removeprefix("source/") for n in recorded if n.startswith("source/")]
    try:
        here = module_sources(*modules)
    except SourceError as exc:
        raise StampMismatchError(exc.message) from None
    for name in modules:
        if here.get(name) == ABSENT and recorded[f"source/{name}"] != ABSENT:
            raise NotInstalledError(
                f"kernel module {name} does not import here: {import_problem(name)}",
                factor=f"source/{name}",
            )
    return here


def _sm_count_here(recorded: str) -> str:
    """The recorded SM counts when this GPU's is among them (or unknown here), else this one's."""
    here = detect_sm_count()
    return recorded if here is None or str(here) in recorded.split(",") else str(here)


def stamp_mismatch(
    diffs: list[FactorDiff], sides: tuple[str, str] | None = None
) -> StampMismatchError | None:
    """The one-line error for differing factors (the first named), or None when none differ."""
    if not diffs:
        return None
    more = and_more([d.name for d in diffs[1:]])
    return StampMismatchError(
        f"stamp mismatch: {diffs[0].describe(sides)}{more}",
        factor=diffs[0].name,
        details=[d.describe(sides) for d in diffs],
    )


@dataclass(frozen=True)
class EnvironmentCheck:
    """A generation's recorded stamp against this environment's, and the error they make."""

    recorded: Stamp
    diffs: list[FactorDiff]
    error: StampMismatchError | None


def check_environment(
    stamp: Mapping[str, Any], generation: str, arch: str | None = None
) -> EnvironmentCheck:
    """Compare a manifest's stamp with this environment (``arch``: this node's, else the
    stamp's); the error names the first factor that differs. The init-container's
    ``--check-env`` and the runtime's start both ask this."""
    recorded = Stamp.from_dict(stamp)
    diffs = explain(recorded, environment_stamp(recorded, arch))
    sides = (generation_side(generation), ENVIRONMENT_SIDE)
    return EnvironmentCheck(recorded, diffs, stamp_mismatch(diffs, sides))


def _declared(kind: str, name: str, value: str) -> str:
    """A caller-declared factor value, refused when it is a host path."""
    if not isinstance(name, str) or not name:
        raise SpecError(f"{kind} factor name {name!r} is not a non-empty string")
    if not isinstance(value, str):
        raise SpecError(f"{kind}/{name}: value {value!r} is not a string")
    if value.startswith(("/", "~/")):
        raise SpecError(
            f"{kind}/{name}: {value!r} is a host path; a key must not depend on where things "
            "are installed (declare a version or a digest instead)"
        )
    return value


ARCH_HINT = "set CUTE_DSL_ARCH (e.g. sm_90a)"  # where no caller has an option for it


def detect_arch(explicit: str | None = None, hint: str = ARCH_HINT) -> str:
    """The target arch: ``explicit``, else ``CUTE_DSL_ARCH``, else the visible GPUs; ``hint``
    (how the caller's user names an arch: its option) ends the line when there is none."""
    if explicit is not None:
        return _checked_arch(explicit, "arch")
    from_env = os.environ.get("CUTE_DSL_ARCH")
    if from_env:
        return _checked_arch(from_env, "CUTE_DSL_ARCH")
    try:
        gpus = _visible_gpus()
    except NoGpuInfoError as exc:
        raise NoGpuInfoError(f"cannot determine the target arch: {exc.message}; {hint}") from None
    archs = sorted({gpu_arch for _, gpu_arch in gpus})
    if len(archs) > 1:
        raise NoGpuInfoError(f"visible GPUs have different archs ({', '.join(archs)}); {hint}")
    return archs[0]


def _checked_arch(value: str, source: str) -> str:
    if not _ARCH_FORMAT.match(value):
        raise NoGpuInfoError(
            f"{source} {value!r} is not an arch like sm_90a, sm_100a or sm_86 "
            "(expected sm_<2-3 digits> with an optional a/f suffix)"
        )
    if (problem := arch_problem(value)) is not None:
        raise NoGpuInfoError(f"{source} {problem}")
    return value


def detect_gpu_product(arch: str | None = None) -> str | None:
    """The product name of the visible GPUs, or None when unknown or not of ``arch``."""
    try:
        gpus = _visible_gpus()
    except NoGpuInfoError:
        return None
    if arch is not None and any(gpu_arch != arch for _, gpu_arch in gpus):
        return None
    # Mixed products of one arch: a name no single product matches, so tuning never HITs.
    return "+".join(sorted({name for name, _ in gpus if name})) or None


def _visible_gpus() -> list[tuple[str, str]]:
    """(product name, arch) per GPU that nvidia-smi lists; NoGpuInfoError says why none."""
    gpus = []
    for row in _nvidia_smi("name,compute_cap"):
        name, _, cap = row.rpartition(",")
        gpus.append((name.strip(), _arch_from_compute_cap(cap.strip())))
    return gpus


def _arch_from_compute_cap(cap: str) -> str:
    """9.0 -> sm_90a: from Hopper on, arch-specific features need the "a" target."""
    match = _COMPUTE_CAP.match(cap)
    if match is None:
        raise NoGpuInfoError(f"nvidia-smi reported compute capability {cap!r}, not like 9.0")
    return from_compute_capability(int(match[1]), int(match[2]))


def _nvidia_smi(query: str) -> list[str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise NoGpuInfoError("nvidia-smi is not on PATH")
    try:
        proc = subprocess.run(
            [exe, f"--query-gpu={query}", "--format=csv,noheader"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise NoGpuInfoError(f"nvidia-smi did not answer in {NVIDIA_SMI_TIMEOUT_S:g}s") from None
    except OSError as exc:
        raise NoGpuInfoError(f"nvidia-smi could not be run ({exc.strerror})") from None
    if proc.returncode != 0:
        said = (proc.stdout + proc.stderr).strip().splitlines()
        reason = said[0].strip() if said else f"exit status {proc.returncode}"
        raise NoGpuInfoError(f"nvidia-smi failed: {reason}")
    rows = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if not rows:
        raise NoGpuInfoError("nvidia-smi lists no GPU")
    return rows


# ------------------------------------------------------------------ toolchain-keyed factors

SM_COUNT_FACTOR = "gpu/sm_count"


def detect_sm_count() -> int | None:
    """This node's GPU SM count: ``KERNELCACHE_SM_COUNT``, else the CUDA driver; None without.

    The driver is asked in a child process: ``cuInit`` in this one would break CUDA in any
    process it forks later (a serving engine's workers), and torch would not know.
    """
    if (count := contract.SM_COUNT.read(os.environ)) is not None:
        return count
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _DRIVER_SM_COUNT],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    answer = proc.stdout.strip()
    return int(answer) if proc.returncode == 0 and answer.isdigit() else None


# The first GPU's CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT (16) from the driver's C API.
_DRIVER_SM_COUNT = """
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    sys.exit(1)
device, count = ctypes.c_int(), ctypes.c_int()
if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0):
    sys.exit(1)
if cuda.cuDeviceGetAttribute(ctypes.byref(count), 16, device):
    sys.exit(1)
print(count.value)
"""


def flashinfer_cute_dsl_fingerprint() -> str:
    """FlashInfer's own fingerprint of its CuTe-DSL stack (``jit/cute_dsl_core.py``), digested.

    FlashInfer keys its persisted CuTe-DSL kernels on the raw RECORD and ``direct_url.json``
    of torch, apache-tvm-ffi and every nvidia-cutlass-dsl* distribution, plus the Python tag,
    and wipes them all on the first mismatch. That is stricter than the ``dist/`` factors
    (an installer's own RECORD rows count there), so it is mirrored here as one factor.
    """
    stack = []
    for dist in importlib.metadata.distributions():
        name = distribution_name(dist)
        if name in {"torch", "apache-tvm-ffi"} or name.startswith("nvidia-cutlass-dsl"):
            provenance = json.dumps([dist.read_text("RECORD"), dist.read_text("direct_url.json")])
            digest = hashlib.sha256(provenance.encode()).hexdigest()
            stack.append(f"{name}=={dist.version}:{digest}")
    text = ";".join([str(sys.implementation.cache_tag), str(_python_abi()), *sorted(stack)])
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def flashinfer_install() -> str:
    """Where FlashInfer is installed: it hashes its sources' absolute paths into its keys."""
    spec = find_spec_without_import("flashinfer")
    if spec is None or not spec.origin:
        return "absent"
    return str(Path(spec.origin).parent.parent)  # as Python found it: FlashInfer hashes __file__


def vllm_install() -> str:
    """Where vLLM is installed: its compile cache names files of the install by absolute path."""
    spec = find_spec_without_import("vllm")
    if spec is None or not spec.origin:
        return "absent"
    return str(Path(spec.origin).parent.parent)


def vllm_cache_root() -> str:
    """Where vLLM reads and writes its cache here, as ``vllm.envs.VLLM_CACHE_ROOT`` decides."""
    default_root = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return os.path.expanduser(
        os.environ.get("VLLM_CACHE_ROOT") or os.path.join(default_root, "vllm")
    )


# Factors a warmer can depend on beyond the distributions; measured again wherever a stamp
# is checked.
MEASURED_FACTORS = {
    "flashinfer/cute-dsl-fingerprint": flashinfer_cute_dsl_fingerprint,
    "flashinfer/install": flashinfer_install,
    "vllm/install": vllm_install,
    "vllm/cache_root": vllm_cache_root,
}

# Absolute paths an engine bakes into its artifacts, so a copy elsewhere crashes it (vLLM's
# compile cache names its artifacts, its install and its model by absolute path). The one
# exception to "no path is a factor": here the path IS what decides validity. A warmer
# declares the value it used; where the stamp is checked it is measured again (the function)
# or, when this environment cannot know it (the model path the engine will be given), carried
# over and checked by whoever knows it (``verify --expect-factor``, the serving runtime).
PATH_FACTORS: dict[str, Callable[[], str] | None] = {
    "vllm/cache_root": vllm_cache_root,
    "vllm/model": None,
}


def _canonical_name(name: str) -> str:
    """PEP 503 name, so ``flashinfer_python`` and ``flashinfer-python`` are one factor."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution_name(dist: importlib.metadata.Distribution) -> str:
    """The canonical name, from the dist-info folder's name where there is one.

    Parsing every installed distribution's METADATA costs tens of milliseconds in a serving
    image, more than loading a kernel; the folder name carries the same normalized name.
    """
    folder_name = getattr(dist, "_normalized_name", None)
    return str(folder_name or dist.metadata["Name"] or "").lower().replace("_", "-")


def distribution_factor(name: str) -> str:
    """``absent``, or ``<version> record=<hex>``: the same version rebuilt is another wheel."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
    return f"{dist.version} record={record_digest(dist)}"


def record_digest(dist: importlib.metadata.Distribution) -> str:
    """Hex digest of the wheel's files as RECORD lists them, or ``missing``.

    Only rows that come from the wheel's bytes count, so a re-install of the same wheel gives
    the same digest on any host: rows without a hash (bytecode, RECORD itself), bytecode caches,
    files the installer writes about the install, and files outside site-packages (console
    scripts carry the interpreter path in their shebang) are dropped.
    """
    text = dist.read_text("RECORD")
    if text is None:
        return "missing"
    rows = []
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 2 or not row[1]:
            continue
        path, file_hash, size = row[0], row[1], (row[2] if len(row) > 2 else "")
        parts = path.split("/")
        if parts[0] in ("..", "") or "__pycache__" in parts:
            continue
        if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] in _INSTALLER_FILES:
            continue
        rows.append(f"{path},{file_hash},{size}\n")
    return blake3.blake3("".join(sorted(rows)).encode()).hexdigest()


def file_digest(path: str | os.PathLike[str]) -> str:
    """``blake3:<hex>`` of a file's bytes."""
    return "blake3:" + blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(path).hexdigest()


def workload_digest(obj: object) -> str:
    """Digest of canonical JSON (sorted keys, no whitespace) of a JSON-able workload."""
    try:
        data = _canonical_json(obj)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"workload is not plain JSON ({exc})") from None
    return _tagged(data)


def _python_abi() -> str:
    soabi = sysconfig.get_config_var("SOABI")
    if soabi:
        return str(soabi)
    multiarch = sysconfig.get_config_var("MULTIARCH") or platform.machine()
    return f"{sys.implementation.name}-{sys.version_info[0]}{sys.version_info[1]}-{multiarch}"


def _cuda_runtime() -> str:
    """Every CUDA runtime wheel's version, else the CUDA torch was built against, else none.

    Every one, not the first found: an image can hold a CUDA 12 and a CUDA 13 runtime for
    libraries built against each, and either one's upgrade changes what those libraries load.
    """
    installed = []
    for name in _CUDA_RUNTIME_DISTRIBUTIONS:
        try:
            installed.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    if installed:
        return "; ".join(installed)
    torch_cuda = _torch_cuda_version()
    return f"torch {torch_cuda}" if torch_cuda else "none"


def _torch_cuda_version() -> str | None:
    """The ``cuda = '...'`` line of torch's version.py, read as text: torch is not imported.

    Located beside the distribution's RECORD rather than through ``files()``, which builds a
    path object for each of torch's ~15,000 files: a third of a second in every serving start.
    """
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        text = Path(str(dist.locate_file("torch/version.py"))).read_text(encoding="utf-8")
    except OSError:
        return None
    match = _TORCH_CUDA_LINE.search(text)
    return match[1] if match else None
