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
hold their own copy in their emptyDir) and new pods fall back to their source. Prefetches
on one node take turns under the root's ``.lock``, so two at once cannot both admit a copy
into the same free space.

A copy already here counts only when it verifies (every digest; its signature with a key):
a damaged one is fetched again. A copy carries the generation's signature, so pods that
require one can verify it.

A prefetch killed midway (SIGKILL, OOM, a node drain) leaves what it was writing: a
``.partial-*`` copy, a ``.pull-*`` scratch store, a ``.damaged-*`` copy being removed. No
prefetch holds the node's lock then but the next one, so the next one removes them first
and says how much it freed: the bound counts only copies, and 220 MB left by a killed
prefetch would otherwise fill the disk behind its back.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelcache.errors import StorageError
from kernelcache.store import Manifest, Store, load_public_keys, materialize, verified, verify
from kernelcache.store.fs import io_errors
from kernelcache.store.layout import LOCK_NAME, MANIFEST_NAME
from kernelcache.store.locking import lock
from kernelcache.store.prefetched import (
    Wanted,
    all_wanted,
    copies,
    evicting,
    find,
    write_wanted,
)
from kernelcache.store.signing import PublicKeyLike

# How long a prefetch waits for another one on the node (a pull of a large generation) to
# finish before it fails (exit 12); the kubelet runs it again.
LOCK_WAIT_S = 1800.0


@dataclass
class Synced:
    """What one ``sync`` did: the copy that serves the key, and what it evicted."""

    key: str
    wanted: Wanted
    fetched: bool  # False: the node had it already
    evicted: list[str] = field(default_factory=list)
    used_bytes: int = 0
    repaired: str | None = None  # why the copy that was here did not verify
    leftovers: int = 0  # bytes that killed prefetches had left, removed first

    @property
    def summary(self) -> str:
        what = "fetched" if self.fetched else "already here, verified"
        if self.repaired is not None:
            what = f"fetched again (the copy here did not verify: {self.repaired})"
        gone = f"; evicted {', '.join(self.evicted)}" if self.evicted else ""
        if self.leftovers:
            gone += f"; removed {_amount(self.leftovers)} a killed prefetch had left"
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
    plain_http: bool = False,
    public_key: Path | None = None,
    require_signature: bool = False,
    workers: int | None = None,
    lock_wait_s: float = LOCK_WAIT_S,
) -> Synced:
    """Make ``key``'s copy for ``token`` present and intact under ``root``, within
    ``limit_bytes``.

    ``ref`` pulls it from a registry (the token is the ref); else ``store`` copies the
    generation named ``token`` of ``key`` out of the shared store, checked as it is copied.
    A copy already here is verified whole (with ``public_key``, its signature too) and
    fetched again when it does not verify. Prefetches of one node take turns (``.lock``,
    waited for up to ``lock_wait_s``), so the bound holds however many run at once.
    """
    root = Path(root)
    with io_errors(root):
        root.mkdir(parents=True, exist_ok=True)
    trusted = load_public_keys(public_key) if public_key is not None else None
    with _node_lock(root, lock_wait_s):
        leftovers = remove_leftovers(root)
        repaired = None
        if (have := find(root, key, token)) is not None:
            problem = _damage(have, root, trusted, require_signature, workers)
            if problem is None:
                return Synced(key, have, False, used_bytes=used(root), leftovers=leftovers)
            repaired = problem
            _remove_copy(have.gen_dir(root))
        evicted: list[str] = []
        if ref is not None:
            pulled = _pull(
                root,
                key,
                ref,
                auth=auth,
                ca_file=ca_file,
                plain_http=plain_http,
                public_key=trusted,
                require_signature=require_signature,
                workers=workers,
            )
            gen_dir = pulled.gen_dir(root)
            evicted += _make_room(root, 0, limit_bytes, keep={gen_dir}, new=_size(gen_dir))
            wanted = pulled
        else:
            if store is None:
                raise ValueError("sync needs a store or a ref")
            gen_dir = Store(store).key_dir(key) / token
            # The copy checks every digest; the signature is checked here, and travels.
            result, manifest = verified(
                gen_dir,
                key=key,
                public_key=trusted,
                require_signature=require_signature,
                digests=False,
            )
            evicted += _make_room(root, manifest.total_bytes, limit_bytes, keep=set(), new=0)
            materialize(result, root / key, workers=workers)
            wanted = Wanted(token, key, manifest.generation, key)
        write_wanted(root, key, wanted)
        return Synced(key, wanted, True, evicted, used(root), repaired, leftovers)


# What a prefetch writes before it is done: at the root (a pull's scratch store) and in a
# key's directory (a copy being materialized, replaced or removed).
_ROOT_LEFTOVERS = (".pull-",)
_KEY_LEFTOVERS = (".partial-", ".stale-", ".damaged-")


def remove_leftovers(root: Path) -> int:
    """Remove what killed prefetches left under ``root``; the bytes freed. Called under the
    node's lock: no live prefetch is writing any of it."""
    found = [p for p in root.glob(".*") if p.name.startswith(_ROOT_LEFTOVERS)]
    found += [
        p
        for p in root.glob("*/*/*/.*")
        if p.name.startswith(_KEY_LEFTOVERS) and not p.parts[-4].startswith(".")
    ]
    freed = 0
    for path in found:
        freed += _du(path)
        with io_errors(path):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    return freed


def _du(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir() or p.is_symlink())


@contextmanager
def _node_lock(root: Path, wait_s: float) -> Iterator[None]:
    """The node's prefetch lock: admission, fetch and eviction one prefetch at a time."""
    path = root / LOCK_NAME
    with io_errors(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        lock(fd, path, f"{root}: another prefetch", wait_s)
        yield
    finally:
        os.close(fd)


def _damage(
    have: Wanted,
    root: Path,
    trusted: PublicKeyLike | None,
    require_signature: bool,
    workers: int | None,
) -> str | None:
    """Why the copy a key names does not verify (every digest, its signature), or None."""
    checked = verify(
        have.gen_dir(root),
        key=have.key,
        public_key=trusted,
        require_signature=require_signature,
        workers=workers,
    )
    return None if checked.ok else checked.problems[0].message


def _remove_copy(gen_dir: Path) -> None:
    """Move a damaged copy aside and remove it (a reader holding it keeps its files)."""
    trash = gen_dir.parent / f".damaged-{secrets.token_hex(4)}"
    with io_errors(gen_dir):
        os.rename(gen_dir, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _pull(
    root: Path,
    key: str,
    ref: str,
    **options: Any,
) -> Wanted:
    """Pull into a store of its own beside the copies, then move the generation in under
    ``key``, the key it is fetched for (whatever key the artifact was built for)."""
    from kernelcache.distribution import pull

    scratch = root / f".pull-{secrets.token_hex(4)}"
    try:
        pulled = pull(ref, scratch, **options)
        final = root / key / pulled.generation
        with io_errors(final):
            final.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(final):
                _remove_copy(final)  # a copy no entry names (evicted from .wanted): replaced
            os.rename(pulled.gen_dir, final)
        return Wanted(ref, pulled.key, pulled.generation, key)
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
