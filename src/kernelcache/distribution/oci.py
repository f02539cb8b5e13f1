"""Push a generation to a registry, and pull one by digest into a store, verified in full.

Push: the generation is verified first (nothing damaged leaves the store), each layer is
built as a deterministic tar (the same subtree makes the same blob, so an unchanged
toolchain's layer is not uploaded again), uploaded unless the registry has it, then the
config and the manifest; with a signing key, the signature goes under cosign's tag scheme.

Pull, in the order that refuses cheapest first: the manifest's bytes must hash to the digest
asked for; with a public key (or ``require_signature``) the signature tag must hold a
signature of that digest by that key; the metadata layer (MANIFEST.json and its signature)
is fetched and checked against the annotations and the key before any file is; every layer
is then streamed into a staging directory of the store's writer, hashed as it arrives
(sha256 against its descriptor, each file's blake3 against MANIFEST.json, every tar entry a
regular file or directory inside its layer's subtree), and only a generation that verifies
whole is renamed into place and made CURRENT. A failure or a crash anywhere leaves the store
as it was.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kernelcache import contract
from kernelcache.contract import CacheKey
from kernelcache.distribution import artifact
from kernelcache.distribution.artifact import Descriptor, ImageManifest
from kernelcache.distribution.auth import AuthLike
from kernelcache.distribution.reference import Reference
from kernelcache.distribution.registry import Client
from kernelcache.distribution.tarstream import Content, read_layer, too_long
from kernelcache.errors import (
    IntegrityError,
    ManifestError,
    MissingGenerationError,
    SignatureError,
    SpecError,
)
from kernelcache.store.digests import FileEntry
from kernelcache.store.fs import (
    io_errors,
    make_dirs,
    parallel,
    read_regular,
    shareable_mode,
    sync_filesystem,
    write_all,
    write_file_synced,
)
from kernelcache.store.layout import FILES_DIR, MANIFEST_NAME, SIGNATURE_NAME, key_problem
from kernelcache.store.manifest import Manifest
from kernelcache.store.signing import (
    PrivateKeyLike,
    PublicKeyLike,
    private_key,
    public_keys,
    signature_bytes,
    signer,
)
from kernelcache.store.verification import verified, verify
from kernelcache.store.writer import Store

# The small blobs (config, MANIFEST.json's layer, a signature payload) are read whole; more
# than this is not one of ours.
# The public keys a puller trusts: several while a signing key is rotated.
Trusted = tuple[Ed25519PublicKey, ...]

_SMALL_BLOB = 64 << 20
_READ = 1 << 20
# Pulled bytes between two syncs of the store's filesystem while more arrive (``_Flusher``).
_FLUSH_EVERY = 128 << 20
# A pulled file is new (two entries of one name are refused), and never through a symlink.
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class PushResult:
    ref_digest: str  # registry/repository@sha256:<hex>: what a puller names
    digest: str  # sha256:<hex> of the image manifest
    tag: str  # the tag the manifest was pushed under
    key: str
    generation: str
    signed: bool  # a signature was pushed (tag sha256-<hex>.sig)
    layers: int
    bytes: int  # the layers' size, as stored in the registry
    uploaded: int  # of which the registry did not hold already


@dataclass(frozen=True)
class PullResult:
    ref_digest: str
    key: str
    generation: str
    gen_dir: Path  # the generation's directory in the store (CURRENT names it)
    files: int
    bytes: int
    signature_verified: bool
    seconds: float


def push(
    store: str | os.PathLike[str],
    key: CacheKey | str,
    ref: str,
    *,
    generation: str | None = None,
    auth: AuthLike = None,
    ca_file: str | os.PathLike[str] | None = None,
    plain_http: bool = False,
    signing_key: PrivateKeyLike | None = None,
    gzip: bool = False,
    workers: int | None = None,
) -> PushResult:
    """Push the key's current generation (or ``generation``) to ``ref``
    (``registry/repository[:tag]``; the tag defaults to the generation id).

    The generation must verify (every file against its manifest: nothing damaged leaves the
    store). With ``signing_key`` the metadata layer carries MANIFEST.json's signature by that
    key and the manifest digest is signed under cosign's tag scheme; without, the
    generation's own signature, if any, travels as it is. ``ca_file``: the
    CA bundle the registry's certificate must chain to (default: the system's); ``plain_http``:
    speak HTTP to a loopback or allowed registry (``transport.Network``). Failures are
    KernelCacheErrors of their class: a missing generation (3), one that does not verify
    (5–8), a registry unreachable or refusing the credentials (10), a bad reference (2).
    """
    reference = Reference.parse(ref)
    if reference.digest is not None:
        raise SpecError(f"{ref}: push takes REGISTRY/REPOSITORY[:TAG], not a digest")
    gen_dir = _generation_dir(Store(os.fspath(store)), str(key), generation)
    _, manifest = verified(gen_dir, key=str(key), workers=workers)
    signer = private_key(signing_key)
    tag = reference.tag or manifest.generation
    client = Client(reference, auth, ca_file, actions="pull,push", plain_http=plain_http)
    with tempfile.TemporaryDirectory(prefix="kernelcache-push-") as scratch:
        layers = _build_layers(gen_dir, manifest, Path(scratch), signer, gzip, workers)
        config = artifact.image_config(manifest, [layer.diff_id for layer in layers])
        config_path = Path(scratch) / "config.json"
        config_path.write_bytes(config)
        uploads = [(layer.path, layer.descriptor) for layer in layers]
        config_desc = artifact.descriptor_of(config, artifact.CONFIG_MEDIA_TYPE)
        uploads.append((config_path, config_desc))
        uploaded = sum(parallel(lambda u: _upload(client, *u), uploads, workers))
        image = artifact.image_manifest(
            manifest, config_desc, [layer.descriptor for layer in layers]
        )
        client.put_manifest(tag, image, artifact.MANIFEST_MEDIA_TYPE)
        digest = artifact.digest_of(image)
        if signer is not None:
            subject = Descriptor(artifact.MANIFEST_MEDIA_TYPE, digest, len(image))
            _push_signature(client, reference, subject, signer, Path(scratch))
    return PushResult(
        ref_digest=reference.with_digest(digest),
        digest=digest,
        tag=tag,
        key=manifest.key,
        generation=manifest.generation,
        signed=signer is not None,
        layers=len(layers),
        bytes=sum(layer.descriptor.size for layer in layers),
        uploaded=uploaded,
    )


def _generation_dir(store: Store, key: str, generation: str | None) -> Path:
    if generation is None:
        gen_dir = store.current(key)
        if gen_dir is None:
            raise MissingGenerationError(f"{key}: no published generation in {store.root}")
        return gen_dir
    gen_dir = store.key_dir(key) / generation
    if not gen_dir.is_dir() or gen_dir.is_symlink():
        raise MissingGenerationError(f"{key}: no generation {generation} in {store.root}")
    return gen_dir


def _build_layers(
    gen_dir: Path,
    manifest: Manifest,
    scratch: Path,
    signer: Ed25519PrivateKey | None,
    gzip: bool,
    workers: int | None,
) -> list[artifact.BuiltLayer]:
    """The metadata layer (MANIFEST.json, its signature: by ``signer`` when given), then one
    layer per subtree of files/, built in parallel."""
    meta = scratch / "meta"
    meta.mkdir()
    with io_errors(gen_dir):
        data = read_regular(gen_dir / MANIFEST_NAME)
        write_file_synced(meta / MANIFEST_NAME, data)
        if signer is not None:
            write_file_synced(meta / SIGNATURE_NAME, signature_bytes(signer, data))
        elif (gen_dir / SIGNATURE_NAME).is_file():
            write_file_synced(meta / SIGNATURE_NAME, read_regular(gen_dir / SIGNATURE_NAME))
    names = [MANIFEST_NAME]
    if (meta / SIGNATURE_NAME).exists():
        names.append(SIGNATURE_NAME)
    jobs = [(meta, names, artifact.META_LAYER)] + [
        (gen_dir, [f"{FILES_DIR}/{e.path}" for e in entries], subtree)
        for subtree, entries in artifact.layer_subtrees(manifest)
    ]

    def build(job: tuple[int, tuple[Path, list[str], str]]) -> artifact.BuiltLayer:
        index, (root, files, subtree) = job
        return artifact.write_layer(scratch / f"layer-{index}", root, files, subtree, gzip)

    return parallel(build, list(enumerate(jobs)), workers)


def _upload(client: Client, path: Path, descriptor: Descriptor) -> int:
    """Upload one blob unless the registry holds it; the bytes sent."""
    if client.has_blob(descriptor.digest):
        return 0
    client.upload_blob(path, descriptor.digest, descriptor.size)
    return descriptor.size


def _push_signature(
    client: Client,
    reference: Reference,
    subject: Descriptor,
    signer: Ed25519PrivateKey,
    scratch: Path,
) -> None:
    """Sign the manifest digest under cosign's tag scheme (``sha256-<hex>.sig``)."""
    payload = artifact.signature_payload(reference.name, subject.digest)
    signature = base64.b64encode(signer.sign(payload)).decode()
    payload_desc = Descriptor(
        artifact.SIGNATURE_PAYLOAD_TYPE,
        artifact.digest_of(payload),
        len(payload),
        {artifact.SIGNATURE_ANNOTATION: signature},
    )
    config = artifact.canonical_json(
        {
            "architecture": "",
            "os": "",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [payload_desc.digest]},
        }
    )
    config_desc = artifact.descriptor_of(config, artifact.CONFIG_MEDIA_TYPE)
    for name, blob, descriptor in (
        ("payload", payload, payload_desc),
        ("config", config, config_desc),
    ):
        path = scratch / f"signature-{name}"
        path.write_bytes(blob)
        _upload(client, path, descriptor)
    data = artifact.signature_manifest(payload_desc, config_desc, subject)
    client.put_manifest(artifact.signature_tag(subject.digest), data, artifact.MANIFEST_MEDIA_TYPE)


