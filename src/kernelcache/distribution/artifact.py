"""The artifact's shape: an OCI image manifest with a real image config and tar layers that
hold the generation's own files, so that containerd and CRI-O (which mount only image-shaped
manifests) can mount it as an image volume: the volume's root is the generation directory.

Layers, in order: MANIFEST.json with its signature (small: a puller checks it before it
fetches anything else), then one layer per subtree of files/ (``files/<toolchain>``), each a
deterministic tar (sorted, owner 0, mtime 0, modes as the store sets them), so that the same
subtree always makes the same blob. Each layer names its subtree in an annotation; the
manifest carries the key, the generation id and the stamp digest (names in ``contract``).
"""

from __future__ import annotations

import gzip as gziplib
import hashlib
import io
import json
import platform
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from kernelcache import contract
from kernelcache.errors import (
    IntegrityError,
    KernelCacheError,
    ManifestError,
    UnsafePathError,
    one_line,
)
from kernelcache.store.digests import FileEntry
from kernelcache.store.fs import io_errors, open_regular, shareable_mode
from kernelcache.store.layout import FILES_DIR, MANIFEST_NAME, SIGNATURE_NAME, path_problem
from kernelcache.store.manifest import Manifest

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_MEDIA_TYPES = (LAYER_TAR, LAYER_TAR_GZIP)
# What a manifest of a generation says it is (artifactType, for registries that list it).
ARTIFACT_TYPE = "application/vnd.kernelcache.generation.v1"
ANNOTATION_CREATED = "org.opencontainers.image.created"

# The metadata layer's annotation (its subtree is the generation's two top-level files).
META_LAYER = MANIFEST_NAME
META_FILES = (MANIFEST_NAME, SIGNATURE_NAME)

# The OS architectures a generation's host code (FlashInfer's .so files) is built for, in
# the names image configs use.
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def host_architecture() -> str:
    machine = platform.machine().lower()
    return _GOARCH.get(machine, machine)


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def descriptor_of(data: bytes, media_type: str) -> Descriptor:
    return Descriptor(media_type, digest_of(data), len(data))


