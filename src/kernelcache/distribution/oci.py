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

import os
from dataclasses import dataclass
from pathlib import Path

from kernelcache.contract import CacheKey
from kernelcache.distribution.auth import AuthLike
from kernelcache.store.signing import PrivateKeyLike, PublicKeyLike


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
    signing_key: PrivateKeyLike | None = None,
    gzip: bool = False,
    workers: int | None = None,
) -> PushResult:
    """Push the key's current generation (or ``generation``) to ``ref``
    (``registry/repository[:tag]``; the tag defaults to the generation id).

    The generation must verify (its own signature too, when it has one and ``signing_key``
    is not given). With ``signing_key`` the metadata layer carries MANIFEST.json's signature
    by that key and the manifest digest is signed under cosign's tag scheme. ``ca_file``: the
    CA bundle the registry's certificate must chain to (default: the system's). Failures are
    KernelCacheErrors of their class: a missing generation (3), one that does not verify
    (5–8), a registry unreachable or refusing the credentials (10), a bad reference (2).
    """
    raise NotImplementedError


def pull(
    ref: str,
    store: str | os.PathLike[str],
    *,
    key: CacheKey | str | None = None,
    auth: AuthLike = None,
    ca_file: str | os.PathLike[str] | None = None,
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
    """
    raise NotImplementedError