@dataclass(frozen=True)
class Artifact:
    """What an artifact's manifest says, its digest and (with a key) its signature checked;
    no layer fetched. The generation itself is only checked by ``pull``, or by ``verify`` on
    an image volume that mounts it."""

    ref_digest: str
    key: str
    generation: str
    stamp: str  # the stamp digest
    layers: int
    bytes: int  # the layers' size, as stored
    signature_verified: bool


def describe(
    ref: str,
    *,
    auth: AuthLike = None,
    ca_file: str | os.PathLike[str] | None = None,
    plain_http: bool = False,
    public_key: PublicKeyLike | None = None,
) -> Artifact:
    """Read ``ref``'s manifest (by digest), check its bytes against the digest and, with
    ``public_key``, its signature: what a consumer records before it pulls or mounts it (the
    generation id names an image volume's mount, so that ``verify --key`` holds)."""
    reference, _, image, public = _open(ref, auth, ca_file, plain_http, public_key, False)
    assert reference.digest is not None
    return Artifact(
        ref_digest=reference.with_digest(reference.digest),
        key=image.key,
        generation=image.generation,
        stamp=image.stamp,
        layers=len(image.layers),
        bytes=sum(layer.size for layer in image.layers),
        signature_verified=public is not None,
    )


def _open(
    ref: str,
    auth: AuthLike,
    ca_file: str | os.PathLike[str] | None,
    plain_http: bool,
    public_key: PublicKeyLike | None,
    require_signature: bool,
) -> tuple[Reference, Client, ImageManifest, Trusted | None]:
    """The reference (a digest), a client, the manifest checked against the digest and
    (with a key) its signature, and the key to check the generation with."""
    reference = Reference.parse(ref)
    if reference.digest is None:
        raise SpecError(
            f"{ref}: pull takes a digest (REGISTRY/REPOSITORY@sha256:<hex>), not a tag, which "
            "can move: kernelcache push prints the digest"
        )
    digest, name = reference.digest, reference.with_digest(reference.digest)
    public = _public_key(public_key)
    if require_signature and public is None:
        raise SignatureError(f"{name}: a signature is required but no public key was given")
    client = Client(reference, auth, ca_file, plain_http=plain_http)
    data, _ = client.get_manifest(digest, (artifact.MANIFEST_MEDIA_TYPE,))
    if (served := artifact.digest_of(data)) != digest:
        raise IntegrityError(f"{name}: manifest digest mismatch: the registry served {served}")
    image = artifact.parse_image_manifest(data, name)
    if public is not None:
        _check_signature(client, reference, digest, public)
    if (problem := key_problem(image.key)) is not None:
        raise ManifestError(f"{name}: annotation {contract.OCI_ANNOTATION_KEY}: {problem}")
    return reference, client, image, public


