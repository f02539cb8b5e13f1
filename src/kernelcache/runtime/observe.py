"""What a compile actually read, and what of it has moved since: the explanation of a miss.

A CuTe-DSL kernel is keyed by its traced IR (``kernelcache.runtime.cute``): that decides
whether it loads. This record says why a kernel's IR may differ in another process, by
mechanism rather than by name, where it can see it:

- a Python audit hook sees every ``open`` (``exec(open(...).read())``, ``pkgutil.get_data``,
  ``runpy``, a JSON read at import), and every subprocess and socket (what those read cannot
  be seen: noted in the record; not ``ctypes.util.find_library``'s ``ldconfig``, which names
  a library the process then maps); a finder last on ``sys.meta_path`` sees every import
  nothing could satisfy (an optional helper: ``absent``, so that it appearing is a change);
- ``sys.modules`` at the compile names every module loaded, whatever loaded it (a
  ``spec_from_file_location``, a zip archive, a ``.pyc`` without source, a ``.pth`` hook);
- ``/proc/self/maps`` names every shared library mapped since observation began;
- ``os.environ`` reads are seen by name and caller: the ones code outside the Python
  installation and the installed distributions makes, and a toolchain's compile settings.

Each file is recorded by where it resolves (a module by its name, a file relative to the
``sys.path`` entry or working directory it was found under, else its absolute path: no host
path becomes a factor) and by its identity: the digest of a project file's bytes; for a file of
an installed distribution its RECORD hash and the distribution's version and RECORD digest;
for the standard library its digest. ``Checker`` resolves each again in this process, on a
strict miss or for ``kernelcache explain``: a different digest, a module resolving elsewhere
(a local ``profile.py`` shadowing the standard library), a distribution upgraded, a variable
changed is named.

Not recorded, because they cannot change the compiled code: the generation's own files (the
compile's outputs), ``/proc``, ``/sys`` and ``/dev``, bytecode caches beside their source (Python
checks them against it), files the process wrote itself, and kernelcache's own modules (what it
passes to the compile is in the key, whose format is versioned).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import site
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import blake3

__all__ = ["FORMAT", "Checker", "digest", "record", "start", "unobserved_block"]

FORMAT = "kernelcache.dev/observed/v1"
_EVENTS = frozenset({"open", "subprocess.Popen", "os.system", "os.posix_spawn", "socket.connect"})
_MOST_FILES = 100_000  # a long-lived process opening files without end is not recorded forever
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_NOT_FILES = ("/proc/", "/sys/", "/dev/")
_OWN_PACKAGE = "kernelcache"
_OWN_HOOK = "zz_kernelcache_runtime.pth"
# Always looked for: site imports them at start, before anything can observe it.
_SITE_HOOKS = ("sitecustomize", "usercustomize")
# Variables that say where, who or which host: never factors (docs/keys.md).
_HOST_VARIABLES = frozenset(
    {
        "HOME", "PATH", "PWD", "OLDPWD", "TMPDIR", "TMP", "TEMP", "USER", "LOGNAME", "SHELL",
        "HOSTNAME", "LANG", "LANGUAGE", "TZ", "TERM", "COLUMNS", "LINES", "PYTHONPATH",
        "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "CUTE_DSL_ARCH", "PYTHONHASHSEED",
    }
)  # fmt: skip
_HOST_PREFIXES = ("LC_", "KERNELCACHE_", "XDG_", "SSH_")
_LOCATION_WORDS = frozenset({"DIR", "PATH", "HOME", "FILE", "ROOT", "BASE", "WORKSPACE"})


# ------------------------------------------------------------------ observing


@dataclass
class _Observed:
    """Everything the hooks saw since ``start``."""

    started: bool = False
    opened: dict[str, str | None] = field(default_factory=dict)  # path -> cwd-relative form
    written: set[str] = field(default_factory=set)
    absent: set[str] = field(default_factory=set)  # imports no finder found
    env: dict[str, set[str]] = field(default_factory=dict)  # variable -> reading files
    bulk: dict[str, None] = field(default_factory=dict)  # files that read the whole env
    unobserved: dict[str, None] = field(default_factory=dict)
    modules_at_start: frozenset[str] = frozenset()
    maps_at_start: frozenset[str] = frozenset()
    exclude: tuple[str, ...] = ()
    iterating: tuple[Any, int] | None = None


_seen = _Observed()
_start_lock = threading.Lock()
_own_reads = threading.local()  # set while kernelcache itself reads: keying, recording


@contextlib.contextmanager
def unobserved_block() -> Iterator[None]:
    """kernelcache's own reads (keying a kernel, recording, checking): not the kernel's."""
    saved = getattr(_own_reads, "on", False)
    _own_reads.on = True
    try:
        yield
    finally:
        _own_reads.on = saved


def start(exclude: Iterable[str | os.PathLike[str]] = ()) -> None:
    """Observe from now on (once per process; later calls add places to leave out).

    Called as early as the disk layer can: by the warmer before it imports any entry point,
    by ``install()`` before the serving code imports its kernels.
    """
    with _start_lock:
        _seen.exclude = (*_seen.exclude, *(os.path.realpath(p) for p in exclude))
        if _seen.started:
            return
        _seen.modules_at_start = frozenset(sys.modules)
        _seen.maps_at_start = frozenset(_mapped_files())
        _patch_environ()
        sys.meta_path.append(_LastFinder())
        sys.addaudithook(_hook)
        _seen.started = True


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event not in _EVENTS or getattr(_own_reads, "on", False):
        return
    try:
        if event == "open":
            _opened(*args[:3])
        elif event == "socket.connect":
            _seen.unobserved[f"a socket connection to {args[1]!r}: what it read"] = None
        elif not _finding_a_library():
            program = args[0] if args else "?"
            if isinstance(program, (bytes, os.PathLike)):
                program = os.fsdecode(program)
            _seen.unobserved[f"a subprocess ({program}): the files it read"] = None
    except Exception:  # an audit hook that raises aborts the audited call
        pass


def _finding_a_library() -> bool:
    """Whether ``ctypes.util.find_library`` started the subprocess (``ldconfig -p``, ``gcc``
    or ``ld`` asked for a library's file name): what it yields is a name, and the library
    then loaded is mapped, its identity recorded from ``/proc/self/maps``."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "ctypes.util":
            return True
        frame = frame.f_back
    return False


class _LastFinder:
    """Last on ``sys.meta_path``: asked only for a module no other finder found, however the
    import was written (``import``, ``import_module``, ``__import__``)."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> None:
        if not getattr(_own_reads, "on", False):
            _seen.absent.add(name)


def _opened(path: Any, mode: Any, flags: Any) -> None:
    if isinstance(path, int):
        return
    path = os.fsdecode(path)
    absolute = os.path.abspath(path)
    writes = any(c in mode for c in "wax+") if isinstance(mode, str) else flags & _WRITE_FLAGS
    if writes:
        _seen.written.add(absolute)
    elif absolute not in _seen.opened:
        if len(_seen.opened) >= _MOST_FILES:
            _seen.unobserved[f"files opened after the first {_MOST_FILES}"] = None
            return
        _seen.opened[absolute] = None if os.path.isabs(path) else os.path.normpath(path)


def _patch_environ() -> None:
    """Record each variable read from ``os.environ`` (``get``, ``getenv``, ``[]``, ``in``) and
    the file of the code that read it; a whole copy of the environment is a bulk read."""
    environ_type = type(os.environ)
    getitem, iterate = environ_type.__getitem__, environ_type.__iter__

    def __getitem__(self: Any, key: str) -> Any:
        if self is os.environ and isinstance(key, str) and not getattr(_own_reads, "on", False):
            frame = _caller()
            if frame is not None:
                at = _seen.iterating
                if at is not None and at[0] is frame and at[1] == frame.f_lasti:
                    _seen.bulk[frame.f_code.co_filename] = None
                else:
                    _seen.env.setdefault(key, set()).add(frame.f_code.co_filename)
        return getitem(self, key)

    def __iter__(self: Any) -> Iterator[str]:
        if self is os.environ:
            frame = _caller()
            _seen.iterating = None if frame is None else (frame, frame.f_lasti)
        return iterate(self)

    environ_type.__getitem__ = __getitem__  # type: ignore[method-assign]
    environ_type.__iter__ = __iter__  # type: ignore[method-assign]


_PLUMBING = (os.getenv.__code__.co_filename, Mapping.get.__code__.co_filename, __file__)


def _caller() -> FrameType | None:
    """The first frame outside ``os``, the mapping mixins and this module."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _PLUMBING:
        frame = frame.f_back
    return frame


# ------------------------------------------------------------------ the record


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
    roots = (*_seen.exclude, *(os.path.realpath(p) for p in exclude))
    mapped = _mapped_files()
    state = (
        roots,
        kernel_module in _seen.modules_at_start,
        hash(tuple(sys.modules)),  # the names: values may be anything, and id() is audited
        len(_seen.opened),
        len(_seen.written),
        len(_seen.absent),
        sum(map(len, _seen.env.values())),
        tuple(map(os.environ.get, list(_seen.env))),
        len(_seen.unobserved),
        len(_seen.bulk),
        len(mapped),
        _path_entries(),
    )
    if _last[0] != state:
        _last[:] = [state, _take(roots, kernel_module, mapped)]
    return _last[1]  # the same record: its digest is computed once


def _take(roots: tuple[str, ...], kernel_module: str, mapped: set[str]) -> dict[str, Any]:
    notes = dict(_seen.unobserved)
    if not _seen.started:
        notes["everything read before the compile: observation was not started"] = None
    elif kernel_module in _seen.modules_at_start:
        notes[
            f"{kernel_module} was imported before observation began: the files it read "
            "while importing"
        ] = None
    notes.update(
        {f"{file} read the whole environment: the variables it used": None for file in _seen.bulk}
    )
    modules, installed = _modules(roots)
    module_files = {path for path, _ in modules.values() if path}
    files: dict[str, str] = {}
    file_paths: list[str] = []
    candidates = {**_seen.opened, **dict.fromkeys(mapped - _seen.maps_at_start)}
    for opened, relative in candidates.items():
        path = _realpath(opened)
        if path in module_files or opened in _seen.written or _left_out(path, roots):
            continue
        if _is_cached_bytecode(path) or not os.path.isfile(path):
            continue
        files[_locator(path, relative)] = _identity(path)
        file_paths.append(path)
    pth_files = _pth_files()
    pth = {_locator(path, None): file_digest(path) for path in pth_files}  # a few lines each
    owned = [*module_files, *installed, *file_paths]
    return {
        "format": FORMAT,
        "python": sys.version,
        "modules": {name: identity for name, (_, identity) in sorted(modules.items())},
        "files": dict(sorted(files.items())),
        "pth": pth,
        "dists": _dists(path for path in owned if os.path.isfile(path)),
        "env": _environment(),
        "unobserved": sorted(notes),
    }


def digest(observed: dict[str, Any]) -> tuple[str, bytes]:
    """(content address, canonical bytes) of a record; the last one's is kept."""
    if _last_digest[0] is not observed:
        data = json.dumps(observed, sort_keys=True, separators=(",", ":")).encode()
        _last_digest[:] = [observed, (blake3.blake3(data).hexdigest()[:32], data)]
    return _last_digest[1]


_last_digest: list[Any] = [None, None]


def _modules(roots: tuple[str, ...]) -> tuple[dict[str, tuple[str | None, str]], list[str]]:
    """(module -> (its file, identity), the files of the installed modules loaded before
    observation began).

    Every module the import system loaded, and ``absent`` for every project-level import
    that failed (an optional helper that may appear later). One loaded before observation
    began that belongs to the Python installation or a distribution (the warm's own
    machinery: the build, the stamp, a toolchain it asked) is keyed by its distribution, not
    file by file; a project's (one a ``.pth`` hook or ``sitecustomize`` imported) by its file.
    """
    loaded: dict[str, tuple[str | None, str]] = {}
    found: dict[str, tuple[str | None, str]] = {}
    installed: list[str] = []
    for name, module in list(sys.modules.items()):
        # The program (``__main__``, also ``__mp_main__`` under multiprocessing) started the
        # process; it is not the kernel's (a kernel defined in it is keyed by its source).
        if module is None or module is sys.modules.get("__main__") or _own(name):
            continue
        if getattr(module, "__spec__", None) is None:
            continue  # made by another module's code (an extension's submodules): its file's
        seen = _module_entries.get(name)
        if seen is None or seen[0] is not module:  # a module's file is read once, at import
            path, kind = _module_file(module)
            identity = kind or (_identity(path) if path and os.path.isfile(path) else "absent")
            seen = _module_entries[name] = (module, path, identity)
        _, path, identity = seen
        if path is not None and _left_out(path, roots):
            continue
        loaded[name] = (path, identity)
        if name in _seen.modules_at_start and identity.startswith(("dist ", "python ", "builtin")):
            if path is not None:
                installed.append(path)
            continue
        found[name] = (path, identity)
    for name in [*_seen.absent, *_SITE_HOOKS]:
        top = name.partition(".")[0]
        if name in loaded or _own(name) or top in sys.stdlib_module_names:
            continue
        if top not in loaded or not loaded[top][1].startswith(("dist ", "python ")):
            found[top if top not in loaded else name] = (None, "absent")
    return found, installed


_module_entries: dict[str, tuple[ModuleType, str | None, str]] = {}


def _own(name: str) -> bool:
    return name == _OWN_PACKAGE or name.startswith(_OWN_PACKAGE + ".")


def _module_file(module: ModuleType) -> tuple[str | None, str]:
    """(the file a module was loaded from, else None with ``builtin`` or ``namespace``); for
    a module in a zip archive, the archive."""
    spec = getattr(module, "__spec__", None)
    if getattr(spec, "origin", None) in ("built-in", "frozen"):
        return None, "builtin"  # part of the interpreter, even with a __file__ for show
    archive = getattr(getattr(spec, "loader", None), "archive", None)
    if isinstance(archive, str):
        return _realpath(archive), ""
    origin = spec.origin if spec is not None and spec.has_location else None
    origin = origin or getattr(module, "__file__", None)
    if isinstance(origin, str) and origin:
        return _realpath(origin), ""
    if spec is not None and spec.submodule_search_locations is not None:
        return None, "namespace"
    return None, "builtin"


_real: dict[str, str] = {}


def _realpath(path: str) -> str:
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


def _left_out(path: str, roots: tuple[str, ...]) -> bool:
    return path.startswith(_NOT_FILES) or any(
        path == root or path.startswith(root + os.sep) for root in roots
    )


@cache
def _is_cached_bytecode(path: str) -> bool:
    """A ``__pycache__`` file beside its source: the source is what is recorded."""
    directory, name = os.path.split(path)
    if os.path.basename(directory) != "__pycache__" or not name.endswith(".pyc"):
        return False
    source = os.path.join(os.path.dirname(directory), name.partition(".")[0] + ".py")
    return os.path.isfile(source)


def _mapped_files() -> set[str]:
    """Files mapped into this process (shared libraries), from ``/proc/self/maps``."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return set()
    found = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith("(deleted)"):
            found.add(fields[5])
    return found


def _pth_files() -> list[str]:
    """The ``.pth`` files of the site directories (site runs each at interpreter start), less
    copies of kernelcache's own start-up hook: it only installs kernelcache's runtime."""
    directories = [*site.getsitepackages(), site.getusersitepackages()]
    found = []
    for directory in dict.fromkeys(os.path.realpath(d) for d in directories):
        try:
            found += [e.path for e in os.scandir(directory) if e.name.endswith(".pth")]
        except OSError:
            continue
    return sorted(path for path in found if file_digest(path) != _own_hook())


@cache
def _own_hook() -> str | None:
    """The digest of ``zz_kernelcache_runtime.pth``, beside the package in a source tree and
    in site-packages alike."""
    hook = Path(__file__).resolve().parents[2] / _OWN_HOOK
    return file_digest(str(hook)) if hook.is_file() else None


def _environment() -> dict[str, Any]:
    """The variables read by code outside the Python installation and the distributions (the
    kernel's own code), and every toolchain compile setting read by anyone."""
    from kernelcache.settings import SETTING_PREFIX, compile_settings

    read = {
        name
        for name, readers in _seen.env.items()
        if not _host_variable(name) and any(_project_file(f) for f in readers)
    }
    settings = compile_settings({n: os.environ[n] for n in _seen.env if n in os.environ})
    read |= {name.removeprefix(SETTING_PREFIX) for name in settings}
    return {name: _env_value(name) for name in sorted(read)}


def _host_variable(name: str) -> bool:
    return name in _HOST_VARIABLES or name.startswith(_HOST_PREFIXES)


def _env_value(name: str) -> Any:
    """A variable by its meaning: a location is the file it names (its identity), never the
    path; any other value as set (``/opt-level=0`` is an option, not a path)."""
    value = os.environ.get(name)
    if value is None or not _is_location(name, value):
        return value
    path = os.path.realpath(os.path.expanduser(value))
    return {"file": _identity(path)} if os.path.isfile(path) else {"location": None}


def _is_location(name: str, value: str) -> bool:
    if _LOCATION_WORDS & set(name.split("_")):
        return True
    if not value.startswith(("/", "~")):
        return False
    first = os.path.expanduser(value).lstrip("/").split("/")[0]
    return bool(first) and os.path.exists("/" + first)  # /opt/x names a place; /opt-level=0 not


def _project_file(path: str) -> bool:
    if path.startswith("<") or not os.path.isabs(path):
        return False
    path = _realpath(path)
    return not (_installed_row(path) or _in_python(path) or _own_file(path))


def _own_file(path: str) -> bool:
    return path.startswith(os.path.dirname(os.path.dirname(__file__)) + os.sep)


# ------------------------------------------------------------------ identities


def _identity(path: str) -> str:
    """What a file is, independent of where it lies.

    ``dist <name> <RECORD hash> <size> <mtime_ns> <locator>`` for a file an installed
    distribution lists; ``python <digest> <size> <mtime_ns>`` for the standard library;
    ``<digest>`` for every other file (a project's). Size and modification time let a
    serving process skip hashing installed files that are as they were installed.
    """
    st = os.stat(path)
    key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, _path_entries())
    found = _identities.get(key)
    if found is None:
        row = _installed_row(path)
        if row is not None:
            name, record_hash, _ = row
            locator = _locator(path, None)
            found = f"dist {name} {record_hash} {st.st_size} {st.st_mtime_ns} {locator}"
        elif _in_python(path):
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


def _sha256(path: str) -> str:
    """A file's hash as a RECORD writes it."""
    with open(path, "rb") as file:
        hexless = base64.urlsafe_b64encode(hashlib.file_digest(file, "sha256").digest())
    return "sha256=" + hexless.rstrip(b"=").decode()


@cache
def _python_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")})


def _in_python(path: str) -> bool:
    """Whether ``path`` is the Python installation's (its standard library)."""
    if "site-packages" in path or "dist-packages" in path:
        return False
    return path.startswith(_python_roots())


@cache
def _installed_row(path: str) -> tuple[str, str, str] | None:
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


def _dists(paths: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The distributions recorded files belong to: ``name -> {factor: version record=<digest>,
    record: where its RECORD is, stat: its size and mtime}`` (a serving process reads the
    RECORD again only when those differ)."""
    infos = {row[2] for row in map(_installed_row, paths) if row is not None}
    found = {}
    for info in sorted(infos):
        record = os.path.join(info, "RECORD")
        st = os.stat(record)
        found[_dist_name(info)] = {
            "factor": _info_factor(info),
            "record": _locator(record, None),
            "stat": [st.st_size, st.st_mtime_ns],
        }
    return found


@cache
def _info_factor(info: str) -> str:
    """``stamp.distribution_factor`` of the distribution at ``info``."""
    from importlib.metadata import PathDistribution

    from kernelcache.stamp import record_digest

    version = ""
    with open(os.path.join(info, "METADATA"), encoding="utf-8") as metadata:
        for line in metadata:  # the header only: a METADATA body can be a whole README
            if not line.strip():
                break
            if line.startswith("Version:"):
                version = line.partition(":")[2].strip()
    return f"{version} record={record_digest(PathDistribution(Path(info)))}"


_entries_memo: tuple[tuple[Any, ...], tuple[str, ...]] = ((), ())


def _path_entries() -> tuple[str, ...]:
    """``sys.path`` as real directories, recomputed only when it changes."""
    global _entries_memo
    current = (os.getcwd(), *sys.path)
    if _entries_memo[0] != current:
        entries = [os.path.realpath(e or os.curdir) for e in sys.path if isinstance(e, str)]
        _entries_memo = (current, tuple(dict.fromkeys(entries)))
    return _entries_memo[1]


def _locator(path: str, relative: str | None) -> str:
    """Where a file is found, path-independently: ``pypath:<rel>`` under the first ``sys.path``
    entry that resolves it, ``cwd:<rel>`` when opened relative to the working directory, else
    its absolute path (a system file, the same in every pod of one image)."""
    if relative is not None and not relative.startswith(".."):
        return "cwd:" + relative
    entries = _path_entries()
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


def _resolve(locator: str) -> str | None:
    kind, _, rest = locator.partition(":")
    if kind == "pypath":
        for entry in _path_entries():
            candidate = os.path.join(entry, rest)
            if os.path.isfile(candidate):
                return candidate
        return None
    if kind == "cwd":
        return os.path.realpath(rest) if os.path.isfile(rest) else None
    return locator if os.path.isfile(locator) else None


# ------------------------------------------------------------------ serving


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
    record = _resolve(recorded["record"])
    if record is not None:
        st = os.stat(record)
        if [st.st_size, st.st_mtime_ns] == recorded["stat"]:
            return None  # its RECORD as it was: the same install
    from kernelcache.stamp import distribution_factor

    here = distribution_factor(name)
    if here == recorded["factor"]:
        return None
    return f"distribution {name} is {here}, it was compiled with {recorded['factor']}"


def _check_env(name: str, recorded: Any) -> str | None:
    here = _env_value(name)
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
        path, kind = _module_file(module)
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
    path = _resolve(locator)
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
        return _sha256(path) == words[2]
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
    return path.endswith(os.sep + rest) and path[: -len(rest) - 1] in _path_entries()


def _pth_problem(recorded: dict[str, str]) -> str | None:
    here = {_locator(path, None): path for path in _pth_files()}
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
