"""Whether what a kernel's compile read is still what this process has: the first entry that
moved, for a strict refusal or ``kernelcache explain``."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3

from kernelcache.runtime.observe.environment import env_value
from kernelcache.runtime.observe.hooks import unobserved_block
from kernelcache.runtime.observe.identity import (
    file_digest,
    locator_of,
    path_entries,
    resolve,
    sha256_of,
)
from kernelcache.runtime.observe.modules import module_file, site_pth_files
from kernelcache.runtime.observe.record import FORMAT


class Checker:
    """Whether the files, distributions and variables a kernel was compiled with are still the
    ones this process has; each entry is checked once per process (the code it runs is the
    code it imported), each record once per content address."""

    def __init__(self) -> None:
        self._records: dict[str, str | None] = {}
        self._entries: dict[tuple[str, str, str], str | None] = {}
        self._lock = threading.Lock()

    def check(self, records: Path, address: Any) -> str | None:
        """None, or one line naming the first thing that differs from the record
        ``records/<address>.json``."""
        if not isinstance(address, str):
            return "no record of what its compile read"
        with self._lock, unobserved_block():
            if address not in self._records:
                self._records[address] = self._check_record(records, address)
            return self._records[address]

    def _check_record(self, records: Path, address: str) -> str | None:
        path = records / f"{address}.json"
        try:
            data = path.read_bytes()
            observed = json.loads(data)
        except (OSError, ValueError):
            return f"its record {path} cannot be read"
        if blake3.blake3(data).hexdigest()[:32] != address or observed.get("format") != FORMAT:
            return f"its record {path} does not match its name"
        if observed["python"] != sys.version:
            return f"compiled under Python {observed['python']!r}, this is {sys.version!r}"
        for kind, entries in (
            ("dist", observed["dists"]),
            ("env", observed["env"]),
            ("module", observed["modules"]),
            ("file", observed["files"]),
        ):
            for key, identity in entries.items():
                problem = self._entry(kind, key, identity)
                if problem is not None:
                    return problem
        return _pth_problem(observed["pth"])

    def _entry(self, kind: str, key: str, identity: Any) -> str | None:
        shown = identity if isinstance(identity, str) else json.dumps(identity, sort_keys=True)
        memo = (kind, key, shown)
        if memo not in self._entries:
            self._entries[memo] = _CHECKS[kind](key, identity)
        return self._entries[memo]


def _check_dist(name: str, recorded: dict[str, Any]) -> str | None:
    record = resolve(recorded["record"])
    if record is not None:
        st = os.stat(record)
        if [st.st_size, st.st_mtime_ns] == recorded["stat"]:
            return None  # its RECORD as it was: the same install
    from kernelcache.measure import distribution_factor

    here = distribution_factor(name)
    if here == recorded["factor"]:
        return None
    return f"distribution {name} is {here}, it was compiled with {recorded['factor']}"


def _check_env(name: str, recorded: Any) -> str | None:
    here = env_value(name)
    if here == recorded:
        return None
    return f"variable {name} is {_shown(here)}, it was compiled with {_shown(recorded)}"


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, dict):
        return "the file it names " + ("(changed)" if "file" in value else "(none)")
    return repr(value)


def _check_module(name: str, recorded: str) -> str | None:
    module = sys.modules.get(name)
    if module is not None:
        path, kind = module_file(module)
    else:
        from kernelcache.sources import find_spec_without_import

        try:
            spec = find_spec_without_import(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            path, kind = None, "absent"
        elif spec.origin in ("built-in", "frozen"):
            path, kind = None, "builtin"
        elif spec.has_location and spec.origin:
            path, kind = os.path.realpath(spec.origin), ""
        else:
            path, kind = None, "namespace"
    if path is None:
        if kind == recorded:
            return None
        return f"module {name} is {kind} here; it was compiled with {_described(recorded)}"
    if recorded in ("absent", "builtin", "namespace"):
        return f"module {name} is {path} here; it was compiled with it {recorded}"
    return _differs(f"module {name}", path, recorded)


def _check_file(locator: str, recorded: str) -> str | None:
    path = resolve(locator)
    if path is None:
        return f"file {_shown_locator(locator)} is gone; the kernel was compiled with it"
    return _differs(f"file {_shown_locator(locator)}", path, recorded)


def _shown_locator(locator: str) -> str:
    return locator.partition(":")[2] if locator.startswith(("pypath:", "cwd:")) else locator


def _described(recorded: str) -> str:
    return recorded if recorded in ("absent", "builtin", "namespace") else "a file"


def _differs(what: str, path: str, recorded: str) -> str | None:
    """None when ``path`` is the file ``recorded`` identifies, else the problem."""
    try:
        if _same(path, recorded):
            return None
    except OSError as exc:
        return f"{what} ({path}) cannot be read: {exc.strerror or exc}"
    return f"{what} ({path}) differs from the one the kernel was compiled with"


def _same(path: str, recorded: str) -> bool:
    words = recorded.split()
    if words[0] == "dist":  # dist <name> <hash> <size> <mtime_ns> <locator>
        st = os.stat(path)
        if not _found_as(path, words[5]):
            return False
        if (str(st.st_size), str(st.st_mtime_ns)) == (words[3], words[4]):
            return True
        return sha256_of(path) == words[2]
    if words[0] == "python":  # python <digest> <size> <mtime_ns>
        st = os.stat(path)
        return (str(st.st_size), str(st.st_mtime_ns)) == (words[2], words[3]) or file_digest(
            path
        ) == words[1]
    return file_digest(path) == recorded


def _found_as(path: str, locator: str) -> bool:
    """Whether ``path`` is where ``locator`` points under some ``sys.path`` entry (a module's
    file, as the import system found it), without asking the file system."""
    kind, _, rest = locator.partition(":")
    if kind != "pypath":
        return path == locator
    return path.endswith(os.sep + rest) and path[: -len(rest) - 1] in path_entries()


def _pth_problem(recorded: dict[str, str]) -> str | None:
    here = {locator_of(path, None): path for path in site_pth_files()}
    for locator in sorted(recorded.keys() | here.keys()):
        if locator not in here:
            return f".pth file {_shown_locator(locator)} is gone; the kernel was compiled with it"
        if locator not in recorded:
            return f".pth file {here[locator]} is new since the kernel was compiled"
        problem = _differs(".pth file", here[locator], recorded[locator])
        if problem is not None:
            return problem
    return None


_CHECKS: dict[str, Callable[[str, Any], str | None]] = {
    "dist": _check_dist,
    "env": _check_env,
    "module": _check_module,
    "file": _check_file,
}
