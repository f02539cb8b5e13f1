"""A node's prefetched generations: what the prefetch agent writes, what init-containers read.

Under the node-local root (a hostPath)::

    <root>/<namespace>/<name>/<arch>/<generation>/   a generation fetched for that key, as
                                                     materialize or pull leaves it, with its
                                                     signature (verifiable as in the store)
    <root>/.wanted/<namespace>/<name>/<arch>.json     which copy serves that key now
    <root>/.lock                                      held by a prefetch while it admits,
                                                      fetches and evicts

A ``.wanted`` entry names the copy's generation id, the key its manifest was published for
(the building cluster's, for a pulled artifact) and the token it was fetched for: the
artifact's ``repo@sha256:…`` when there is one, else the generation id. An init-container
trusts a copy only for the token its webhook gave it, so a copy of an older generation never
serves a pod admitted for a newer one. The copy lies under the key it serves, derived from
the entry's own path and never from what the entry says: an entry edited to name another
KernelCache's copy names a directory of its own key that does not hold it. The entry is
written last, atomically, after the copy is complete.

An init-container holds a shared ``flock`` on the generation directory while it reads it;
eviction takes the exclusive lock without waiting and skips a copy someone holds.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kernelcache.contract import CacheKey
from kernelcache.store.fs import io_errors, replace_synced
from kernelcache.store.layout import MANIFEST_NAME

WANTED_DIR = ".wanted"


@dataclass(frozen=True)
class Wanted:
    """The copy that serves a key on this node, and the token it was fetched for."""

    token: str
    key: str  # the key the generation was published for
    generation: str
    serves: str  # the key whose copy it is: where it lies

    def gen_dir(self, root: Path) -> Path:
        return root / self.serves / self.generation


def wanted_path(root: Path, key: str) -> Path:
    return root / WANTED_DIR / f"{key}.json"


def read_wanted(root: Path, key: str) -> Wanted | None:
    """The entry for ``key``; None when there is none or it is not one this module wrote."""
    try:
        data = json.loads(wanted_path(root, key).read_bytes())
        found = Wanted(str(data["token"]), str(data["key"]), str(data["generation"]), key)
        CacheKey.parse(found.key)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if "/" in found.generation or found.generation.startswith("."):
        return None
    return found


def write_wanted(root: Path, key: str, wanted: Wanted) -> None:
    path = wanted_path(root, key)
    with io_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    data = {"token": wanted.token, "key": wanted.key, "generation": wanted.generation}
    replace_synced(path, json.dumps(data, sort_keys=True).encode(), ".wanted-")


def all_wanted(root: Path) -> dict[str, Wanted]:
    """Every entry, by the key it serves."""
    base = root / WANTED_DIR
    found = {}
    for path in sorted(base.glob("*/*/*.json")):
        key = str(path.relative_to(base).with_suffix(""))
        if (entry := read_wanted(root, key)) is not None:
            found[key] = entry
    return found


def find(root: Path, key: str, token: str) -> Wanted | None:
    """The copy this node holds for ``key`` fetched for ``token``, or None; whether it is
    intact is for ``verify`` to say."""
    entry = read_wanted(root, key)
    if entry is None or entry.token != token:
        return None
    return entry if (entry.gen_dir(root) / MANIFEST_NAME).is_file() else None


def copies(root: Path) -> list[Path]:
    """Every generation directory under the root (``<ns>/<name>/<arch>/<generation>``)."""
    return sorted(
        p.parent
        for p in root.glob(f"*/*/*/*/{MANIFEST_NAME}")
        if not p.parent.name.startswith(".") and not p.parts[-5].startswith(".")
    )


@contextmanager
def reading(gen_dir: Path) -> Iterator[bool]:
    """Hold a shared lock on a copy while it is read; yields whether it is still there
    (eviction may have removed it between the lookup and the lock)."""
    try:
        fd = os.open(gen_dir, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield (gen_dir / MANIFEST_NAME).is_file()
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def evicting(gen_dir: Path) -> Iterator[bool]:
    """The exclusive lock on a copy, without waiting; yields False when a reader holds it."""
    fd = os.open(gen_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            yield False
            return
        yield True
    finally:
        os.close(fd)
