"""This node's SM arch and GPU product, for the init-container to pick and check a generation.

Each comes from, first to last: an explicit override (``--arch``/``--gpu-product`` or
``KERNELCACHE_ARCH``/``KERNELCACHE_GPU_PRODUCT``); the node's GPU feature discovery labels,
read from the operator's node map (``nodemap``: ``--node-map`` or ``KERNELCACHE_NODE_MAP``, a
mounted ConfigMap) with the node name from the downward API (``--node-name`` or
``KERNELCACHE_NODE_NAME``); ``nvidia-smi`` when a GPU is visible. The labels come before
``nvidia-smi`` because an init-container is usually given no GPU (requesting one would hold
it while the cache is copied).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kernelcache import contract, measure, nodemap
from kernelcache.arch import from_compute_capability
from kernelcache.errors import NoGpuInfoError
from kernelcache.nodemap import MAJOR_LABEL, MINOR_LABEL, PRODUCT_LABEL

__all__ = ["LabelReader", "NodeInfo", "arch_from_labels", "discover_node"]

# GFD appends this to the product of a time-sliced GPU: the same chip, tuned the same.
_SHARED_SUFFIX = "-SHARED"

LabelReader = Callable[[str], Mapping[str, str]]


@dataclass(frozen=True)
class NodeInfo:
    """This node's arch and GPU product, where each came from, and what else was tried."""

    arch: str | None
    arch_source: str | None
    product: str | None
    product_source: str | None
    tried: tuple[str, ...] = ()


def arch_from_labels(labels: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(arch, product) from GPU feature discovery labels; None where a label is absent.

    ``nvidia.com/gpu.compute.major=9`` and ``minor=0`` give ``sm_90a``: from Hopper on the
    arch-specific target (``a``) is the one kernels are built for, as ``measure.detect_arch``
    names it from ``nvidia-smi``. The product label has GFD's spaces-to-dashes form
    (``NVIDIA-H100-80GB-HBM3``); a time-sliced GPU's ``-SHARED`` suffix is dropped.
    """
    product = labels.get(PRODUCT_LABEL) or None
    if product is not None and product.endswith(_SHARED_SUFFIX):
        product = product.removesuffix(_SHARED_SUFFIX) or None
    major, minor = labels.get(MAJOR_LABEL), labels.get(MINOR_LABEL)
    if not major and not minor:
        return None, product
    if not (major and major.isdigit() and minor and minor.isdigit() and len(minor) == 1):
        raise NoGpuInfoError(
            f"node labels {MAJOR_LABEL}={major!r} {MINOR_LABEL}={minor!r}: "
            "not a compute capability like 9 and 0"
        )
    return from_compute_capability(int(major), int(minor)), product


def _from_nvidia_smi() -> tuple[str, str | None]:
    """(arch, product) of the visible GPUs: the same reading the stamp's detection makes.

    ``measure.detect_arch`` would also honour ``CUTE_DSL_ARCH``, a build-time setting that a
    serving image may carry; here only the hardware counts, so the GPU list is read directly.
    """
    gpus = measure.visible_gpus()
    archs = sorted({arch for _, arch in gpus})
    if len(archs) > 1:
        raise NoGpuInfoError(f"nvidia-smi: visible GPUs have different archs ({', '.join(archs)})")
    # Mixed products of one arch: a name no single product matches, as the stamp records it.
    return archs[0], "+".join(sorted({name for name, _ in gpus if name})) or None


def discover_node(
    *,
    arch: str | None = None,
    gpu_product: str | None = None,
    node_name: str | None = None,
    env: Mapping[str, str] | None = None,
    label_reader: LabelReader | None = None,
) -> NodeInfo:
    """This node's arch and product; each from the first source that knows it.

    Never raises for a source that has nothing: the result says what was tried, and the
    caller decides whether a missing arch is fatal. An override that is not an arch raises.
    """
    settings = contract.Settings.from_env(env)
    tried: list[str] = []
    found: dict[str, tuple[str, str]] = {}

    def take(what: str, value: str | None, source: str) -> None:
        if value and what not in found:
            found[what] = (value, source)

    take("arch", arch, "--arch")
    take("arch", settings.arch, contract.ARCH.name)
    if "arch" in found:
        measure.detect_arch(found["arch"][0])  # NoGpuInfoError naming a malformed override
    else:
        tried.append(f"no --arch or {contract.ARCH.name}")
    take("product", gpu_product, "--gpu-product")
    take("product", settings.gpu_product, contract.GPU_PRODUCT.name)

    node = node_name or settings.node_name
    if label_reader is None:
        label_reader = nodemap.reader(settings.node_map or Path(nodemap.MOUNT_DIR))
    if len(found) < 2 and node:
        try:
            label_arch, label_product = arch_from_labels(label_reader(node))
        except NoGpuInfoError as exc:
            tried.append(exc.message)
        else:
            take("arch", label_arch, f"node {node} labels")
            take("product", label_product, f"node {node} labels")
            if label_arch is None:
                tried.append(f"node {node} has no {MAJOR_LABEL}/{MINOR_LABEL} labels")
    elif len(found) < 2:
        tried.append(f"no node name (--node-name or {contract.NODE_NAME.name})")

    if len(found) < 2:
        try:
            smi_arch, smi_product = _from_nvidia_smi()
        except NoGpuInfoError as exc:
            tried.append(exc.message)
        else:
            take("arch", smi_arch, "nvidia-smi")
            # A product is only this node's if its GPUs are of the arch already found.
            if found["arch"][0] == smi_arch:
                take("product", smi_product, "nvidia-smi")

    arch_found, product_found = found.get("arch"), found.get("product")
    return NodeInfo(
        arch=arch_found[0] if arch_found else None,
        arch_source=arch_found[1] if arch_found else None,
        product=product_found[0] if product_found else None,
        product_source=product_found[1] if product_found else None,
        tried=tuple(tried),
    )
