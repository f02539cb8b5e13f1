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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from kernelcache import contract
from kernelcache.errors import (
    ManifestError,
    one_line,
)
from kernelcache.store.digests import FileEntry
from kernelcache.store.fs import io_errors, open_regular, shareable_mode
from kernelcache.store.layout import FILES_DIR, MANIFEST_NAME, SIGNATURE_NAME
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
