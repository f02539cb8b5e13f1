"""What a file is, wherever it lies: its digest, its installed distribution's RECORD row, the
standard library's; and where it is found, path-independently (under a ``sys.path`` entry,
the working directory, else its absolute path)."""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import blake3

_real: dict[str, str] = {}


def realpath(path: str) -> str:
    """The path with its directory resolved (each directory once: a record names hundreds
    of files in a few); a file that is itself a link keeps its name, on both sides alike."""
    found = _real.get(path)
    if found is None:
        directory, name = os.path.split(os.path.abspath(path))
        found = _real[path] = os.path.join(_real_directory(directory), name)
    return found


@cache
def _real_directory(directory: str) -> str:
    """``os.path.realpath`` of a directory, one ``lstat`` per component not seen before."""
    parent, name = os.path.split(directory)
    if not name:
        return directory
    found = os.path.join(_real_directory(parent), name)
    return os.path.realpath(found) if os.path.islink(found) else found


def identity_of(path: str) -> str:
    """What a file is, independent of where it lies.

    ``dist <name> <RECORD hash> <size> <mtime_ns> <locator>`` for a file an installed
    distribution lists; ``python <digest> <size> <mtime_ns>`` for the standard library;
    ``<digest>`` for every other file (a project's). Size and modification time let a
    serving process skip hashing installed files that are as they were installed.
    """
    st = os.stat(path)
    key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, path_entries())
    found = _identities.get(key)
    if found is None:
        row = installed_row(path)
        if row is not None:
            name, record_hash, _ = row
            locator = locator_of(path, None)
            found = f"dist {name} {record_hash} {st.st_size} {st.st_mtime_ns} {locator}"
        elif in_python(path):
            found = f"python {file_digest(path)} {st.st_size} {st.st_mtime_ns}"
        else:
            found = file_digest(path)
        _identities[key] = found
    return found


_identities: dict[tuple[Any, ...], str] = {}


_digests: dict[tuple[str, int, int, int, int], str] = {}


_MMAP_FROM = 1 << 20


def file_digest(path: str) -> str:
    """``blake3:<hex>`` of a file, computed once per (dev, inode, size, mtime_ns)."""
    st = os.stat(path)
    key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    found = _digests.get(key)
    if found is None:
        if st.st_size >= _MMAP_FROM:
            # One thread: compiles run in forked workers (b12x's pool) of a process that has
            # observed already, and a hasher's thread pool does not survive a fork: the child
            # would wait on it for ever.
            hasher = blake3.blake3().update_mmap(path)
        else:
            with open(path, "rb") as file:
                hasher = blake3.blake3(file.read())
        found = "blake3:" + hasher.hexdigest()
        _digests[key] = found
    return found


def sha256_of(path: str) -> str:
    """A file's hash as a RECORD writes it."""
    with open(path, "rb") as file:
        hexless = base64.urlsafe_b64encode(hashlib.file_digest(file, "sha256").digest())
    return "sha256=" + hexless.rstrip(b"=").decode()


@cache
def _python_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")})


def in_python(path: str) -> bool:
    """Whether ``path`` is the Python installation's (its standard library)."""
    if "site-packages" in path or "dist-packages" in path:
        return False
    return path.startswith(_python_roots())


@cache
def installed_row(path: str) -> tuple[str, str, str] | None:
    """(distribution, RECORD hash, its .dist-info) when an installed distribution's RECORD
    lists ``path``."""
    directory = os.path.dirname(path)
    while True:
        infos = _site_infos(directory)
        if infos:
            relative = os.path.relpath(path, directory).replace(os.sep, "/")
            top = relative.split("/")[0].partition(".")[0].lower().replace("-", "_")
            for info in _likely_first(infos, top):
                row = _record_rows(info).get(relative)
                if row is not None:
                    return _dist_name(info), row, info
            return None
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent


@cache
def _site_infos(directory: str) -> tuple[str, ...]:
    """The ``.dist-info`` folders of a directory: none unless it is a site directory."""
    try:
        return tuple(sorted(e.path for e in os.scandir(directory) if e.name.endswith(".dist-info")))
    except OSError:
        return ()


@cache
def _likely_first(infos: tuple[str, ...], top: str) -> list[str]:
    """The distributions named like the file's top folder first: RECORDs are read only as
    they are needed (a serving image holds hundreds, torch's alone 15,000 rows)."""

    def named_like(info: str) -> bool:
        name = os.path.basename(info).partition("-")[0].lower()
        return (bool(name) and (top.startswith(name) or name.startswith(top))) or top in _tops(info)

    return sorted(infos, key=lambda info: not named_like(info))


