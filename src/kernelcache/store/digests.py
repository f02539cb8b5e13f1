"""Digests: the blake3 of each file (read once, mapped or copied), and the generation id
they add up to."""

from __future__ import annotations

import mmap
import os
import secrets
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from kernelcache.store.fs import (
    io_errors,
    open_regular,
    parallel,
    regular_files,
    shareable_mode,
    write_all,
)

_GENERATION_ID_CHARS = 32

_CHUNK = 256 << 10  # fits in L2: measured faster than 1-16 MiB reads
# Files above this hash on several threads, in bigger reads; smaller ones are already
# parallel across files.
_BIG_FILE = 64 << 20
_BIG_CHUNK = 16 << 20
# Files from this size are hashed from a memory map when only the digest is needed.
_MAP_FROM = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative POSIX path under files/
    size: int
    digest: str  # "blake3:<hex>"


def chunk_buffer() -> bytearray:
    """A read buffer for ``copy_file``, to reuse across the files one thread copies."""
    return bytearray(_CHUNK)


def _hash_fd(
    fd: int,
    size_hint: int,
    sink: Callable[[memoryview], None] | None = None,
    buf: bytearray | None = None,
) -> tuple[str, int]:
    """Digest a file from fd in one pass, handing each chunk to sink (a copy) as it goes.

    A short read that reaches ``size_hint`` (the size fstat gave) ends the file, saving the
    read that would return nothing: most files of a generation fit in one read. A short read
    before that size (a network filesystem may give one) does not.
    """
    # Files are hashed in parallel by the caller's pool; only a file big enough to keep several
    # cores busy on its own is hashed multithreaded (multithreading small updates costs more
    # in coordination than it gains).
    big = size_hint > _BIG_FILE
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if big else 1)
    if sink is None and size_hint >= _MAP_FROM:
        return _hash_mapped(fd, hasher)
    if big or buf is None:
        buf = bytearray(_BIG_CHUNK if big else _CHUNK)
    view = memoryview(buf)
    total = 0
    while n := os.readv(fd, [buf]):
        chunk = view[:n]
        hasher.update(chunk)
        if sink is not None:
            sink(chunk)
        total += n
        if n < len(buf) and total >= size_hint:
            break
    return "blake3:" + hasher.hexdigest(), total


def _hash_mapped(fd: int, hasher: Any) -> tuple[str, int]:
    """Hash a mapped file: no copy into user space, which costs a read ~25% of the hashing
    time. (Copies still read: an error while writing out of a map leaves it pinned.)

    The size is taken from the open file, so a file that grew or shrank since it was listed
    shows as a size or digest mismatch. Truncation while mapped would raise SIGBUS; nothing
    kernelcache does truncates a published file (generations are immutable and removed by
    rename and unlink, which keeps a mapped inode alive).
    """
    size = os.fstat(fd).st_size
    if size == 0:
        return "blake3:" + hasher.hexdigest(), 0
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
        hasher.update(mapped)
    return "blake3:" + hasher.hexdigest(), size


def digest_file(path: str | os.PathLike[str]) -> str:
    """The "blake3:<hex>" digest of a regular file (a symlink is refused)."""
    path = Path(path)
    with io_errors(path):
        fd, st = open_regular(path)
        try:
            return _hash_fd(fd, st.st_size)[0]
        finally:
            os.close(fd)


def digest_one(root: Path, rel: str) -> FileEntry:
    path = root / rel
    with io_errors(path):
        fd, st = open_regular(path)
        try:
            digest, size = _hash_fd(fd, st.st_size)
        finally:
            os.close(fd)
    return FileEntry(rel, size, digest)


def _seal_one(root: Path, rel: str) -> FileEntry:
    """Digest and fsync a staged file, made the generation's own first: a file with other
    hard links (a warmer that linked its cache to elsewhere) is replaced by a copy, and
    every file gets ``shareable_mode``."""
    path = root / rel
    with io_errors(path):
        if os.lstat(path).st_nlink > 1:
            copy = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
            digest, size = copy_file(path, copy)
            os.replace(copy, path)
            return FileEntry(rel, size, digest)
        fd, st = open_regular(path)
        try:
            if stat.S_IMODE(st.st_mode) != shareable_mode(st.st_mode):
                os.fchmod(fd, shareable_mode(st.st_mode))
            digest, size = _hash_fd(fd, st.st_size)
            os.fsync(fd)
        finally:
            os.close(fd)
    return FileEntry(rel, size, digest)


def digest_files(
    root: Path, files: list[tuple[str, int]], workers: int | None, seal: bool
) -> list[FileEntry]:
    """Digest files in parallel; ``seal``: as ``_seal_one`` (the staged files of a publish)."""
    # Largest first, so one big file does not start last and leave the other threads idle.
    ordered = sorted(files, key=lambda f: -f[1])

    def one(item: tuple[str, int]) -> FileEntry:
        return _seal_one(root, item[0]) if seal else digest_one(root, item[0])

    return sorted(parallel(one, ordered, workers), key=lambda e: e.path)


def digest_tree(root: Path, workers: int | None = None) -> list[FileEntry]:
    """Digest every file under root in parallel, sorted by path; symlinks are refused."""
    root = Path(root)
    files, _ = regular_files(root)
    return digest_files(root, files, workers, seal=False)


def generation_id(stamp_digest: str, files: Iterable[FileEntry]) -> str:
    """The content address of a generation: same stamp and same files, same id."""
    hasher = blake3.blake3()
    hasher.update(stamp_digest.encode() + b"\n")
    for entry in sorted(files, key=lambda e: e.path):
        hasher.update(f"{entry.path}\0{entry.size}\0{entry.digest}\n".encode())
    return hasher.hexdigest()[:_GENERATION_ID_CHARS]


def copy_file(
    src: Path,
    dst: Path,
    durable: bool = True,
    *,
    buf: bytearray | None = None,
    dirs: tuple[int, int] | None = None,
) -> tuple[str, int]:
    """Copy src to a new file dst in one read, returning the digest of the bytes copied.
    dst gets ``shareable_mode``, whatever src's mode and the umask.

    ``buf``: a ``chunk_buffer`` to read small files into. ``dirs``: open descriptors of
    src's and dst's directories, for a caller copying many files of one directory (each is
    then opened by its name: no walk of the whole path per file); src and dst still name
    the files in errors.
    """
    src_dir, dst_dir = dirs if dirs is not None else (None, None)
    with io_errors(src):
        fd, st = open_regular(src, src_dir)
    try:
        with io_errors(dst):
            out = os.open(
                dst if dst_dir is None else dst.name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                0o600,
                dir_fd=dst_dir,
            )
        try:
            with io_errors(dst):
                os.fchmod(out, shareable_mode(st.st_mode))

            def write(chunk: memoryview) -> None:
                with io_errors(dst):
                    write_all(out, chunk)

            with io_errors(src):
                digest, size = _hash_fd(fd, st.st_size, write, buf)
            if durable:
                with io_errors(dst):
                    os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return digest, size
