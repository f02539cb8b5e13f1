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
reads) and are never imported: what an environment is, is measured in ``kernelcache.measure``;
this module makes factors of it, digests them and compares two stamps.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import blake3

from kernelcache.documents import load_json
from kernelcache.errors import (
    ManifestError,
    NotInstalledError,
    SpecError,
    StampMismatchError,
    and_more,
)
from kernelcache.measure import (
    MEASURED_FACTORS,
    PATH_FACTORS,
    SM_COUNT_FACTOR,
    canonical_name,
    cuda_runtime,
    detect_arch,
    detect_gpu_product,
    detect_sm_count,
    distribution_factor,
    python_abi,
)
from kernelcache.settings import SETTING_PREFIX, compile_settings
from kernelcache.sources import (
    ABSENT,
    SourceError,
    import_problem,
    module_sources,
)

__all__ = [
    "DEFAULT_DISTRIBUTIONS",
    "TUNE_SCOPED",
    "FactorDiff",
    "Stamp",
    "collect",
    "explain",
    "from_json",
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

_LONG_HEX = re.compile(r"\b([0-9a-f]{12})[0-9a-f]{4,}\b")


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
    factors = {"arch": target, "cuda_runtime": cuda_runtime(), "python_abi": python_abi()}
    if gpu_product is not None:
        factors["gpu_product"] = gpu_product
    for name in DEFAULT_DISTRIBUTIONS if distributions is None else distributions:
        factors[f"dist/{canonical_name(name)}"] = distribution_factor(name)
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


# ------------------------------------------------------------------ toolchain-keyed factors


def workload_digest(obj: object) -> str:
    """Digest of canonical JSON (sorted keys, no whitespace) of a JSON-able workload."""
    try:
        data = _canonical_json(obj)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"workload is not plain JSON ({exc})") from None
    return _tagged(data)
