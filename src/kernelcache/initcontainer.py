"""The init-container: pick this node's generation, check it, copy it out, or refuse the pod.

``kernelcache verify`` runs this before a serving pod starts. In order:

1. **This node.** Its SM arch and GPU product come from, first to last: an explicit override
   (``--arch``/``--gpu-product`` or ``KERNELCACHE_ARCH``/``KERNELCACHE_GPU_PRODUCT``); the
   node's GPU feature discovery labels, read from the operator's node map (``nodemap``:
   ``--node-map`` or ``KERNELCACHE_NODE_MAP``, a mounted ConfigMap) with the node name from
   the downward API (``--node-name`` or ``KERNELCACHE_NODE_NAME``); ``nvidia-smi`` when a GPU
   is visible. The labels come before ``nvidia-smi`` because an init-container is usually given
   no GPU (requesting one would hold it while the cache is copied).
2. **The generation** that CURRENT names for ``<namespace>/<name>/<arch>`` on the read-only
   store (or an explicit ``--key``).
3. **Integrity and signature**: ``store.verify`` (every digest, in parallel; nothing unlisted;
   no symlink, hard link or path out of the generation, nothing only root can read; the
   manifest published for this very key under this directory's name; the ed25519 signature
   when a key is given or one is required).
4. **The stamp against the pod**: the node's arch, the engine image and any factor the pod
   declares, this environment (``--check-env``, when the init-container runs in the serving
   image), and the GPU product for autotune results (``--policy``, see ``tune_scoped_files``).
5. **Materialize** into the pod's emptyDir with every byte checked again as it is copied (a
   vLLM cache also to the absolute root it was built at, ``vllm_root``), and write
   ``kernelcache.env`` (what the serving container reads) last, atomically.

Fail closed: every failure raises a ``KernelCacheError`` subclass whose one-line message
names the factor or file, and the target directory then holds nothing that looks valid: the
env file is removed first and only written after everything else succeeded, and a copy is
renamed into place only when complete (``store.materialize``).

Nothing here imports torch, a DSL, a toolchain or the Kubernetes client: the init-container
image is slim and needs no API access.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kernelcache import nodemap, vllm_root
from kernelcache import stamp as stamps
from kernelcache.errors import (
    KernelCacheError,
    MissingGenerationError,
    NoGpuInfoError,
    SignatureError,
    SpecError,
    StampMismatchError,
    StorageError,
    one_line,
)
from kernelcache.images import InvalidImageReference, same_image

# The store's private write helpers too: one-line StorageErrors naming path and errno, and
# files made durable the way the store makes its own.
from kernelcache.nodemap import MAJOR_LABEL, MINOR_LABEL, PRODUCT_LABEL
from kernelcache.store import (
    COMPLETE_MARKER,
    CURRENT_NAME,
    FILES_DIR,
    Manifest,
    Store,
    fsync_dir,
    io_errors,
    load_public_key,
    materialize,
    verify,
    write_file_synced,
)

__all__ = [
    "ENV_FILE",
    "POLICIES",
    "REPORT_FILE",
    "NodeInfo",
    "Options",
    "Outcome",
    "arch_from_labels",
    "default_termination_log",
    "discover_node",
    "error_line",
    "parse_expect_factor",
    "run",
    "tune_scoped_files",
    "write_termination_log",
]

ENV_FILE = "kernelcache.env"
REPORT_FILE = "kernelcache-verify.json"
POLICIES = ("strict", "permissive")
TERMINATION_LOG = Path("/dev/termination-log")
# Kubernetes keeps at most 4096 bytes of a termination message.
_TERMINATION_LIMIT = 4096

# GFD appends this to the product of a time-sliced GPU: the same chip, tuned the same.
_SHARED_SUFFIX = "-SHARED"

# Tuning results, valid for one GPU product (compiled kernels are valid for the whole arch),
# as named in files/: Triton's saved autotune choices, inductor's tuned launch configs and
# FlashInfer's autotuner tactics. A warm report can name more (a warmer's ``tactics.file``).
TUNE_SUFFIXES = (".autotune.json", ".best_config")
TUNE_PREFIXES = ("flashinfer/tactics/",)

ENGINE_IMAGE_FACTOR = "extra/engine_image"

LabelReader = Callable[[str], Mapping[str, str]]


# --------------------------------------------------------------------------- this node


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
    arch-specific target (``a``) is the one kernels are built for, as ``stamp.detect_arch``
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
    return f"sm_{int(major)}{minor}{'a' if int(major) >= 9 else ''}", product


def _from_nvidia_smi() -> tuple[str, str | None]:
    """(arch, product) of the visible GPUs: the same reading the stamp's detection makes.

    ``stamp.detect_arch`` would also honour ``CUTE_DSL_ARCH``, a build-time setting that a
    serving image may carry; here only the hardware counts, so the GPU list is read directly.
    """
    gpus = stamps._visible_gpus()
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
    env = os.environ if env is None else env
    tried: list[str] = []
    found: dict[str, tuple[str, str]] = {}

    def take(what: str, value: str | None, source: str) -> None:
        if value and what not in found:
            found[what] = (value, source)

    take("arch", arch, "--arch")
    take("arch", env.get("KERNELCACHE_ARCH"), "KERNELCACHE_ARCH")
    if "arch" in found:
        stamps.detect_arch(found["arch"][0])  # NoGpuInfoError naming a malformed override
    else:
        tried.append("no --arch or KERNELCACHE_ARCH")
    take("product", gpu_product, "--gpu-product")
    take("product", env.get("KERNELCACHE_GPU_PRODUCT"), "KERNELCACHE_GPU_PRODUCT")

    node = node_name or env.get("KERNELCACHE_NODE_NAME")
    if label_reader is None:
        label_reader = nodemap.reader(Path(env.get("KERNELCACHE_NODE_MAP") or nodemap.MOUNT_DIR))
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
        tried.append("no node name (--node-name or KERNELCACHE_NODE_NAME)")

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


# --------------------------------------------------------------------------- the stamp


def parse_expect_factor(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` (the value may itself hold ``=``, as ``2.11.0 record=…`` does)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise SpecError(f"--expect-factor {text!r}: expected NAME=VALUE, e.g. dist/torch=…")
    return name.strip(), value


def _mismatch(name: str, built: str | None, expected: str, why: str) -> StampMismatchError:
    diff = stamps.FactorDiff(name, built, expected).describe()
    return StampMismatchError(f"stamp mismatch: {diff} ({why})")


def _factors(manifest: Manifest) -> Mapping[str, str]:
    """The stamp's factors as recorded. Their consistency with the stamp digest is not
    re-derived here: the signature covers them, and ``--check-env`` parses them strictly."""
    factors = manifest.stamp.get("factors")
    return factors if isinstance(factors, Mapping) else {}


def tune_scoped_files(manifest: Manifest) -> list[str]:
    """The generation's files that hold tuning results, valid for one GPU product only.

    By name (``TUNE_SUFFIXES`` anywhere, ``TUNE_PREFIXES`` under files/) and as the warm
    report declares them (a warmer's ``tactics.file``, as the flashinfer warmer writes it).
    """
    declared: set[str] = set()
    warmers = manifest.report.get("warmers")
    for report in warmers if isinstance(warmers, list) else ():
        tactics = report.get("tactics") if isinstance(report, Mapping) else None
        if isinstance(tactics, Mapping) and isinstance(tactics.get("file"), str):
            declared.add(tactics["file"])
    return [
        e.path
        for e in manifest.files
        if e.path in declared or e.path.endswith(TUNE_SUFFIXES) or e.path.startswith(TUNE_PREFIXES)
    ]


def _product_slug(product: str) -> str:
    """nvidia-smi says "NVIDIA H200", GFD labels say "NVIDIA-H200": one product."""
    return re.sub(r"[^a-z0-9]+", "-", product.lower()).strip("-")


def _tuning_to_drop(manifest: Manifest, node: NodeInfo, policy: str) -> tuple[list[str], str]:
    """Tuning files that are not this node's product's, and the line that says why.

    Tuning from another product, or for a node whose product is unknown, is refused
    (strict) or dropped (permissive); the compiled kernels stay valid for the arch.
    """
    tuned = tune_scoped_files(manifest)
    if not tuned:
        return [], ""
    built = _factors(manifest).get("gpu_product")
    if built and node.product and _product_slug(built) == _product_slug(node.product):
        return [], ""
    if node.product:
        shown, where = node.product, f"node, from {node.product_source}"
    else:
        shown, where = "(unknown)", "no node product from --gpu-product, labels or nvidia-smi"
    diff = stamps.FactorDiff("gpu_product", built, shown).describe()
    what = f"{len(tuned)} tuning file{'s' if len(tuned) != 1 else ''}, e.g. {tuned[0]}"
    if policy == "strict":
        raise StampMismatchError(
            f"stamp mismatch: {diff} ({where}; {what}; --policy permissive drops them)"
        )
    return tuned, f"{diff} ({where}): dropped {what} (policy permissive)"


def _built_arch(manifest: Manifest, key: str) -> str:
    """The arch the stamp was computed for, which must be the key's arch.

    ``store.verify`` has checked that the manifest names this key; the stamp's arch must
    agree with it (an arch the stamp does not record is not taken from the key: the
    generation is then not bound to an arch at all).
    """
    built = _factors(manifest).get("arch")
    key_arch = key.rsplit("/", 1)[-1]
    if not built:
        raise StampMismatchError(
            f"{key}: generation {manifest.generation} has no arch in its stamp (written by an "
            "older kernelcache): rebuild it (kernelcache build --force)"
        )
    if built != key_arch:
        raise _mismatch("arch", built, key_arch, f"the arch of key {key}")
    return built


def _check_stamp(manifest: Manifest, key: str, node: NodeInfo, options: Options) -> None:
    """Refuse a generation built for another arch, image, package or environment."""
    factors = _factors(manifest)
    built_arch = _built_arch(manifest, key)
    if node.arch is not None and built_arch != node.arch:
        raise _mismatch("arch", built_arch, node.arch, f"node, from {node.arch_source}")
    if options.expect_image is not None:
        built_image = factors.get(ENGINE_IMAGE_FACTOR)
        why = "--expect-image"
        try:
            matches = built_image is not None and same_image(built_image, options.expect_image)
        except InvalidImageReference as exc:
            matches, why = False, f"--expect-image: {exc}"
        if not matches:
            raise _mismatch(ENGINE_IMAGE_FACTOR, built_image, options.expect_image, why)
    for name, expected in options.expect_factors.items():
        if factors.get(name) != expected:
            raise _mismatch(name, factors.get(name), expected, "--expect-factor")
    if options.check_env:
        from kernelcache.build import check_environment

        check_environment(manifest, node.arch or built_arch)


# --------------------------------------------------------------------------- run


@dataclass(frozen=True)
class Options:
    """What ``kernelcache verify`` was asked to do (one field per command-line option)."""

    store: Path
    key: str | None = None  # NAMESPACE/NAME/ARCH; else namespace + name + this node's arch
    namespace: str | None = None
    name: str | None = None
    arch: str | None = None
    gpu_product: str | None = None
    node_name: str | None = None
    node_map: Path | None = None  # the node map's directory; else KERNELCACHE_NODE_MAP
    expect_image: str | None = None
    expect_factors: Mapping[str, str] = field(default_factory=dict)
    check_env: bool = False
    policy: str = "strict"
    public_key: Path | None = None
    require_signature: bool = False
    materialize: Path | None = None
    workers: int | None = None


@dataclass
class Outcome:
    """A verified (and perhaps materialized) generation; ``summary`` is the success line."""

    key: str
    manifest: Manifest
    node: NodeInfo
    arch: str
    bytes_checked: int
    verify_seconds: float
    materialized: Path | None = None
    materialize_seconds: float = 0.0
    dropped: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    vllm_files: int = 0  # copied to the vLLM cache root the generation was built at

    @property
    def summary(self) -> str:
        head = f"{self.key}: generation {self.manifest.generation} verified: "
        if self.materialized is None:
            return (
                f"{head}{len(self.manifest.files)} files, {self.bytes_checked / 1e6:.1f} MB in "
                f"{self.verify_seconds:.2f} s"
            )
        # The digests were checked on the bytes as they were copied.
        seconds = self.verify_seconds + self.materialize_seconds
        return (
            f"{head}{len(self.manifest.files)} files, {self.manifest.total_bytes / 1e6:.1f} MB "
            f"checked and materialized at {self.materialized} in {seconds:.2f} s"
        )


def run(
    options: Options,
    *,
    env: Mapping[str, str] | None = None,
    label_reader: LabelReader | None = None,
) -> Outcome:
    """Verify the generation for this node and materialize it; raise on any failure."""
    if options.policy not in POLICIES:
        raise SpecError(f"--policy {options.policy!r}: expected one of {', '.join(POLICIES)}")
    if not options.key and not (options.namespace and options.name):
        raise SpecError("verify: give --key NAMESPACE/NAME/ARCH, or --namespace and --name")
    # Absolute: the serving container reads KERNELCACHE_DIR from another working directory.
    target = options.materialize.absolute() if options.materialize is not None else None
    if target is not None:
        _remove_commit_files(target)
    public_key = None
    if options.public_key is not None:
        public_key = load_public_key(options.public_key)
    elif options.require_signature:
        raise SignatureError("--require-signature: no --public-key to check the signature with")

    node = discover_node(
        arch=options.arch,
        gpu_product=options.gpu_product,
        node_name=options.node_name,
        env=env,
        label_reader=label_reader
        or (nodemap.reader(options.node_map) if options.node_map is not None else None),
    )
    key, arch = _key_and_arch(options, node)
    store = Store(options.store)
    check_store_root(store.root)
    gen_dir = store.current(key)
    if gen_dir is None:
        built = _built_arches(store, key)
        raise MissingGenerationError(
            f"{key}: no published generation in {store.root} "
            f"(arches built: {', '.join(built) if built else 'none'})",
            path=str(store.key_dir(key)),
        )

    # Materializing checks every digest of the bytes it copies, so verify skips them then;
    # not when an earlier run's copy is there, which materialize would return as it is.
    copied = target is not None and (target / gen_dir.name / COMPLETE_MARKER).is_file()
    result = verify(
        gen_dir,
        key=key,
        public_key=public_key,
        require_signature=options.require_signature,
        workers=options.workers,
        digests=target is None or copied,
    )
    result.raise_for_problems()
    manifest = result.manifest
    assert manifest is not None  # verify reports a problem whenever it has no manifest
    vllm_root.check_env_root(manifest, os.environ if env is None else env)
    _check_stamp(manifest, key, node, options)
    dropped, warning = _tuning_to_drop(manifest, node, options.policy)
    outcome = Outcome(
        key=key,
        manifest=manifest,
        node=node,
        arch=arch,
        bytes_checked=result.bytes_checked,
        verify_seconds=result.seconds,
        dropped=dropped,
        warnings=[warning] if warning else [],
    )
    if target is not None:
        started = time.monotonic()
        outcome.materialized = _materialize(gen_dir, manifest, target, dropped, options.workers)
        if (root := vllm_root.recorded_root(manifest)) is not None:
            outcome.vllm_files = vllm_root.place(outcome.materialized, manifest, root, dropped)
        outcome.materialize_seconds = time.monotonic() - started
        _write_commit_files(target, options.policy, outcome)
    return outcome


def _key_and_arch(options: Options, node: NodeInfo) -> tuple[str, str]:
    """The key to read and the arch it is for. An explicit key names its arch (then a node
    arch, when found, is still checked against the stamp); namespace/name need the node's."""
    if options.key:
        return options.key, node.arch or options.key.rsplit("/", 1)[-1]
    if node.arch is None:
        raise NoGpuInfoError(f"cannot determine this node's GPU arch: {'; '.join(node.tried)}")
    return f"{options.namespace}/{options.name}/{node.arch}", node.arch


def check_store_root(root: Path) -> None:
    """A store root that is missing or cannot be listed (not a directory, permissions) is
    an I/O failure, not an absent generation: say so rather than "nothing published". A
    store that was never written to is an empty directory (a fresh volume), not no path."""
    try:
        with os.scandir(root):
            pass
    except FileNotFoundError as exc:
        raise StorageError(f"{root}: store does not exist", path=str(root)) from exc
    except OSError as exc:
        raise StorageError(
            f"{root}: store not readable: {_one_line(exc.strerror)}", path=str(root)
        ) from exc


def _built_arches(store: Store, key: str) -> list[str]:
    """The arches of the key's KernelCache that do have a generation, for the message."""
    parent = store.key_dir(key).parent
    try:
        with os.scandir(parent) as entries:
            return sorted(e.name for e in entries if (Path(e.path) / CURRENT_NAME).is_file())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StorageError(f"{parent}: {_one_line(exc.strerror)}", path=str(parent)) from exc


# --------------------------------------------------------------------------- the target


def _materialize(
    gen_dir: Path, manifest: Manifest, target: Path, dropped: list[str], workers: int | None
) -> Path:
    """``store.materialize``; with tuning to drop, into a hidden staging dir first.

    The copy without the dropped files is renamed into place as ``<generation>-untuned`` only
    when complete, so it is never mistaken for (or reused as) the full copy, and a failure
    leaves only the hidden staging dir, which is removed.
    """
    if not dropped:
        return materialize(gen_dir, manifest, target, workers=workers, durable=False)
    staging = target / f".staging-{secrets.token_hex(4)}"
    final = target / f"{manifest.generation}-untuned"
    try:
        copy = materialize(gen_dir, manifest, staging, workers=workers, durable=False)
        with io_errors(copy):
            for rel in dropped:
                (copy / FILES_DIR / rel).unlink()
            if final.exists():  # an earlier run's copy: replace it whole
                shutil.rmtree(final)
            os.rename(copy, final)
            fsync_dir(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _env_lines(policy: str, outcome: Outcome) -> list[str]:
    """Shell-quoted NAME=value lines (a product name has spaces): ``set -a; . FILE`` reads
    them, and so does any reader that unquotes POSIX shell words."""
    node, manifest = outcome.node, outcome.manifest
    values = {
        "KERNELCACHE_DIR": str(outcome.materialized),
        "KERNELCACHE_NAME": outcome.key.rsplit("/", 1)[0],
        "KERNELCACHE_ARCH": outcome.arch,
        "KERNELCACHE_GPU_PRODUCT": node.product or "",
        "KERNELCACHE_GENERATION": manifest.generation,
        "KERNELCACHE_STAMP": str(manifest.stamp.get("digest", "")),
        "KERNELCACHE_POLICY": policy,
        "KERNELCACHE_TUNING_DROPPED": str(len(outcome.dropped)),
    }
    return [f"{name}={shlex.quote(value)}" for name, value in values.items()]


def _write_commit_files(target: Path, policy: str, outcome: Outcome) -> None:
    """The report, then the env file: the env file is what says the target is ready."""
    node = outcome.node
    report = {
        "key": outcome.key,
        "generation": outcome.manifest.generation,
        "stamp": outcome.manifest.stamp.get("digest"),
        "dir": str(outcome.materialized),
        "arch": outcome.arch,
        "arch_source": node.arch_source or "key",
        "gpu_product": node.product,
        "gpu_product_source": node.product_source,
        "policy": policy,
        "tuning_dropped": len(outcome.dropped),
        "dropped_files": outcome.dropped,
        "files": len(outcome.manifest.files) - len(outcome.dropped),
        "bytes_checked": outcome.bytes_checked,
        "verify_seconds": round(outcome.verify_seconds, 3),
        "materialize_seconds": round(outcome.materialize_seconds, 3),
    }
    if (root := vllm_root.recorded_root(outcome.manifest)) is not None:
        report.update(vllm_cache_root=str(root), vllm_files=outcome.vllm_files)
    _write_atomic(target / REPORT_FILE, (json.dumps(report, indent=1) + "\n").encode())
    _write_atomic(target / ENV_FILE, ("\n".join(_env_lines(policy, outcome)) + "\n").encode())


def _remove_commit_files(target: Path) -> None:
    """Forget an earlier run's env file first: if this run fails, nothing says "ready"."""
    for name in (ENV_FILE, REPORT_FILE):
        try:
            (target / name).unlink()
        except FileNotFoundError:
            continue
        except NotADirectoryError as exc:
            raise StorageError(f"{target}: not a directory", path=str(target)) from exc
        except OSError as exc:
            raise StorageError(
                f"{target / name}: cannot remove: {_one_line(exc.strerror)}",
                path=str(target / name),
            ) from exc


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace path with data in one rename, durable before this returns."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    try:
        write_file_synced(tmp, data)
        with io_errors(path):
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


# --------------------------------------------------------------------------- reporting


def _one_line(text: object) -> str:
    return one_line(text)  # a file name in the store may hold escapes: never print them


def error_line(exc: BaseException) -> str:
    """The line ``kernelcache`` prints for a failure (``cli.main`` prints the same text)."""
    if isinstance(exc, KernelCacheError):
        return f"kernelcache: error: {_one_line(exc.message)}"
    return f"kernelcache: internal error: {type(exc).__name__}: {_one_line(exc)}"


def default_termination_log() -> Path | None:
    """Kubernetes' termination message file, when this process runs in a container."""
    if TERMINATION_LOG.exists() and os.access(TERMINATION_LOG, os.W_OK):
        return TERMINATION_LOG
    return None


def write_termination_log(path: Path | None, line: str) -> None:
    """Leave the failure where ``kubectl describe pod`` shows it. Best effort: a log that
    cannot be written must not hide the failure being reported."""
    if path is None:
        return
    data = (line + "\n").encode()[:_TERMINATION_LIMIT]
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError:
        pass