def pull(
    ref: str,
    store: str | os.PathLike[str],
    *,
    key: CacheKey | str | None = None,
    auth: AuthLike = None,
    ca_file: str | os.PathLike[str] | None = None,
    plain_http: bool = False,
    public_key: PublicKeyLike | None = None,
    require_signature: bool = False,
    keep: int = 2,
    workers: int | None = None,
) -> PullResult:
    """Pull ``ref`` (``registry/repository@sha256:<hex>``: a digest, never a tag) into the
    store as its key's CURRENT generation.

    ``key``: the artifact must be this key's (else refused, 5); by default the key is the
    one the artifact was published for. ``public_key``: the artifact's signature and its
    MANIFEST.json's must verify with it; ``require_signature`` refuses an unsigned one even
    without a key (6). Every refusal is one line naming the blob, layer or file, with the
    exit code of its class: a digest, size or content mismatch 5, a signature 6, a malformed
    manifest or config 7, a path or link escaping the generation 8, the registry unreachable
    or the store unwritable 10, a tag instead of a digest 2. ``keep``: as ``Writer.publish``.
    When the key's CURRENT generation is already the artifact's and verifies whole, no
    layer is fetched (a node's prefetch pulls the same digest again and again).
    """
    started = time.monotonic()
    reference, client, image, public = _open(
        ref, auth, ca_file, plain_http, public_key, require_signature
    )
    assert reference.digest is not None
    name = reference.with_digest(reference.digest)
    if key is not None and image.key != str(key):
        raise IntegrityError(f"{name}: an artifact of key {image.key}, not of {key}")
    target = Store(os.fspath(store))
    if (here := _already_current(target, image, public, require_signature, workers)) is not None:
        return _result(name, target, here, public, started)
    config = _small_blob(client, image.config, f"{name}: config {image.config.digest}")
    diff_ids = artifact.parse_config(config, f"{name}: config", len(image.layers))
    meta = _read_meta(client, name, image, diff_ids[0], public)
    manifest = Manifest.parse(meta[MANIFEST_NAME], f"{name}: {MANIFEST_NAME}")
    _check_annotations(name, image, manifest)
    with target.writer(image.key) as writer:  # nothing in the store is touched before this
        staging = writer.staging().parent
        for file_name, content in meta.items():
            write_file_synced(staging / file_name, content)
        _unpack_files(client, name, image, manifest, diff_ids, staging, workers)
        adopted = writer.adopt(
            staging,
            public_key=public,
            require_signature=require_signature,
            keep=keep,
            workers=workers,
            digests=False,  # every file's blake3 was checked as it was written
        )
    return _result(name, target, adopted, public, started)


