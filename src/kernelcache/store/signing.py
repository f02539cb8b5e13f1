"""Signing: ed25519 keys (PEM or 32 raw bytes), and a manifest's signature in its one written
form (base64 of the signature over the manifest's bytes, and one newline)."""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias, cast

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from kernelcache.errors import SignatureError, SpecError
from kernelcache.spec import PUBLIC_KEY_FILE, SIGNING_KEY_FILE
from kernelcache.store.fs import fsync_dir, io_errors, one_line, write_file_synced
from kernelcache.store.layout import MANIFEST_NAME

PrivateKeyLike: TypeAlias = "Ed25519PrivateKey | str | os.PathLike[str]"
PublicKeyLike: TypeAlias = "Ed25519PublicKey | str | os.PathLike[str]"


# For each kind of key: its class, and how it is read from PEM and from 32 raw bytes.
_KEY_KINDS: dict[str, tuple[type[object], Callable[[bytes], object], Callable[[bytes], object]]] = {
    "private": (
        Ed25519PrivateKey,
        lambda data: serialization.load_pem_private_key(data, password=None),
        Ed25519PrivateKey.from_private_bytes,
    ),
    "public": (
        Ed25519PublicKey,
        serialization.load_pem_public_key,
        Ed25519PublicKey.from_public_bytes,
    ),
}


def _load_key(path: str | os.PathLike[str], what: str) -> object:
    """A key from a PEM file or a file of exactly 32 raw bytes; any failure names the path."""
    kind, from_pem, from_raw = _KEY_KINDS[what]
    name = os.fsdecode(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SignatureError(
            f"{name}: cannot read {what} key: {one_line(exc.strerror or exc)}", path=name
        ) from exc
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            key = from_pem(data)
        elif len(data) == 32:
            key = from_raw(data)
        else:
            raise ValueError("neither PEM nor 32 raw bytes")
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise SignatureError(f"{name}: unusable {what} key: {one_line(exc)}", path=name) from exc
    if not isinstance(key, kind):
        raise SignatureError(f"{name}: not an ed25519 {what} key", path=name)
    return key


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """An ed25519 private key from a PEM (PKCS#8, unencrypted) file or 32 raw bytes."""
    return cast(Ed25519PrivateKey, _load_key(path, "private"))


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """An ed25519 public key from a PEM (SubjectPublicKeyInfo) file or 32 raw bytes."""
    return cast(Ed25519PublicKey, _load_key(path, "public"))


def private_key(signing_key: PrivateKeyLike | None) -> Ed25519PrivateKey | None:
    if signing_key is None or isinstance(signing_key, Ed25519PrivateKey):
        return signing_key
    return load_private_key(signing_key)


def generate_keypair(directory: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write a new ed25519 key pair as PEM files: both, or neither.

    A pair half-written over an old one would sign with a key its public half does not
    verify, so an existing file of either name is refused before anything is written; the
    two files are made in a hidden directory beside them, then linked into place (a link
    never replaces a file), and a failed second link takes the first back.

    The file names are the signing Secret's keys, so ``kubectl create secret generic NAME
    --from-file=DIR/kernelcache.key --from-file=DIR/kernelcache.pub`` makes a working Secret.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise SpecError(f"{directory}: not a directory (keygen writes two files into one)")
    paths = (directory / SIGNING_KEY_FILE, directory / PUBLIC_KEY_FILE)
    for path in paths:
        if path.exists() or path.is_symlink():
            raise SpecError(
                f"{path}: already exists; keygen writes a new pair or nothing (move the old "
                "pair away first)",
                path=str(path),
            )
    private = Ed25519PrivateKey.generate()
    contents = (
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    )
    with io_errors(directory):
        directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".kernelcache-keygen-", dir=directory))
    linked: list[Path] = []
    try:
        for path, data, mode in zip(paths, contents, (0o600, 0o644), strict=True):
            write_file_synced(staging / path.name, data, mode=mode)
        for path in paths:
            with io_errors(path):
                os.link(staging / path.name, path)
            linked.append(path)
        fsync_dir(directory)
    except BaseException:
        for path in linked:
            path.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return paths


def signature_bytes(key: Ed25519PrivateKey, manifest_bytes: bytes) -> bytes:
    return base64.b64encode(key.sign(manifest_bytes)) + b"\n"


def signature_mismatch(
    encoded: bytes, manifest_bytes: bytes, public_key: Ed25519PublicKey
) -> str | None:
    """What is wrong with a signature file's bytes for manifest_bytes, or None: it must be
    exactly ``signature_bytes``' form, and the signature of these bytes by public_key."""
    try:
        signature = base64.b64decode(encoded.removesuffix(b"\n"), validate=True)
    except ValueError:
        return "not base64"
    if encoded != base64.b64encode(signature) + b"\n":  # exactly as written: no byte may change
        return "not in its written form (base64 and one newline)"
    try:
        public_key.verify(signature, manifest_bytes)
    except InvalidSignature:
        return f"does not match {MANIFEST_NAME}"
    return None
