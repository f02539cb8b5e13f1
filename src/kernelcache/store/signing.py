"""Signing: ed25519 keys (PEM or 32 raw bytes), and a manifest's signature in its one written
form (base64 of the signature over the manifest's bytes, and one newline).

A public key file may hold several PEM keys, one after another: the keys trusted together
while a signing key is rotated (``docs/security.md``). A signature verifies when one of them
made it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
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
PublicKeyLike: TypeAlias = "Ed25519PublicKey | Sequence[Ed25519PublicKey] | str | os.PathLike[str]"

_PEM_BLOCK = re.compile(rb"-----BEGIN [A-Z ]+-----.*?-----END [A-Z ]+-----\s*", re.DOTALL)


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


def _load_keys(path: str | os.PathLike[str], what: str) -> list[object]:
    """The keys of a PEM file (one or more blocks) or of a file of exactly 32 raw bytes; any
    failure names the path."""
    name = os.fsdecode(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SignatureError(
            f"{name}: cannot read {what} key: {one_line(exc.strerror or exc)}", path=name
        ) from exc
    return _parse_keys(data, name, what)


def _parse_keys(data: bytes, name: str, what: str) -> list[object]:
    kind, from_pem, from_raw = _KEY_KINDS[what]
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            blocks = _PEM_BLOCK.findall(data.strip() + b"\n")
            if b"".join(blocks).strip() != data.strip():
                raise ValueError("text outside its PEM blocks")
            keys = [from_pem(block) for block in blocks]
        elif len(data) == 32:
            keys = [from_raw(data)]
        else:
            raise ValueError("neither PEM nor 32 raw bytes")
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise SignatureError(f"{name}: unusable {what} key: {one_line(exc)}", path=name) from exc
    if not all(isinstance(key, kind) for key in keys):
        raise SignatureError(f"{name}: not an ed25519 {what} key", path=name)
    return keys


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """An ed25519 private key from a PEM (PKCS#8, unencrypted) file or 32 raw bytes."""
    return _one_private(_load_keys(path, "private"), os.fsdecode(path))


def parse_private_key(data: bytes, source: str) -> Ed25519PrivateKey:
    """``load_private_key`` of bytes read elsewhere (a Secret's value); errors name source."""
    return _one_private(_parse_keys(data, source, "private"), source)


def _one_private(keys: list[object], name: str) -> Ed25519PrivateKey:
    if len(keys) != 1:
        raise SignatureError(f"{name}: holds {len(keys)} private keys, not one", path=name)
    return cast(Ed25519PrivateKey, keys[0])


def load_public_keys(path: str | os.PathLike[str]) -> tuple[Ed25519PublicKey, ...]:
    """The ed25519 public keys (PEM SubjectPublicKeyInfo blocks, or 32 raw bytes) of a file:
    every one of them is trusted."""
    return tuple(cast(Ed25519PublicKey, key) for key in _load_keys(path, "public"))


def parse_public_keys(data: bytes, source: str) -> tuple[Ed25519PublicKey, ...]:
    """``load_public_keys`` of bytes read elsewhere (a Secret's value); errors name source."""
    return tuple(cast(Ed25519PublicKey, key) for key in _parse_keys(data, source, "public"))


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """The one ed25519 public key of a file."""
    keys = load_public_keys(path)
    if len(keys) != 1:
        name = os.fsdecode(path)
        raise SignatureError(f"{name}: holds {len(keys)} public keys, not one", path=name)
    return keys[0]


def public_keys(trusted: PublicKeyLike) -> tuple[Ed25519PublicKey, ...]:
    """The keys a PublicKeyLike stands for (a key, several, or a file of them)."""
    if isinstance(trusted, Ed25519PublicKey):
        return (trusted,)
    if isinstance(trusted, (str, os.PathLike)):
        return load_public_keys(trusted)
    return tuple(trusted)


def private_key(signing_key: PrivateKeyLike | None) -> Ed25519PrivateKey | None:
    if signing_key is None or isinstance(signing_key, Ed25519PrivateKey):
        return signing_key
    return load_private_key(signing_key)


def fingerprint(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """A short, stable name of a key pair (of its public half): what status and results
    print to say which key signed a generation and which keys pods trust."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


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


def signer(
    encoded: bytes, manifest_bytes: bytes, trusted: Sequence[Ed25519PublicKey]
) -> tuple[Ed25519PublicKey | None, str | None]:
    """(the trusted key that made this signature, None), or (None, what is wrong with it):
    a signature file must be exactly ``signature_bytes``' form, and the signature of
    manifest_bytes by one of the trusted keys."""
    try:
        signature = base64.b64decode(encoded.removesuffix(b"\n"), validate=True)
    except ValueError:
        return None, "not base64"
    if encoded != base64.b64encode(signature) + b"\n":  # exactly as written: no byte may change
        return None, "not in its written form (base64 and one newline)"
    for key in trusted:
        try:
            key.verify(signature, manifest_bytes)
        except InvalidSignature:
            continue
        return key, None
    if len(trusted) > 1:
        return None, f"does not match {MANIFEST_NAME} by any of the {len(trusted)} trusted keys"
    return None, f"does not match {MANIFEST_NAME}"