def _result(
    name: str, store: Store, manifest: Manifest, public: Trusted | None, started: float
) -> PullResult:
    """What a pull reports of the generation it left current in ``store``."""
    return PullResult(
        ref_digest=name,
        key=manifest.key,
        generation=manifest.generation,
        gen_dir=store.key_dir(manifest.key) / manifest.generation,
        files=len(manifest.files),
        bytes=manifest.total_bytes,
        signature_verified=public is not None,
        seconds=time.monotonic() - started,
    )


def _already_current(
    store: Store,
    image: ImageManifest,
    public: Trusted | None,
    require_signature: bool,
    workers: int | None,
) -> Manifest | None:
    """The store's CURRENT generation of the key when it is the artifact's and verifies
    whole (with the key, if given): a node pulling what it holds fetches nothing. The
    generation id is its content's address (the stamp's digest and every file's), so the
    same id and stamp are the same generation."""
    current = store.current(image.key)
    if current is None or current.name != image.generation:
        return None
    checked = verify(
        current,
        key=image.key,
        public_key=public,
        require_signature=require_signature,
        workers=workers,
    )
    manifest = checked.manifest
    if not checked.ok or manifest is None or manifest.stamp.get("digest") != image.stamp:
        return None
    return manifest


def _public_key(public_key: PublicKeyLike | None) -> Trusted | None:
    """The trusted keys (several during a key rotation), or None: no signature checked."""
    return None if public_key is None else public_keys(public_key)


def _small_blob(client: Client, descriptor: Descriptor, what: str) -> bytes:
    """A small blob, whole, checked against its descriptor."""
    if descriptor.size > _SMALL_BLOB:
        raise ManifestError(f"{what}: {descriptor.size} bytes: more than one of ours holds")
    with client.blob(descriptor.digest, what) as chunks:
        data = b"".join(_bounded(chunks, descriptor.size, what))
    if len(data) != descriptor.size:
        raise IntegrityError(f"{what}: truncated: {len(data)} of its {descriptor.size} bytes")
    if (served := artifact.digest_of(data)) != descriptor.digest:
        raise IntegrityError(f"{what}: digest mismatch: the registry served {served}")
    return data


