"""What this environment is, measured for a stamp: the target arch and the visible GPUs, the
installed distributions (version and RECORD digest), the CUDA runtime, the Python ABI, and the
factors a toolchain measures beside them (FlashInfer's fingerprint, vLLM's install and cache
root, the SM count).

Host- and path-derived values are never factors (``kernelcache.stamp``): paths are only used
to *find* things (a RECORD, torch's ``version.py``, ``nvidia-smi``), and a factor holds what
was found, never where, except the ``PATH_FACTORS`` an engine bakes into its artifacts.
Nothing here imports torch, CUDA or a DSL: it runs in slim init-containers.
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
from collections.abc import Callable
from pathlib import Path

import blake3

from kernelcache import contract
from kernelcache.arch import arch_problem, from_compute_capability
from kernelcache.errors import (
    NoGpuInfoError,
)
from kernelcache.sources import (
    find_spec_without_import,
)

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


NVIDIA_SMI_TIMEOUT_S = 10.0


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
        gpus = visible_gpus()
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
        gpus = visible_gpus()
    except NoGpuInfoError:
        return None
    if arch is not None and any(gpu_arch != arch for _, gpu_arch in gpus):
        return None
    # Mixed products of one arch: a name no single product matches, so tuning never HITs.
    return "+".join(sorted({name for name, _ in gpus if name})) or None


def visible_gpus() -> list[tuple[str, str]]:
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
    text = ";".join([str(sys.implementation.cache_tag), str(python_abi()), *sorted(stack)])
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


def canonical_name(name: str) -> str:
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


def python_abi() -> str:
    soabi = sysconfig.get_config_var("SOABI")
    if soabi:
        return str(soabi)
    multiarch = sysconfig.get_config_var("MULTIARCH") or platform.machine()
    return f"{sys.implementation.name}-{sys.version_info[0]}{sys.version_info[1]}-{multiarch}"


def cuda_runtime() -> str:
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