@cache
def _tops(info: str) -> frozenset[str]:
    """The import names a distribution says it installs (``top_level.txt``, where there is one:
    ``yaml`` is PyYAML's)."""
    try:
        with open(os.path.join(info, "top_level.txt"), encoding="utf-8") as file:
            return frozenset(line.strip().lower() for line in file if line.strip())
    except OSError:
        return frozenset()


@cache
def _record_rows(info: str) -> dict[str, str]:
    """relative path -> RECORD hash of one distribution; rows without one own nothing."""
    rows: dict[str, str] = {}
    try:
        with open(os.path.join(info, "RECORD"), encoding="utf-8") as file:
            text = file.read()
    except OSError:
        return rows
    for line in text.splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[1]:
            rows[parts[0].strip('"')] = parts[1]
    return rows


def _dist_name(info: str) -> str:
    stem = os.path.basename(info).removesuffix(".dist-info").rpartition("-")[0]
    return stem.lower().replace("_", "-").replace(".", "-")


def dists_of(paths: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The distributions recorded files belong to: ``name -> {factor: version record=<digest>,
    record: where its RECORD is, stat: its size and mtime}`` (a serving process reads the
    RECORD again only when those differ)."""
    infos = {row[2] for row in map(installed_row, paths) if row is not None}
    found = {}
    for info in sorted(infos):
        record = os.path.join(info, "RECORD")
        st = os.stat(record)
        found[_dist_name(info)] = {
            "factor": _info_factor(info),
            "record": locator_of(record, None),
            "stat": [st.st_size, st.st_mtime_ns],
        }
    return found


@cache
def _info_factor(info: str) -> str:
    """``measure.distribution_factor`` of the distribution at ``info``."""
    from importlib.metadata import PathDistribution

    from kernelcache.measure import record_digest

    version = ""
    with open(os.path.join(info, "METADATA"), encoding="utf-8") as metadata:
        for line in metadata:  # the header only: a METADATA body can be a whole README
            if not line.strip():
                break
            if line.startswith("Version:"):
                version = line.partition(":")[2].strip()
    return f"{version} record={record_digest(PathDistribution(Path(info)))}"


_entries_memo: tuple[tuple[Any, ...], tuple[str, ...]] = ((), ())


def path_entries() -> tuple[str, ...]:
    """``sys.path`` as real directories, recomputed only when it changes."""
    global _entries_memo
    current = (os.getcwd(), *sys.path)
    if _entries_memo[0] != current:
        entries = [os.path.realpath(e or os.curdir) for e in sys.path if isinstance(e, str)]
        _entries_memo = (current, tuple(dict.fromkeys(entries)))
    return _entries_memo[1]


def locator_of(path: str, relative: str | None) -> str:
    """Where a file is found, path-independently: ``pypath:<rel>`` under the first ``sys.path``
    entry that resolves it, ``cwd:<rel>`` when opened relative to the working directory, else
    its absolute path (a system file, the same in every pod of one image)."""
    if relative is not None and not relative.startswith(".."):
        return "cwd:" + relative
    entries = path_entries()
    key = (path, entries)
    found = _locators.get(key)
    if found is None:
        found = _locators[key] = _locate(path, entries)
    return found


_locators: dict[tuple[str, tuple[str, ...]], str] = {}


def _locate(path: str, entries: tuple[str, ...]) -> str:
    """Under the deepest entry that holds the file (site-packages, not a working directory
    that happens to hold a virtual environment: a serving process need not have that one),
    unless an entry searched before it holds the same name."""
    for entry in sorted(entries, key=len, reverse=True):
        if path.startswith(entry + os.sep):
            rel = path[len(entry) + 1 :]
            depth = entries.index(entry)
            if not any(os.path.isfile(os.path.join(e, rel)) for e in entries[:depth]):
                return "pypath:" + rel
    return path


def resolve(locator: str) -> str | None:
    kind, _, rest = locator.partition(":")
    if kind == "pypath":
        for entry in path_entries():
            candidate = os.path.join(entry, rest)
            if os.path.isfile(candidate):
                return candidate
        return None
    if kind == "cwd":
        return os.path.realpath(rest) if os.path.isfile(rest) else None
    return locator if os.path.isfile(locator) else None
