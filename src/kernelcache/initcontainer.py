"""The init-container: pick this node's generation, check it, copy it out, or refuse the pod.

``kernelcache verify`` runs this before a serving pod starts. In order:

1. **This node**: its SM arch and GPU product (``node.discover_node``).
2. **The generation** that CURRENT names for ``<namespace>/<name>/<arch>`` on the read-only
   store (or an explicit ``--key``).
3. **Integrity and signature**: ``store.verify`` (every digest, in parallel; nothing unlisted;
   no symlink, hard link or path out of the generation, nothing only root can read; the
   manifest published for this very key under this directory's name; the ed25519 signature
   when a key is given or one is required).
4. **The stamp against the pod**: the node's arch, the engine image and any factor the pod
   declares, this environment (``--check-env``, when the init-container runs in the serving
   image), and the GPU product for autotune results (``--policy``; ``stamp_policy``).
5. **Materialize** into the pod's emptyDir with every byte hashed as it is copied, the
   manifest and signature written from the bytes checked in 3 (an earlier run's copy is never
   reused: the copy is made afresh; from an image volume, the files of toolchains that only
   read them are not copied but digested on the mount and used there,
   ``KERNELCACHE_IN_PLACE_DIR``), let each toolchain place or refuse the copy
   (``Toolchain.place``: vLLM's cache to the absolute root it was built at, FlashInfer's
   modules checked against the warm's), and write ``kernelcache.env`` (what the serving
   container reads, ``envfile``) last, atomically.

Fail closed: every failure raises a ``KernelCacheError`` subclass whose one-line message
names the factor or file, and the target directory then holds nothing that looks valid: the
env file is removed first and only written after everything else succeeded, and a copy is
renamed into place only when complete (``store.materialize``).

Nothing here imports torch, a DSL or the Kubernetes client: the init-container image is slim
and needs no API access. Toolchains are reached through their hooks (``Toolchain.check_pod``,
``Toolchain.place``), never by name.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kernelcache import contract, envfile, nodemap
from kernelcache.contract import LOCAL_DAMAGED, POLICIES, CacheKey
from kernelcache.errors import (
    IntegrityError,
    MissingGenerationError,
    NoGpuInfoError,
    SignatureError,
    SpecError,
    StampMismatchError,
    StorageError,
    error_line,
    one_line,
)
from kernelcache.node import LabelReader, NodeInfo, discover_node
from kernelcache.stamp_policy import check_image, check_stamp, tuning_to_drop

# The store's private write helpers too: one-line StorageErrors naming path and errno, and
# files made durable the way the store makes its own.
from kernelcache.store import (
    CURRENT_NAME,
    Manifest,
    Store,
    claimed,
    load_public_keys,
    materialize,
    prefetched,
    verified,
)
from kernelcache.toolchains import in_place_dirs, toolchains

__all__ = [
    "Options",
    "Outcome",
    "check_store_root",
    "default_termination_log",
    "error_line",
    "run",
    "write_termination_log",
]

TERMINATION_LOG = Path("/dev/termination-log")
# Where ``--pull`` lands the artifact in the target before the copy (removed after it).
_PULLED = ".pulled"
# Kubernetes keeps at most 4096 bytes of a termination message.
_TERMINATION_LIMIT = 4096


# --------------------------------------------------------------------------- run


@dataclass(frozen=True)
class Options:
    """What ``kernelcache verify`` was asked to do (one field per command-line option)."""

    store: Path | None = None  # the shared store; None when an artifact or pull is the source
    key: str | None = None  # NAMESPACE/NAME/ARCH; else namespace + name + this node's arch
    namespace: str | None = None
    name: str | None = None
    arch: str | None = None
    gpu_product: str | None = None
    node_name: str | None = None
    node_map: Path | None = None  # the node map's directory; else $KERNELCACHE_NODE_MAP
    expect_image: str | None = None
    expect_factors: Mapping[str, str] = field(default_factory=dict)
    check_env: bool = False
    policy: str = "strict"
    public_key: Path | None = None
    require_signature: bool = False
    materialize: Path | None = None
    workers: int | None = None
    # Where the generation comes from instead of the store, per arch (docs/distribution.md):
    pull: Mapping[str, str] = field(default_factory=dict)  # repo@sha256:..., pulled
    artifacts: Mapping[str, Path] = field(default_factory=dict)  # an image volume's mount
    registry_auth: Path | None = None
    registry_ca: Path | None = None
    plain_http: bool = False  # the registry speaks plain HTTP (loopback or allowed hosts)
    local: Path | None = None  # the node's prefetched copies (store.prefetched), tried first
    want: Mapping[str, str] = field(default_factory=dict)  # per arch, the token a copy needs
    local_wait_seconds: float = 0.0
    local_only: bool = False


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
    placed: dict[str, Any] = field(default_factory=dict)  # the toolchains' (Toolchain.place)
    in_place: Path | None = None  # the checked mount the files not copied are used from
    in_place_files: int = 0
    source: str = "store"  # store | local (the node's prefetched copy) | artifact | pull
    waited_seconds: float = 0.0  # for the node's copy to land
    local_damaged: str | None = None  # the node's copy did not verify: why (its source used)

    @property
    def summary(self) -> str:
        head = f"{self.key}: generation {self.manifest.generation} verified: "
        if self.materialized is None:
            return (
                f"{head}{len(self.manifest.files)} files, {self.bytes_checked / 1e6:.1f} MB in "
                f"{self.verify_seconds:.2f} s"
            )
        # The digests were checked on the bytes as they were copied, or on the mount.
        seconds = self.verify_seconds + self.materialize_seconds
        source = {
            "store": "",
            "local": f" from this node's prefetched copy (waited {self.waited_seconds:.1f} s)",
            "artifact": " from its image volume",
            "pull": " pulled by digest",
        }[self.source]
        where = f" and materialized at {self.materialized}"
        if self.in_place_files:
            where = (
                f", {self.copied} copied to {self.materialized} and {self.in_place_files} "
                "read in place"
            )
        return (
            f"{head}{len(self.manifest.files)} files, {self.manifest.total_bytes / 1e6:.1f} MB "
            f"checked{where}{source} in {seconds:.2f} s"
        )

    @property
    def copied(self) -> int:
        return len(self.manifest.files) - len(self.dropped) - self.in_place_files


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
    with ExitStack() as held:
        if target is not None:
            sources = [p for p in (options.store, options.local) if p is not None]
            held.enter_context(claimed(target, (*envfile.TEMPORARY, _PULLED), sources))
            envfile.remove(target)
        return _run(options, target, env, label_reader)


def _run(
    options: Options,
    target: Path | None,
    env: Mapping[str, str] | None,
    label_reader: LabelReader | None,
) -> Outcome:
    public_key = None
    if options.public_key is not None:
        public_key = load_public_keys(options.public_key)
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
    found = _Found()
    try:
        with _located(options, key, arch, target, found) as (gen_dir, bound_key):
            return _verify_and_materialize(
                options, gen_dir, bound_key, arch, node, target, env, public_key, found
            )
    except (IntegrityError, SignatureError) as exc:
        if found.source != "local" or options.local_only:
            raise
        damaged = f"{key}: {LOCAL_DAMAGED} ({exc.message}): read from its source instead"
    # The node's copy rotted on its disk: the pod starts from the copy's source, checked
    # the same way, and says so (the operator reads it into status.nodes).
    found = _Found(notes=[damaged], local_damaged=damaged)
    with _located(replace(options, local=None), key, arch, target, found) as (gen_dir, bound):
        return _verify_and_materialize(
            options, gen_dir, bound, arch, node, target, env, public_key, found
        )


def _verify_and_materialize(
    options: Options,
    gen_dir: Path,
    key: str | None,
    arch: str,
    node: NodeInfo,
    target: Path | None,
    env: Mapping[str, str] | None,
    public_key: Any,
    found: _Found,
) -> Outcome:
    """Steps 3 to 5 on the generation found. ``key`` None: an artifact, whose manifest names
    the key it was built for (another cluster's, perhaps); it must be of this node's arch.
    From an image volume (read-only, immutable for the pod's life) the toolchains that only
    read their files use them on the mount (``toolchains.in_place_dirs``): those are not
    copied, and verify digests them there."""
    readable = in_place_dirs() if found.source == "artifact" and target is not None else set()

    def used_in_place(path: str) -> bool:
        return path.partition("/")[0] in readable

    # Materializing hashes every byte it copies, so verify digests only what it does not copy.
    result, manifest = verified(
        gen_dir,
        key=key,
        public_key=public_key,
        require_signature=options.require_signature,
        workers=options.workers,
        digests=True if target is None else used_in_place,
    )
    if key is None:
        key = manifest.key
        if CacheKey.parse(key).arch != arch:
            raise IntegrityError(
                f"{gen_dir}: the artifact was built for {key}, not for this node's arch {arch}",
                path=str(gen_dir),
            )
    for toolchain in toolchains():
        toolchain.check_pod(manifest, os.environ if env is None else env)
    check_stamp(
        manifest,
        key,
        node,
        expect_image=options.expect_image,
        expect_factors=options.expect_factors,
        check_env=options.check_env,
    )
    # what the stamp check passed but cannot judge (kernels keyed by what they trace to)
    untold = [n for t in toolchains() if options.check_env and (n := t.unchecked(manifest))]
    dropped, warning = tuning_to_drop(manifest, node, options.policy)
    outcome = Outcome(
        key=key,
        manifest=manifest,
        node=node,
        arch=arch,
        bytes_checked=result.bytes_checked,
        verify_seconds=result.seconds,
        dropped=dropped,
        warnings=[*found.notes, *untold, *([warning] if warning else [])],
        source=found.source,
        waited_seconds=found.waited_seconds,
        local_damaged=found.local_damaged,
    )
    if target is not None:
        started = time.monotonic()
        leave = [e.path for e in manifest.files if used_in_place(e.path)]
        if any(used_in_place(path) for path in dropped):
            leave = []  # a mount cannot leave out a dropped file: copy it all (every byte hashed)
        if leave:
            outcome.in_place, outcome.in_place_files = gen_dir.absolute(), len(leave)
        outcome.materialized = materialize(
            result, target, workers=options.workers, durable=False, drop=dropped, leave=leave
        )
        for toolchain in toolchains():
            outcome.placed.update(toolchain.place(outcome.materialized, manifest, dropped))
        outcome.materialize_seconds = time.monotonic() - started
        _commit(target, options.policy, outcome)
    return outcome


# --------------------------------------------------------------------------- the source


@dataclass
class _Found:
    """Where ``_located`` found the generation, for the summary and the report."""

    source: str = "store"
    waited_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    local_damaged: str | None = None  # why the node's copy was passed over


@contextmanager
def _located(
    options: Options, key: str, arch: str, target: Path | None, found_at: _Found
) -> Iterator[tuple[Path, str | None]]:
    """The generation directory for this node and the key to bind it to (None: the
    artifact's own), held while it is read: the node's prefetched copy first (locked against
    eviction), else the arch's image volume, its pull, or the store."""
    if options.local is not None and (token := options.want.get(arch)):
        started = time.monotonic()
        found = _wait_for_local(options.local, key, token, options.local_wait_seconds)
        found_at.waited_seconds = time.monotonic() - started
        if found is not None:
            with prefetched.reading(found.gen_dir(options.local)) as there:
                if there:
                    found_at.source = "local"
                    yield found.gen_dir(options.local), found.key
                    return
        waited = f"after {options.local_wait_seconds:g} s" if options.local_wait_seconds else "yet"
        missing = f"{key}: no prefetched copy of {token} on this node {waited}"
        if options.local_only:
            raise MissingGenerationError(
                f"{missing} (local only)", path=str(prefetched.wanted_path(options.local, key))
            )
        found_at.notes.append(f"{missing}: reading it from its source instead")
    if arch in options.artifacts:
        found_at.source = "artifact"
        yield options.artifacts[arch], None
    elif arch in options.pull:
        found_at.source = "pull"
        with _pulled(options, options.pull[arch], target) as gen_dir:
            yield gen_dir, None
    elif options.store is not None:
        yield _from_store(options.store, key, options.expect_image), key
    else:
        sources = sorted({*options.artifacts, *options.pull})
        raise MissingGenerationError(
            f"{key}: no artifact for this node's arch {arch} "
            f"(arches with one: {', '.join(sources) if sources else 'none'})"
        )


def _wait_for_local(root: Path, key: str, token: str, seconds: float) -> prefetched.Wanted | None:
    """The node's copy for ``token``, waiting up to ``seconds`` for the prefetch to land it."""
    deadline = time.monotonic() + seconds
    while (found := prefetched.find(root, key, token)) is None and time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    return found


@contextmanager
def _pulled(options: Options, ref: str, target: Path | None) -> Iterator[Path]:
    """Pull ``ref`` (verified in full on the way in) into a store beside the copy; removed
    once the copy is made, so the pod's volume holds the generation once."""
    from kernelcache.distribution import pull

    if target is None:
        raise SpecError("--pull needs --materialize: the artifact is pulled beside the copy")
    scratch = target / _PULLED
    try:
        result = pull(
            ref,
            scratch,
            auth=options.registry_auth,
            ca_file=options.registry_ca,
            plain_http=options.plain_http,
            public_key=options.public_key,
            require_signature=options.require_signature,
        )
        yield result.gen_dir
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _from_store(root: Path, key: str, image: str | None = None) -> Path:
    """The generation CURRENT names; with ``image``, the one built for it: CURRENT's, else
    the most recently current of the kept generations that was (a pod on the previous image
    while a new one builds or just published: the store keeps the last generations)."""
    store = Store(root)
    check_store_root(store.root)
    gen_dir = store.current(key)
    if gen_dir is None:
        built = _built_arches(store, key)
        raise MissingGenerationError(
            f"{key}: no published generation in {store.root} "
            f"(arches built: {', '.join(built) if built else 'none'})",
            path=str(store.key_dir(key)),
        )
    if image is None:
        return gen_dir
    current = store.manifest(gen_dir)
    if current is None:
        return gen_dir  # verify names what is wrong with it
    try:
        check_image(current, image)
        return gen_dir
    except StampMismatchError as exc:
        refused = exc
    kept = store.rollback_order(key)
    for path, manifest in kept:
        if manifest is None:
            continue
        try:
            check_image(manifest, image)
        except StampMismatchError:
            continue
        return path
    if not kept:
        others = "and no other generation is kept"
    elif len(kept) == 1:
        others = "the one generation kept besides it was not built for it either"
    else:
        others = f"none of the {len(kept)} generations kept besides it was built for it either"
    raise StampMismatchError(
        f"{refused}; CURRENT is {gen_dir.name}, {others} (a new image's generation is "
        "published when its compile Job ends: a pod with restartPolicy Always or OnFailure "
        "retries this init-container until then; one with Never must be created again)",
        factor=refused.factor,
        path=str(gen_dir),
    )


def _key_and_arch(options: Options, node: NodeInfo) -> tuple[str, str]:
    """The key to read and the arch it is for. An explicit key names its arch (then a node
    arch, when found, is still checked against the stamp); namespace/name need the node's."""
    if options.key:
        return options.key, node.arch or CacheKey.parse(options.key).arch
    if node.arch is None:
        raise NoGpuInfoError(f"cannot determine this node's GPU arch: {'; '.join(node.tried)}")
    return str(CacheKey(str(options.namespace), str(options.name), node.arch)), node.arch


def check_store_root(root: Path) -> None:
    """A store root that is missing or cannot be listed (not a directory, permissions), or a
    directory that is not a store (a typo'd path that exists), is an I/O failure, not an
    absent generation or an empty store: say so rather than "nothing published". A store
    that was never written to is an empty directory (a fresh volume), not no path."""
    try:
        with os.scandir(root):
            pass
    except FileNotFoundError as exc:
        raise StorageError(f"{root}: store does not exist", path=str(root)) from exc
    except OSError as exc:
        raise StorageError(
            f"{root}: store not readable: {_one_line(exc.strerror)}", path=str(root)
        ) from exc
    if foreign := Store(root).foreign_entries():
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise StorageError(
            f"{root}: not a store: no NAMESPACE/NAME/ARCH key in it, and it holds "
            f"{', '.join(foreign[:3])}{more}",
            path=str(root),
        )


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


def _commit(target: Path, policy: str, outcome: Outcome) -> None:
    """The report and the env file, which the serving container reads (``envfile``)."""
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
        "files_copied": outcome.copied,
        "files_in_place": outcome.in_place_files,
        "in_place_dir": str(outcome.in_place) if outcome.in_place is not None else None,
        "bytes_checked": outcome.bytes_checked,
        "verify_seconds": round(outcome.verify_seconds, 3),
        "materialize_seconds": round(outcome.materialize_seconds, 3),
        "source": outcome.source,
        "waited_seconds": round(outcome.waited_seconds, 3),
    }
    report.update(outcome.placed)
    values: dict[contract.Variable[Any], str] = {
        contract.DIR: str(outcome.materialized),
        contract.NAME: CacheKey.parse(outcome.key).cache,
        contract.ARCH: outcome.arch,
    }
    if outcome.in_place is not None:
        values[contract.IN_PLACE_DIR] = str(outcome.in_place)
    envfile.write(target, values, report)


# --------------------------------------------------------------------------- reporting


def _one_line(text: object) -> str:
    return one_line(text)  # a file name in the store may hold escapes: never print them


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
