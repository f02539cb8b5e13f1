"""Whether a verified generation may serve this pod on this node: its stamp against both.

The init-container's step after the store's own checks: the node's arch, the engine image
and any factor the pod declares, this environment (``--check-env``, when the init-container
runs in the serving image), and the GPU product for autotune results, which are valid for
one product only (``tune_scoped_files``): another product's tuning is refused under the
strict policy and dropped under the permissive one; the compiled kernels stay valid for the
arch. Pure: every check reads the manifest and the node, and raises ``StampMismatchError``
naming the factor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kernelcache import stamp as stamps
from kernelcache.arch import product_slug
from kernelcache.contract import CacheKey
from kernelcache.errors import SpecError, StampMismatchError
from kernelcache.images import InvalidImageReference, same_image
from kernelcache.toolchains import is_tuning_file

if TYPE_CHECKING:
    from kernelcache.node import NodeInfo
    from kernelcache.store import Manifest

__all__ = [
    "ENGINE_IMAGE_FACTOR",
    "check_image",
    "check_stamp",
    "parse_expect_factor",
    "tune_scoped_files",
    "tuning_to_drop",
]

ENGINE_IMAGE_FACTOR = "extra/engine_image"


def parse_expect_factor(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` (the value may itself hold ``=``, as ``2.11.0 record=…`` does)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise SpecError(f"--expect-factor {text!r}: expected NAME=VALUE, e.g. dist/torch=…")
    return name.strip(), value


def _mismatch(name: str, built: str | None, expected: str, why: str) -> StampMismatchError:
    diff = stamps.FactorDiff(name, built, expected).describe()
    return StampMismatchError(f"stamp mismatch: {diff} ({why})", factor=name)


def _factors(manifest: Manifest) -> Mapping[str, str]:
    """The stamp's factors as recorded. Their consistency with the stamp digest is not
    re-derived here: the signature covers them, and ``--check-env`` parses them strictly."""
    factors = manifest.stamp.get("factors")
    return factors if isinstance(factors, Mapping) else {}


def check_image(manifest: Manifest, image: str) -> None:
    """Refuse a generation not built for ``image`` (compared as container runtimes resolve
    images; a stamp that records none was built for no image)."""
    built = _factors(manifest).get(ENGINE_IMAGE_FACTOR)
    why = "--expect-image"
    try:
        matches = built is not None and same_image(built, image)
    except InvalidImageReference as exc:
        matches, why = False, f"--expect-image: {exc}"
    if not matches:
        raise _mismatch(ENGINE_IMAGE_FACTOR, built, image, why)


def tune_scoped_files(manifest: Manifest) -> list[str]:
    """The generation's files that hold tuning results, valid for one GPU product only.

    By name (each toolchain's ``tuning_suffixes`` and ``tuning_prefixes``: Triton's saved
    autotune choices, inductor's tuned launch configs, FlashInfer's autotuner tactics;
    compiled kernels are valid for the whole arch) and as the warm report declares them (a
    warmer's ``tactics.file``, as the flashinfer warmer writes it).
    """
    declared: set[str] = set()
    warmers = manifest.report.get("warmers")
    for report in warmers if isinstance(warmers, list) else ():
        tactics = report.get("tactics") if isinstance(report, Mapping) else None
        if isinstance(tactics, Mapping) and isinstance(tactics.get("file"), str):
            declared.add(tactics["file"])
    return [e.path for e in manifest.files if e.path in declared or is_tuning_file(e.path)]


def tuning_to_drop(manifest: Manifest, node: NodeInfo, policy: str) -> tuple[list[str], str]:
    """Tuning files that are not this node's product's, and the line that says why.

    Tuning from another product, or for a node whose product is unknown, is refused
    (strict) or dropped (permissive); the compiled kernels stay valid for the arch.
    """
    tuned = tune_scoped_files(manifest)
    if not tuned:
        return [], ""
    built = _factors(manifest).get("gpu_product")
    if built and node.product and product_slug(built) == product_slug(node.product):
        return [], ""
    if node.product:
        shown, where = node.product, f"node, from {node.product_source}"
    else:
        shown, where = "(unknown)", "no node product from --gpu-product, labels or nvidia-smi"
    diff = stamps.FactorDiff("gpu_product", built, shown).describe()
    what = f"{len(tuned)} tuning file{'s' if len(tuned) != 1 else ''}, e.g. {tuned[0]}"
    if policy == "strict":
        raise StampMismatchError(
            f"stamp mismatch: {diff} ({where}; {what}; --policy permissive drops them)",
            factor="gpu_product",
        )
    return tuned, f"{diff} ({where}): dropped {what} (policy permissive)"


def _built_arch(manifest: Manifest, key: str) -> str:
    """The arch the stamp was computed for, which must be the key's arch.

    ``store.verify`` has checked that the manifest names this key; the stamp's arch must
    agree with it (an arch the stamp does not record is not taken from the key: the
    generation is then not bound to an arch at all).
    """
    built = _factors(manifest).get("arch")
    key_arch = CacheKey.parse(key).arch
    if not built:
        raise StampMismatchError(
            f"{key}: generation {manifest.generation} has no arch in its stamp (written by an "
            "older kernelcache): rebuild it (kernelcache build --force)",
            factor="arch",
        )
    if built != key_arch:
        raise _mismatch("arch", built, key_arch, f"the arch of key {key}")
    return built


def check_stamp(
    manifest: Manifest,
    key: str,
    node: NodeInfo,
    *,
    expect_image: str | None = None,
    expect_factors: Mapping[str, str] | None = None,
    check_env: bool = False,
) -> None:
    """Refuse a generation built for another arch, image, package or environment."""
    factors = _factors(manifest)
    built_arch = _built_arch(manifest, key)
    if node.arch is not None and built_arch != node.arch:
        raise _mismatch("arch", built_arch, node.arch, f"node, from {node.arch_source}")
    if expect_image is not None:
        check_image(manifest, expect_image)
    for name, expected in (expect_factors or {}).items():
        if factors.get(name) != expected:
            raise _mismatch(name, factors.get(name), expected, "--expect-factor")
    if check_env:
        arch = node.arch or built_arch
        error = stamps.check_environment(manifest.stamp, manifest.generation, arch).error
        if error is not None:
            raise error
