"""Observing a process: an audit hook for opens and subprocesses, a last finder for imports
nothing satisfied, ``os.environ`` reads by name and caller; what they saw since ``start``."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

_EVENTS = frozenset({"open", "subprocess.Popen", "os.system", "os.posix_spawn", "socket.connect"})


_MOST_FILES = 100_000  # a long-lived process opening files without end is not recorded forever


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


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


seen_so_far = _Observed()


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
        seen_so_far.exclude = (*seen_so_far.exclude, *(os.path.realpath(p) for p in exclude))
        if seen_so_far.started:
            return
        seen_so_far.modules_at_start = frozenset(sys.modules)
        seen_so_far.maps_at_start = frozenset(mapped_files())
        _patch_environ()
        sys.meta_path.append(_LastFinder())
        sys.addaudithook(_hook)
        seen_so_far.started = True


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event not in _EVENTS or getattr(_own_reads, "on", False):
        return
    try:
        if event == "open":
            _opened(*args[:3])
        elif event == "socket.connect":
            seen_so_far.unobserved[f"a socket connection to {args[1]!r}: what it read"] = None
        elif not _finding_a_library():
            program = args[0] if args else "?"
            if isinstance(program, (bytes, os.PathLike)):
                program = os.fsdecode(program)
            seen_so_far.unobserved[f"a subprocess ({program}): the files it read"] = None
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
            seen_so_far.absent.add(name)


def _opened(path: Any, mode: Any, flags: Any) -> None:
    if isinstance(path, int):
        return
    path = os.fsdecode(path)
    absolute = os.path.abspath(path)
    writes = any(c in mode for c in "wax+") if isinstance(mode, str) else flags & _WRITE_FLAGS
    if writes:
        seen_so_far.written.add(absolute)
    elif absolute not in seen_so_far.opened:
        if len(seen_so_far.opened) >= _MOST_FILES:
            seen_so_far.unobserved[f"files opened after the first {_MOST_FILES}"] = None
            return
        seen_so_far.opened[absolute] = None if os.path.isabs(path) else os.path.normpath(path)


def _patch_environ() -> None:
    """Record each variable read from ``os.environ`` (``get``, ``getenv``, ``[]``, ``in``) and
    the file of the code that read it; a whole copy of the environment is a bulk read."""
    environ_type = type(os.environ)
    getitem, iterate = environ_type.__getitem__, environ_type.__iter__

    def __getitem__(self: Any, key: str) -> Any:
        if self is os.environ and isinstance(key, str) and not getattr(_own_reads, "on", False):
            frame = _caller()
            if frame is not None:
                at = seen_so_far.iterating
                if at is not None and at[0] is frame and at[1] == frame.f_lasti:
                    seen_so_far.bulk[frame.f_code.co_filename] = None
                else:
                    seen_so_far.env.setdefault(key, set()).add(frame.f_code.co_filename)
        return getitem(self, key)

    def __iter__(self: Any) -> Iterator[str]:
        if self is os.environ:
            frame = _caller()
            seen_so_far.iterating = None if frame is None else (frame, frame.f_lasti)
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


def mapped_files() -> set[str]:
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