def canonical_json(document: Any) -> bytes:
    """The one serialisation of what kernelcache uploads: sorted keys, no spaces."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str  # sha256:<hex>
    size: int
    annotations: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": self.size,
        }
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out

    @property
    def subtree(self) -> str:
        """The part of the generation a layer holds (its ``OCI_ANNOTATION_LAYER``)."""
        return self.annotations.get(contract.OCI_ANNOTATION_LAYER, "")


# --------------------------------------------------------------------------- layers


def layer_subtrees(manifest: Manifest) -> list[tuple[str, list[FileEntry]]]:
    """The file layers: one per first segment of files/ (``files/<toolchain>``), sorted."""
    groups: dict[str, list[FileEntry]] = {}
    for entry in manifest.files:
        groups.setdefault(f"{FILES_DIR}/{entry.path.split('/', 1)[0]}", []).append(entry)
    return sorted(groups.items())


class _Hashing(io.RawIOBase):
    """A write-only stream that hashes and counts what passes through it to ``out``."""

    def __init__(self, out: BinaryIO) -> None:
        self.out, self.hasher, self.size = out, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.hasher.update(data)
        self.out.write(data)
        self.size += len(data)
        return len(data)

    @property
    def digest(self) -> str:
        return "sha256:" + self.hasher.hexdigest()


def _tar_info(
    name: str, size: int = 0, mode: int = 0o755, directory: bool = False
) -> tarfile.TarInfo:
    """A tar entry that depends on nothing but the name, size and mode: owner 0, mtime 0."""
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.size, info.mode, info.mtime = size, mode, 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


@dataclass(frozen=True)
class BuiltLayer:
    path: Path
    descriptor: Descriptor
    diff_id: str  # sha256 of the uncompressed tar (the image config's rootfs)


def write_layer(
    out_path: Path, gen_dir: Path, names: list[str], subtree: str, gzip: bool
) -> BuiltLayer:
    """Write the tar of ``names`` (paths under gen_dir) with their parent directories,
    deterministically: the same files make the same bytes, whatever the machine."""
    directories = sorted({p for name in names for p in _parents(name)})
    with io_errors(out_path), open(out_path, "xb") as raw:
        blob = _Hashing(raw)
        compressed = (
            gziplib.GzipFile(fileobj=blob, mode="wb", mtime=0, compresslevel=1) if gzip else None
        )
        tar_out = _Hashing(compressed if compressed is not None else blob)  # type: ignore[arg-type]
        with tarfile.open(fileobj=tar_out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for directory in directories:
                tar.addfile(_tar_info(directory, directory=True))
            for name in sorted(names):
                path = gen_dir / name
                with io_errors(path):
                    fd, st = open_regular(path)
                    with open(fd, "rb", closefd=True) as source:
                        tar.addfile(_tar_info(name, st.st_size, shareable_mode(st.st_mode)), source)
        if compressed is not None:
            compressed.close()
    media_type = LAYER_TAR_GZIP if gzip else LAYER_TAR
    annotations = {contract.OCI_ANNOTATION_LAYER: subtree}
    return BuiltLayer(
        out_path, Descriptor(media_type, blob.digest, blob.size, annotations), tar_out.digest
    )


def _parents(name: str) -> Iterator[str]:
    parent = name.rpartition("/")[0]
    while parent:
        yield parent
        parent = parent.rpartition("/")[0]


# --------------------------------------------------------------------------- config, manifest


def image_config(manifest: Manifest, diff_ids: list[str]) -> bytes:
    """A real, minimal image config: the host architecture (a generation's .so files are
    host code), and the rootfs an image volume unpacks."""
    return canonical_json(
        {
            "architecture": host_architecture(),
            "os": "linux",
            "created": manifest.created,
            "config": {"Labels": _annotations(manifest)},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    )


def _annotations(manifest: Manifest) -> dict[str, str]:
    return {
        contract.OCI_ANNOTATION_KEY: manifest.key,
        contract.OCI_ANNOTATION_GENERATION: manifest.generation,
        contract.OCI_ANNOTATION_STAMP: str(manifest.stamp["digest"]),
    }


def image_manifest(manifest: Manifest, config: Descriptor, layers: list[Descriptor]) -> bytes:
    return canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": ARTIFACT_TYPE,
            "config": config.to_dict(),
            "layers": [layer.to_dict() for layer in layers],
            "annotations": {**_annotations(manifest), ANNOTATION_CREATED: manifest.created},
        }
    )


@dataclass(frozen=True)
class ImageManifest:
    """A pulled manifest, parsed strictly: what the puller trusts of it is only checked."""

    config: Descriptor
    layers: tuple[Descriptor, ...]
    annotations: dict[str, str]

    @property
    def key(self) -> str:
        return self.annotations[contract.OCI_ANNOTATION_KEY]

    @property
    def generation(self) -> str:
        return self.annotations[contract.OCI_ANNOTATION_GENERATION]

    @property
    def stamp(self) -> str:
        return self.annotations[contract.OCI_ANNOTATION_STAMP]

    @property
    def meta_layer(self) -> Descriptor:
        return self.layers[0]

    @property
    def file_layers(self) -> tuple[Descriptor, ...]:
        return self.layers[1:]


def _field(obj: Any, name: str, kind: type, source: str) -> Any:
    value = obj.get(name) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ManifestError(f"{source}: field {name}: expected {kind.__name__}")
    return value


def _descriptor(obj: Any, source: str, media_types: tuple[str, ...]) -> Descriptor:
    media_type = _field(obj, "mediaType", str, source)
    if media_type not in media_types:
        raise ManifestError(
            f"{source}: mediaType {media_type!r}: expected {' or '.join(media_types)}"
        )
    digest = _field(obj, "digest", str, source)
    if not (digest.startswith("sha256:") and len(digest) == 71 and _hex(digest[7:])):
        raise ManifestError(f"{source}: digest {one_line(digest)[:80]!r}: expected sha256:<64 hex>")
    size = _field(obj, "size", int, source)
    if size < 0:
        raise ManifestError(f"{source}: size {size}: negative")
    annotations = obj.get("annotations", {})
    if not isinstance(annotations, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
    ):
        raise ManifestError(f"{source}: annotations: expected strings")
    return Descriptor(media_type, digest, size, annotations)


def _hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def parse_json(data: bytes, source: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ManifestError(f"{source}: not JSON: {one_line(exc)}") from exc


def parse_image_manifest(data: bytes, source: str) -> ImageManifest:
    """A generation's image manifest; anything else (an index, a foreign image, a missing
    annotation or layer) is one ManifestError line naming the field."""
    document = parse_json(data, source)
    if _field(document, "schemaVersion", int, source) != 2:
        raise ManifestError(f"{source}: schemaVersion: expected 2")
    if document.get("mediaType", MANIFEST_MEDIA_TYPE) != MANIFEST_MEDIA_TYPE:
        raise ManifestError(
            f"{source}: mediaType {document['mediaType']!r}: not an OCI image manifest"
        )
    config = _descriptor(
        _field(document, "config", dict, source), f"{source}: config", (CONFIG_MEDIA_TYPE,)
    )
    layer_list = _field(document, "layers", list, source)
    layers = tuple(
        _descriptor(layer, f"{source}: layers[{i}]", LAYER_MEDIA_TYPES)
        for i, layer in enumerate(layer_list)
    )
    annotations = _field(document, "annotations", dict, source)
    for name in (
        contract.OCI_ANNOTATION_KEY,
        contract.OCI_ANNOTATION_GENERATION,
        contract.OCI_ANNOTATION_STAMP,
    ):
        if not isinstance(annotations.get(name), str):
            raise ManifestError(
                f"{source}: annotation {name}: missing (not a kernelcache generation)"
            )
    if not layers or layers[0].subtree != META_LAYER:
        raise ManifestError(f"{source}: layers[0]: expected the {META_LAYER} layer first")
    seen = set()
    for i, layer in enumerate(layers[1:], 1):
        subtree = layer.subtree
        parts = subtree.split("/")
        if len(parts) != 2 or parts[0] != FILES_DIR or parts[1] in ("", ".", ".."):
            raise ManifestError(
                f"{source}: layers[{i}]: annotation {contract.OCI_ANNOTATION_LAYER} "
                f"{one_line(subtree)[:80]!r}: expected {FILES_DIR}/<name>"
            )
        if subtree in seen:
            raise ManifestError(f"{source}: layers[{i}]: {subtree} held by two layers")
        seen.add(subtree)
    return ImageManifest(config, layers, dict(annotations))


def parse_config(data: bytes, source: str, layers: int) -> list[str]:
    """The diff ids of an image config (one per layer), checked for shape."""
    document = parse_json(data, source)
    rootfs = _field(document, "rootfs", dict, source)
    diff_ids = _field(rootfs, "diff_ids", list, f"{source}: rootfs")
    if len(diff_ids) != layers or not all(isinstance(d, str) for d in diff_ids):
        raise ManifestError(f"{source}: rootfs.diff_ids: expected {layers} digests, one per layer")
    return diff_ids


# --------------------------------------------------------------------------- signatures

# cosign's tag scheme: the signature of sha256:<hex> is the image under tag sha256-<hex>.sig,
# one layer per signature, each a "simple signing" payload whose signature is an annotation.
SIGNATURE_PAYLOAD_TYPE = "application/vnd.dev.cosign.simplesigning.v1+json"
SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
SIGNATURE_ARTIFACT_TYPE = "application/vnd.dev.cosign.artifact.sig.v1+json"


def signature_tag(digest: str) -> str:
    return digest.replace(":", "-", 1) + ".sig"


def signature_payload(name: str, digest: str) -> bytes:
    """What is signed: the image's name and manifest digest, as cosign's payload has it."""
    return canonical_json(
        {
            "critical": {
                "identity": {"docker-reference": name},
                "image": {"docker-manifest-digest": digest},
                "type": "cosign container image signature",
            },
            "optional": None,
        }
    )


def signature_manifest(payload: Descriptor, config: Descriptor, subject: Descriptor) -> bytes:
    """The signature image: cosign's layout, with ``subject`` so a registry with the
    referrers API lists it too."""
    return canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": SIGNATURE_ARTIFACT_TYPE,
            "config": config.to_dict(),
            "layers": [payload.to_dict()],
            "subject": subject.to_dict(),
        }
    )


def parse_signatures(data: bytes, source: str) -> list[tuple[Descriptor, str]]:
    """The payload descriptors of a signature image with their signatures (base64)."""
    document = parse_json(data, source)
    layers = _field(document, "layers", list, source)
    found = []
    for i, layer in enumerate(layers):
        descriptor = _descriptor(layer, f"{source}: layers[{i}]", (SIGNATURE_PAYLOAD_TYPE,))
        signature = descriptor.annotations.get(SIGNATURE_ANNOTATION)
        if signature:
            found.append((descriptor, signature))
    return found


def payload_digest(payload: bytes, source: str) -> str:
    """The manifest digest a signature payload vouches for."""
    document = parse_json(payload, source)
    try:
        digest = document["critical"]["image"]["docker-manifest-digest"]
    except (KeyError, TypeError):
        digest = None
    if not isinstance(digest, str):
        raise ManifestError(f"{source}: critical.image.docker-manifest-digest: missing")
    return digest


# --------------------------------------------------------------------------- reading layers


class BlobReader(io.RawIOBase):
    """A read-only stream over a blob's chunks that hashes and counts what it hands on, and
    refuses to hand on more than ``limit`` bytes (a blob larger than its descriptor)."""

    def __init__(
        self, chunks: Iterable[bytes], limit: int, on_excess: Callable[[], Exception]
    ) -> None:
        self._chunks = iter(chunks)
        self._buffer = memoryview(b"")
        self._limit, self._on_excess = limit, on_excess
        self.hasher, self.size = hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        while not self._buffer:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self.hasher.update(chunk)
            self.size += len(chunk)
            if self.size > self._limit:
                raise self._on_excess()
            self._buffer = memoryview(chunk)
        n = min(len(target), len(self._buffer))
        target[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n

    def drain(self) -> None:
        """Read what the tar reader left (the archive's zero padding), so all is hashed."""
        while self.readinto(bytearray(1 << 16)):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.hasher.hexdigest()


class _UncompressedHash(io.RawIOBase):
    """Hashes what a gzip stream decompresses to (a layer's diff id)."""

    def __init__(self, source: gziplib.GzipFile) -> None:
        self._source, self.hasher = source, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        n = self._source.readinto(target)
        self.hasher.update(memoryview(target)[:n])
        return int(n)

    def drain(self) -> None:
        while self.readinto(bytearray(1 << 16)):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.hasher.hexdigest()


# Tar errors that mean the bytes are not a well-formed (or are a truncated) layer.
_UNREADABLE = (tarfile.TarError, EOFError, zlib.error, gziplib.BadGzipFile)


def read_layer(
    chunks: Iterable[bytes],
    layer: Descriptor,
    diff_id: str,
    what: str,
    on_entry: Callable[[tarfile.TarInfo, BinaryIO | None], None],
) -> None:
    """Stream a layer's tar, handing each entry (a regular file with its content, or a
    directory) to ``on_entry``, then check the blob's size and digest and its diff id.

    Entries are used before the digest is known (one pass, no copy of the blob on disk); a
    caller writes them only into a staging directory it discards on any failure. Every
    entry is refused unless it is a regular file or a directory with a safe relative path
    (UnsafePathError: a symlink, a hard link, a device, ``..``, an absolute path). When
    anything fails, the rest of the blob is read and its digest checked first: a damaged
    blob is reported as such, whatever it broke on the way.
    """
    reader = BlobReader(
        chunks,
        layer.size,
        lambda: IntegrityError(f"{what}: larger than its descriptor's {layer.size} bytes"),
    )
    gzip = layer.media_type == LAYER_TAR_GZIP
    uncompressed = _UncompressedHash(gziplib.GzipFile(fileobj=reader, mode="rb")) if gzip else None
    stream: Any = uncompressed if uncompressed is not None else reader
    try:
        try:
            with tarfile.open(fileobj=stream, mode="r|", bufsize=_TAR_BUFFER) as tar:
                for member in tar:
                    _check_entry(member, what)
                    content = tar.extractfile(member) if member.isreg() else None
                    on_entry(member, content)  # type: ignore[arg-type]
            stream.drain()
        except _UNREADABLE as exc:
            raise IntegrityError(f"{what}: not a readable tar: {one_line(exc)}") from exc
    except KernelCacheError as failure:
        with suppress(KernelCacheError, *_UNREADABLE):
            reader.drain()
        _check_blob(reader, layer, what)
        raise failure
    reader.drain()
    _check_blob(reader, layer, what)
    actual = uncompressed.digest if uncompressed is not None else reader.digest
    if actual != diff_id:
        raise IntegrityError(
            f"{what}: its tar's digest {actual} is not the config's diff id {diff_id}"
        )


_TAR_BUFFER = 1 << 20


def _check_blob(reader: BlobReader, layer: Descriptor, what: str) -> None:
    if reader.size != layer.size:
        raise IntegrityError(f"{what}: truncated: {reader.size} of its {layer.size} bytes")
    if reader.digest != layer.digest:
        raise IntegrityError(f"{what}: digest mismatch: the registry served {reader.digest}")


def _check_entry(member: tarfile.TarInfo, what: str) -> None:
    name = member.name
    if member.issym() or member.islnk():
        kind = "a symlink" if member.issym() else "a hard link"
        raise UnsafePathError(
            f"{what}: {one_line(name)!r} is {kind} (to {one_line(member.linkname)!r})"
        )
    if not (member.isreg() or member.isdir()):
        raise UnsafePathError(f"{what}: {one_line(name)!r} is not a regular file or directory")
    if (problem := path_problem(name)) is not None:
        raise UnsafePathError(f"{what}: {problem}: {one_line(name)!r}")