def _bounded(chunks: Iterator[bytes], limit: int, what: str) -> Iterator[bytes]:
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise too_long(what, limit)
        yield chunk


def _check_signature(client: Client, reference: Reference, digest: str, public: Trusted) -> None:
    """The manifest digest must be signed by one of ``public`` under cosign's tag scheme."""
    name, tag = reference.with_digest(digest), artifact.signature_tag(digest)
    source = f"{reference.name}:{tag}"
    try:
        data, _ = client.get_manifest(tag, (artifact.MANIFEST_MEDIA_TYPE,))
    except MissingGenerationError:
        raise SignatureError(f"{name}: unsigned: no signature under tag {tag}") from None
    try:
        signatures = artifact.parse_signatures(data, source)
    except ManifestError as exc:
        raise SignatureError(exc.message) from exc
    replayed = None
    for i, (descriptor, encoded) in enumerate(signatures):
        payload = _small_blob(client, descriptor, f"{source}: signature {i}")
        try:
            vouches_for = artifact.payload_digest(payload, f"{source}: signature {i}")
            signature = base64.b64decode(encoded, validate=True)
        except (ManifestError, binascii.Error, ValueError):
            continue
        if not any(_signed_by(key, signature, payload) for key in public):
            continue
        if vouches_for == digest:
            return
        replayed = vouches_for  # by this key, but of another manifest: copied here
    if replayed is not None:
        what = f"signs another artifact ({replayed})"
    elif signatures:
        what = "is not by this public key (signed by another key, or altered)"
    else:
        what = "holds no signature"
    raise SignatureError(f"{name}: the signature under tag {tag} {what}")


def _signed_by(key: Ed25519PublicKey, signature: bytes, payload: bytes) -> bool:
    try:
        key.verify(signature, payload)
    except InvalidSignature:
        return False
    return True


def _read_meta(
    client: Client,
    name: str,
    image: ImageManifest,
    diff_id: str,
    public: Trusted | None,
) -> dict[str, bytes]:
    """The first layer's MANIFEST.json and signature, in memory; with a key, the signature
    must be there and be by it. Checked before anything is written or any file fetched."""
    meta = image.meta_layer
    what = _describe(name, 0, meta)
    if meta.size > _SMALL_BLOB:
        raise ManifestError(f"{what}: {meta.size} bytes: not a layer of {MANIFEST_NAME} alone")
    found: dict[str, bytes] = {}

    def collect(member: tarfile.TarInfo, content: Content | None) -> None:
        if member.name not in artifact.META_FILES or content is None:
            only = " and ".join(artifact.META_FILES)
            raise IntegrityError(f"{what}: holds {member.name!r}, not only {only}")
        if member.name in found:
            raise IntegrityError(f"{what}: {member.name} appears twice")
        found[member.name] = content.read_all()

    _fetch_layer(client, meta, diff_id, what, collect)
    if MANIFEST_NAME not in found:
        raise ManifestError(f"{what}: holds no {MANIFEST_NAME}")
    if public is not None:
        if SIGNATURE_NAME not in found:
            raise SignatureError(f"{what}: holds no {SIGNATURE_NAME}: the generation is unsigned")
        _, mismatch = signer(found[SIGNATURE_NAME], found[MANIFEST_NAME], public)
        if mismatch is not None:
            raise SignatureError(f"{what}: {SIGNATURE_NAME} {mismatch}")
    return found


def _check_annotations(name: str, image: ImageManifest, manifest: Manifest) -> None:
    """What the manifest's annotations say must be what the generation's MANIFEST.json says
    (a puller reads the key from them before any layer; they must not lie)."""
    for annotation, said, actual in (
        (contract.OCI_ANNOTATION_KEY, image.key, manifest.key),
        (contract.OCI_ANNOTATION_GENERATION, image.generation, manifest.generation),
        (contract.OCI_ANNOTATION_STAMP, image.stamp, str(manifest.stamp["digest"])),
    ):
        if said != actual:
            raise IntegrityError(
                f"{name}: annotation {annotation} says {said}; {MANIFEST_NAME} says {actual}"
            )
    expected = [subtree for subtree, _ in artifact.layer_subtrees(manifest)]
    held = [layer.subtree for layer in image.file_layers]
    if held != expected:
        raise IntegrityError(
            f"{name}: its layers hold {', '.join(held) or 'nothing'}; "
            f"{MANIFEST_NAME} lists {', '.join(expected) or 'nothing'}"
        )


