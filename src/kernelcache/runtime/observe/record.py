"""The record of what a compile read, taken from what the hooks saw, and its content address."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from typing import Any

import blake3

from kernelcache.runtime.observe.environment import variables_read
from kernelcache.runtime.observe.hooks import mapped_files, seen_so_far, unobserved_block
from kernelcache.runtime.observe.identity import (
    dists_of,
    file_digest,
    identity_of,
    locator_of,
    path_entries,
    realpath,
)
from kernelcache.runtime.observe.modules import (
    is_cached_bytecode,
    left_out,
    modules_read,
    site_pth_files,
)

FORMAT = "kernelcache.dev/observed/v1"


def record(exclude: Iterable[str | os.PathLike[str]], kernel_module: str) -> dict[str, Any]:
    """What the process has read up to now that can decide a kernel compiled in it.

    ``exclude`` names directories whose files are the compile's outputs (the generation). The
    record is shared with later calls that read nothing new: not to be changed.
    """
    with unobserved_block():
        return _record(exclude, kernel_module)


_last: list[Any] = [None, None]  # (what the process had read, the record of it)


def _record(exclude: Iterable[str | os.PathLike[str]], kernel_module: str) -> dict[str, Any]:
    """The record, taken again only when the process read something new since the last one:
    kernels compiled one after another mostly share theirs."""
    roots = (*seen_so_far.exclude, *(os.path.realpath(p) for p in exclude))
    mapped = mapped_files()
    state = (
        roots,
        kernel_module in seen_so_far.modules_at_start,
        hash(tuple(sys.modules)),  # the names: values may be anything, and id() is audited
        len(seen_so_far.opened),
        len(seen_so_far.written),
        len(seen_so_far.absent),
        sum(map(len, seen_so_far.env.values())),
        tuple(map(os.environ.get, list(seen_so_far.env))),
        len(seen_so_far.unobserved),
        len(seen_so_far.bulk),
        len(mapped),
        path_entries(),
    )
    if _last[0] != state:
        _last[:] = [state, _take(roots, kernel_module, mapped)]
    return _last[1]  # the same record: its digest is computed once


def _take(roots: tuple[str, ...], kernel_module: str, mapped: set[str]) -> dict[str, Any]:
    notes = dict(seen_so_far.unobserved)
    if not seen_so_far.started:
        notes["everything read before the compile: observation was not started"] = None
    elif kernel_module in seen_so_far.modules_at_start:
        notes[
            f"{kernel_module} was imported before observation began: the files it read "
            "while importing"
        ] = None
    notes.update(
        {
            f"{file} read the whole environment: the variables it used": None
            for file in seen_so_far.bulk
        }
    )
    modules, installed = modules_read(roots)
    module_files = {path for path, _ in modules.values() if path}
    files: dict[str, str] = {}
    file_paths: list[str] = []
    candidates = {**seen_so_far.opened, **dict.fromkeys(mapped - seen_so_far.maps_at_start)}
    for opened, relative in candidates.items():
        path = realpath(opened)
        if path in module_files or opened in seen_so_far.written or left_out(path, roots):
            continue
        if is_cached_bytecode(path) or not os.path.isfile(path):
            continue
        files[locator_of(path, relative)] = identity_of(path)
        file_paths.append(path)
    pth_files = site_pth_files()
    pth = {locator_of(path, None): file_digest(path) for path in pth_files}  # a few lines each
    owned = [*module_files, *installed, *file_paths]
    return {
        "format": FORMAT,
        "python": sys.version,
        "modules": {name: identity for name, (_, identity) in sorted(modules.items())},
        "files": dict(sorted(files.items())),
        "pth": pth,
        "dists": dists_of(path for path in owned if os.path.isfile(path)),
        "env": variables_read(),
        "unobserved": sorted(notes),
    }


def digest(observed: dict[str, Any]) -> tuple[str, bytes]:
    """(content address, canonical bytes) of a record; the last one's is kept."""
    if _last_digest[0] is not observed:
        data = json.dumps(observed, sort_keys=True, separators=(",", ":")).encode()
        _last_digest[:] = [observed, (blake3.blake3(data).hexdigest()[:32], data)]
    return _last_digest[1]


_last_digest: list[Any] = [None, None]
