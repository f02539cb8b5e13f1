"""File primitives of the store: durable and atomic writes, opens that follow no symlink and
block on no FIFO, directory walks that refuse anything but files and directories, and the
one-line StorageError every OSError becomes."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

from kernelcache.errors import StorageError, UnsafePathError
from kernelcache.store.layout import path_problem

T = TypeVar("T")
R = TypeVar("R")


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def storage_error(exc: OSError, path: str | os.PathLike[str]) -> StorageError:
    where = exc.filename if exc.filename is not None else path
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}") if exc.errno else "OSError"
    return StorageError(
        f"{os.fsdecode(where)}: {name} ({one_line(exc.strerror or exc)})",
        path=os.fsdecode(where),
    )


@contextmanager
def io_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn an OSError into a one-line StorageError naming the path and the errno."""
    try:
        yield
    except OSError as exc:
        raise storage_error(exc, path) from exc


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_file_synced(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Create path (it must not exist) holding data, on disk before this returns; its mode is
    exactly mode, whatever the umask (readers of a store may run as another user)."""
    with io_errors(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the names in a directory (a rename, a new file) durable."""
    with io_errors(path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sync_filesystem(path: Path) -> None:
    """Make everything written to path's filesystem durable, in one call: syncfs(2), or
    sync(2) where the C library has no syncfs.

    For a tree of many new files: an fsync per file waits for a journal commit each, which on
    a busy disk cost more than the download that wrote them (a pull of 782 files).
    """
    with io_errors(path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            syncfs = getattr(_libc(), "syncfs", None)
            if syncfs is None:
                os.sync()
            elif syncfs(fd) != 0:
                error = ctypes.get_errno()
                raise OSError(error, os.strerror(error), os.fspath(path))
        finally:
            os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def replace_synced(path: Path, data: bytes, tmp_prefix: str) -> None:
    """Replace path with a file holding data, atomically and durably: the data is written to
    a hidden tmp_prefix* file beside it, fsynced, renamed over path and the directory fsynced.
    A crash leaves path old or new, and at most the hidden file (never a partial path)."""
    tmp = path.parent / f"{tmp_prefix}{secrets.token_hex(4)}"
    try:
        write_file_synced(tmp, data)
        with io_errors(path):
            os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def open_regular(path: Path, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """Open a regular file for reading without following a symlink or blocking on a FIFO
    (``dir_fd``: by its name in that open directory)."""
    try:
        fd = os.open(
            path if dir_fd is None else path.name,
            os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            dir_fd=dir_fd,
        )
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(
                f"{path}: is a symlink (to {link_target(path)!r})", path=str(path)
            ) from exc
        exc.filename = os.fspath(path)  # opened by its name in dir_fd: the whole path in errors
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePathError(f"{path}: not a regular file", path=str(path))
    return fd, st


@contextmanager
def open_dir(root: Path, relative: str) -> Iterator[int]:
    """An open descriptor of ``root/relative``, each of its components opened in the one
    before it and refused if a symlink stands there: a directory swapped for a symlink after
    it was checked, at any depth, is never followed."""
    fd = _open_dir_at(root, root, None)
    path = root
    try:
        for part in filter(None, relative.split("/")):
            path = path / part
            parent, fd = fd, -1
            try:
                fd = _open_dir_at(path, part, parent)
            finally:
                os.close(parent)
        yield fd
    finally:
        if fd >= 0:
            os.close(fd)


def _open_dir_at(path: Path, name: str | Path, dir_fd: int | None) -> int:
    try:
        return os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError as exc:
        # O_DIRECTORY fails a symlink with ENOTDIR before O_NOFOLLOW could with ELOOP
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise UnsafePathError(
                f"{path}: is a symlink (to {link_target(path)!r})", path=str(path)
            ) from exc
        exc.filename = os.fspath(path)  # opened by its name in dir_fd: the whole path in errors
        raise storage_error(exc, path) from exc


def read_regular(path: Path) -> bytes:
    fd, _ = open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def lstat_refusing_symlink(path: Path, why: str) -> os.stat_result | None:
    """lstat a directory of the store's own layout: None when absent; a symlink in its place
    is refused (an UnsafePathError naming its target and ``why`` it must be the store's)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise storage_error(exc, path) from exc
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(
            f"{path}: is a symlink (to {link_target(path)!r}); {why}", path=str(path)
        )
    return st


def shareable_mode(st_mode: int) -> int:
    """The mode a stored or materialized file gets: readable by every user (a serving process
    runs as its own user), executable by all when it was by anyone, writable by none but its
    owner, whatever the warmer's umask or the store's copy holds."""
    return 0o755 if st_mode & 0o111 else 0o644


def parallel(fn: Callable[[T], R], items: Iterable[T], workers: int | None) -> list[R]:
    """Map fn over items on a thread pool, results in input order.

    The first failure cancels what has not started and is re-raised only after the calls
    already running have finished, so the caller can then safely remove what they write to.
    """
    items = list(items)
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(fn, item) for item in items]
        try:
            for future in as_completed(futures):
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return [future.result() for future in futures]


def walk(root: Path) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Every entry under root as (relative POSIX path, entry), never following symlinks."""
    pending = [""]
    while pending:
        rel = pending.pop()
        with os.scandir(root / rel if rel else root) as entries:
            for entry in entries:
                child = f"{rel}/{entry.name}" if rel else entry.name
                yield child, entry
                if entry.is_dir(follow_symlinks=False):
                    pending.append(child)


def regular_files(root: Path) -> tuple[list[tuple[str, int]], list[str]]:
    """(files as (path, size), directories) under root; any other kind of entry is refused."""
    files: list[tuple[str, int]] = []
    dirs: list[str] = []
    with io_errors(root):
        for rel, entry in walk(root):
            if entry.is_symlink():
                raise UnsafePathError(f"{root / rel}: is a symlink", path=str(root / rel))
            if entry.is_dir(follow_symlinks=False):
                dirs.append(rel)
                continue
            if not entry.is_file(follow_symlinks=False):
                raise UnsafePathError(f"{root / rel}: not a regular file", path=str(root / rel))
            problem = path_problem(rel)
            if problem is None and not _encodable(rel):
                problem = "name is not UTF-8"
            if problem is not None:
                raise UnsafePathError(f"{root / rel}: {problem}", path=str(root / rel))
            files.append((rel, entry.stat(follow_symlinks=False).st_size))
    return files, dirs


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def fsync_tree_dirs(root: Path, dirs: list[str], workers: int | None) -> None:
    parallel(fsync_dir, [root / d for d in dirs], workers)
    fsync_dir(root)


def make_dirs(root: Path, rel_files: Iterable[str]) -> list[str]:
    """Create root's subdirectories for rel_files, each listable by every user."""
    dirs = sorted({p for rel in rel_files for p in _parents(rel)})
    for path in [root, *(root / rel for rel in dirs)]:
        with io_errors(path):
            path.mkdir(exist_ok=True)
            path.chmod(0o755)
    return dirs


def _parents(rel: str) -> Iterator[str]:
    parent = rel.rpartition("/")[0]
    while parent:
        yield parent
        parent = parent.rpartition("/")[0]