def _unpack_files(
    client: Client,
    name: str,
    image: ImageManifest,
    manifest: Manifest,
    diff_ids: list[str],
    staging: Path,
    workers: int | None,
) -> None:
    """Stream the file layers (in parallel) into staging/files/, each file checked as it is
    written; every file MANIFEST.json lists must have come."""
    entries = {f"{FILES_DIR}/{e.path}": e for e in manifest.files}
    make_dirs(staging / FILES_DIR, (e.path for e in manifest.files))
    with _Flusher(staging) as flusher:

        def fetch(item: tuple[int, Descriptor]) -> set[str]:
            index, layer = item
            what = _describe(name, index, layer)
            writer = _FileWriter(staging, layer.subtree, entries, what)
            writer.on_written = flusher.wrote
            _fetch_layer(client, layer, diff_ids[index], what, writer)
            return writer.written

        layers = list(enumerate(image.file_layers, 1))
        written: set[str] = set().union(*parallel(fetch, layers, workers))
    for path in sorted(set(entries) - written):
        raise IntegrityError(f"{name}: {path}: listed in {MANIFEST_NAME}, in no layer")


def _describe(name: str, index: int, layer: Descriptor) -> str:
    return f"{name}: layer {index} ({layer.subtree or '?'}, {layer.digest[:19]}…)"


def _fetch_layer(
    client: Client,
    layer: Descriptor,
    diff_id: str,
    what: str,
    on_entry: Callable[[tarfile.TarInfo, Content | None], None],
) -> None:
    with client.blob(layer.digest, what) as chunks:
        read_layer(chunks, layer, diff_id, what, on_entry)


class _Flusher:
    """Sets the disk writing while the network delivers: after every ``_FLUSH_EVERY`` bytes
    pulled, a sync of the staging's filesystem on a thread of its own (one at a time), so
    that ``Writer.adopt``'s final sync finds little left. Without it the whole generation
    was written out only at the end, after the download, as long again on a busy disk."""

    def __init__(self, path: Path) -> None:
        self.path, self.pending = path, 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._syncs: list[Future[None]] = []

    def wrote(self, size: int) -> None:
        with self._lock:
            self.pending += size
            if self.pending < _FLUSH_EVERY or (self._syncs and not self._syncs[-1].done()):
                return
            self.pending = 0
            self._syncs.append(self._pool.submit(sync_filesystem, self.path))

    def __enter__(self) -> _Flusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)
        for sync in self._syncs:  # a write-back error is reported once, to the one who synced
            sync.result()


class _FileWriter:
    """A file layer: each file of its subtree that MANIFEST.json lists, with its size and
    blake3 checked as it is written (not synced: ``Writer.adopt`` syncs the tree)."""

    def __init__(
        self, staging: Path, subtree: str, entries: dict[str, FileEntry], what: str
    ) -> None:
        self.staging, self.subtree, self.entries, self.what = staging, subtree, entries, what
        self.written: set[str] = set()
        self.on_written: Callable[[int], object] = lambda size: None

    def __call__(self, member: tarfile.TarInfo, content: Content | None) -> None:
        name = member.name
        inside = name == self.subtree or name.startswith(self.subtree + "/")
        if content is None:
            if not (inside or name == FILES_DIR):
                raise IntegrityError(f"{self.what}: {name!r} lies outside {self.subtree}")
            return
        if not inside:
            raise IntegrityError(f"{self.what}: {name!r} lies outside {self.subtree}")
        entry = self.entries.get(name)
        if entry is None:
            raise IntegrityError(f"{self.what}: {name}: not in {MANIFEST_NAME}")
        if name in self.written:
            raise IntegrityError(f"{self.what}: {name}: appears twice")
        if member.size != entry.size:
            raise IntegrityError(
                f"{self.what}: {name}: size {member.size} != {MANIFEST_NAME}'s {entry.size}"
            )
        self.written.add(name)
        path = self.staging / name
        hasher = blake3.blake3()
        with io_errors(path):
            fd = os.open(
                path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            try:
                os.fchmod(fd, shareable_mode(member.mode | stat.S_IFREG))
                while chunk := content.read(_READ):
                    hasher.update(chunk)
                    write_all(fd, chunk)
            finally:
                os.close(fd)
        if "blake3:" + hasher.hexdigest() != entry.digest:
            raise IntegrityError(f"{self.what}: {name}: digest mismatch with {MANIFEST_NAME}")
        self.on_written(entry.size)
