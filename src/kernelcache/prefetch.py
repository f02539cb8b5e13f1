"""Node-local prefetch: keep a KernelCache's current generation on this node's disk.

The operator runs a DaemonSet per GPU class of a KernelCache, on the class's nodes, whose
init-container runs ``kernelcache prefetch`` with what the KernelCache serves now: its key,
the token (the artifact's ``repo@sha256:…``, else the generation id) and where to read it
from (the registry by digest, or the shared store). When the KernelCache moves on, the
DaemonSet's template changes and each node fetches the new one. Serving pods on the node
then verify and copy out the local copy (``store.prefetched``) and read nothing else.

Disk use under the root is bounded by ``limit_bytes``. Before a fetch, and after a pull
(whose size is known only then), copies are evicted oldest first (by when they were
fetched) until the new one fits; never one that a ``.wanted`` entry names (what some
KernelCache serves now) and never one an init-container is reading (it holds a shared
lock). A generation that cannot fit is not kept: the fetch fails with one line and the
copies already there stay as they were, so a full disk never touches a running pod (pods
hold their own copy in their emptyDir) and new pods fall back to their source.
"""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from kernelcache.errors import StorageError
from kernelcache.store import Manifest, Store, materialize, verify
from kernelcache.store.fs import io_errors
from kernelcache.store.layout import MANIFEST_NAME
from kernelcache.store.prefetched import (
    Wanted,
    all_wanted,
    copies,
    evicting,
    find,
    write_wanted,
)


@dataclass
class Synced:
    """What one ``sync`` did: the copy that serves the key, and what it evicted."""

    key: str
    wanted: Wanted
    fetched: bool  # False: the node had it already
    evicted: list[str] = field(default_factory=list)
    used_bytes: int = 0

    @property
    def summary(self) -> str:
        what = "fetched" if self.fetched else "already here"
        gone = f"; evicted {', '.join(self.evicted)}" if self.evicted else ""
        return (
            f"{self.key}: generation {self.wanted.generation} ({self.wanted.token}) {what}; "
            f"{_amount(self.used_bytes)} used on this node{gone}"
        )


def sync(
    root: Path,
    key: str,
    token: str,
    *,
    limit_bytes: int,
    store: Path | None = None,
    ref: str | None = None,
    auth: Path | None = None,
    ca_file: Path | None = None,
    public_key: Path | None = None,
    require_signature: bool = False,
    workers: int | None = None,
) -> Synced:
    """Make ``key``'s copy for ``token`` present under ``root``, within ``limit_bytes``.

    ``ref`` pulls it from a registry (the token is the ref); else ``store`` copies the
    generation named ``token`` of ``key`` out of the shared store, checked as it is copied.
    """
    root = Path(root)
    with io_errors(root):
        root.mkdir(parents=True, exist_ok=True)
    if (have := find(root, key, token)) is not None:
        return Synced(key, have, False, used_bytes=used(root))
    evicted: list[str] = []
    if ref is not None:
        wanted = _pull(root, key, ref, auth, ca_file, public_key, require_signature, workers)
        size = _size(wanted.gen_dir(root))
        evicted += _make_room(root, 0, limit_bytes, keep={wanted.gen_dir(root)}, new=size)
    else:
        if store is None:
            raise ValueError("sync needs a store or a ref")
        gen_dir = Store(store).key_dir(key) / token
        result = verify(gen_dir, key=key, digests=False)  # the copy checks every digest
        result.raise_for_problems()
        manifest = result.manifest
        assert manifest is not None
        evicted += _make_room(root, manifest.total_bytes, limit_bytes, keep=set(), new=0)
        materialize(result, root / key, workers=workers)
        wanted = Wanted(token, key, manifest.generation)
    write_wanted(root, key, wanted)
    return Synced(key, wanted, True, evicted, used(root))


def _pull(
    root: Path,
    key: str,
    ref: str,
    auth: Path | None,
    ca_file: Path | None,
    public_key: Path | None,
    require_signature: bool,
    workers: int | None,
) -> Wanted:
    """Pull into a store of its own beside the copies, then move the generation in: the
    copies' layout is ``<key>/<generation>`` whatever key the artifact was built for."""
    from kernelcache.distribution import pull

    scratch = root / f".pull-{secrets.token_hex(4)}"
    try:
        pulled = pull(
            ref,
            scratch,
            auth=auth,
            ca_file=ca_file,
            public_key=public_key,
            require_signature=require_signature,
            workers=workers,
        )
        final = root / pulled.key / pulled.generation
        with io_errors(final):
            final.parent.mkdir(parents=True, exist_ok=True)
            if not (final / MANIFEST_NAME).is_file():
                os.rename(pulled.gen_dir, final)
        return Wanted(ref, pulled.key, pulled.generation)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _size(gen_dir: Path) -> int:
    data = (gen_dir / MANIFEST_NAME).read_bytes()
    return Manifest.parse(data, str(gen_dir / MANIFEST_NAME)).total_bytes


def used(root: Path) -> int:
    """Bytes of every copy under the root, as their manifests count them."""
    return sum(_size(gen_dir) for gen_dir in copies(root))


def _amount(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size} bytes"


def _make_room(root: Path, incoming: int, limit: int, keep: set[Path], new: int) -> list[str]:
    """Evict until ``incoming`` more bytes fit within ``limit``; raise if they cannot."""
    named = {w.gen_dir(root) for w in all_wanted(root).values()} | keep
    sized = [(gen_dir.stat().st_mtime, gen_dir, _size(gen_dir)) for gen_dir in copies(root)]
    total = sum(size for _, _, size in sized)
    evicted = []
    for _, gen_dir, size in sorted(sized):
        if total + incoming <= limit:
            break
        if gen_dir in named:
            continue
        with evicting(gen_dir) as free:
            if not free:
                continue  # an init-container is copying it out
            trash = gen_dir.parent / f".evicted-{secrets.token_hex(4)}"
            with io_errors(gen_dir):
                os.rename(gen_dir, trash)
        shutil.rmtree(trash, ignore_errors=True)
        total -= size
        evicted.append(str(gen_dir.relative_to(root)))
    if total + incoming > limit:
        for gen_dir in keep:  # a pulled copy that does not fit is not kept
            shutil.rmtree(gen_dir, ignore_errors=True)
        need = incoming or new
        raise StorageError(
            f"{root}: a generation of {_amount(need)} does not fit the prefetch limit of "
            f"{_amount(limit)} ({_amount(total - new)} held by copies in use or named by a "
            "KernelCache)",
            path=str(root),
        )
    return evicted
