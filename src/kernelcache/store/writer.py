"""Immutable, content-addressed generations of kernel caches, published atomically.

Layout under a store root::

    <root>/<namespace>/<name>/<arch>/     one key
        <generation-id>/                  immutable once renamed into place
            files/<toolchain>/...         the cache files
            MANIFEST.json                 what files/ holds: path, size and blake3 of each file
            MANIFEST.json.sig             optional ed25519 signature of MANIFEST.json's bytes
        CURRENT                           the id of the generation readers use
        HISTORY.json                      when each generation was last replaced as CURRENT
        .lock                             flock()ed by the key's one writer
        .staging-<pid>-<rand>/            a generation being built (transient)

A generation id is a hash of the stamp digest and of every file's path, size and digest, so
publishing the same content twice yields the same directory.

Crash safety. A writer builds a generation in a staging directory inside the key directory
(so on the same filesystem), fsyncs every file and directory in it and renames it to its id.
rename(2) is atomic, so a generation directory either does not exist or is complete. Only
then does the writer point CURRENT at it: it writes the id to a temporary file, fsyncs it,
renames it over CURRENT and fsyncs the key directory. A crash at any point therefore leaves
CURRENT naming either the old or the new generation, both complete, never a partial one.
What a crash can leave behind are directories and files under hidden names (``.staging-*``,
``.trash-*``, ``.CURRENT.*``), which no reader looks at and the next writer removes.
Garbage collection never deletes the generation CURRENT names, and removes the others by
first renaming them to a hidden trash name, so a half-deleted generation is never visible
under its id (where a later publish of the same content would otherwise reuse it).

Retention. ``keep`` counts generations besides the current one, newest first by when each
was last current: a rollback target is the generation CURRENT named before, however old its
content. A writer records in HISTORY.json (atomically, before the CURRENT swap) the moment
the outgoing generation stopped being current; a generation never replaced counts from its
``created`` time. A build whose stamp matches a kept generation points CURRENT back at it
(``Writer.make_current_again``) instead of compiling it again.

Readers never lock: CURRENT is replaced atomically, so it always holds one whole id, and the
generation it names is immutable. A reader slow enough for two publishes to pass it may find
its generation collected (with keep >= 2); ``current`` then re-reads CURRENT.

Writers are serialised per key with flock(2) on ``.lock``. The kernel drops the lock when the
holder dies, however it dies, so a stale lock needs no recovery; the pid and host written into
the lock file only serve the message of a writer that timed out waiting. A process forked
(not exec'd) while holding the lock keeps it until that child exits too.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import blake3
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kernelcache.errors import (
    ExitCode,
    IntegrityError,
    KernelCacheError,
    LockedError,
    ManifestError,
    MissingGenerationError,
    SignatureError,
    SpecError,
    StorageError,
    UnsafePathError,
)
from kernelcache.spec import PUBLIC_KEY_FILE, SIGNING_KEY_FILE

__all__ = [
    "COMPLETE_MARKER",
    "CURRENT_NAME",
    "FILES_DIR",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "SIGNATURE_NAME",
    "FileEntry",
    "Manifest",
    "Problem",
    "Store",
    "VerifyResult",
    "Writer",
    "digest_file",
    "digest_tree",
    "generate_keypair",
    "generation_id",
    "load_private_key",
    "load_public_key",
    "materialize",
    "verify",
]

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "kernelcache.dev/manifest/v1"
MANIFEST_NAME = "MANIFEST.json"
SIGNATURE_NAME = "MANIFEST.json.sig"
CURRENT_NAME = "CURRENT"
HISTORY_NAME = "HISTORY.json"
HISTORY_FORMAT = "kernelcache.dev/history/v1"
LOCK_NAME = ".lock"
FILES_DIR = "files"
COMPLETE_MARKER = ".complete"

# Hidden names a crashed writer can leave in a key directory; the next writer removes them.
_TRANSIENT_PREFIXES = (".staging-", ".trash-", ".CURRENT.", ".HISTORY.")

_SEGMENT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_GENERATION_RE = re.compile(r"^[0-9a-f]{16,64}$")
_DIGEST_PATTERN = r"^blake3:[0-9a-f]{64}$"
_CREATED_PATTERN = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z$"
_GENERATION_ID_CHARS = 32

_CHUNK = 256 << 10  # fits in L2: measured faster than 1-16 MiB reads
# Files above this hash on several threads, in bigger reads; smaller ones are already
# parallel across files.
_BIG_FILE = 64 << 20
_BIG_CHUNK = 16 << 20
# Files from this size are hashed from a memory map when only the digest is needed.
_MAP_FROM = 1 << 20

PrivateKeyLike: TypeAlias = "Ed25519PrivateKey | str | os.PathLike[str]"
PublicKeyLike: TypeAlias = "Ed25519PublicKey | str | os.PathLike[str]"

T = TypeVar("T")
R = TypeVar("R")


# --------------------------------------------------------------------------- small helpers


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _storage_error(exc: OSError, path: str | os.PathLike[str]) -> StorageError:
    where = exc.filename if exc.filename is not None else path
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}") if exc.errno else "OSError"
    return StorageError(
        f"{os.fsdecode(where)}: {name} ({_one_line(exc.strerror or exc)})",
        path=os.fsdecode(where),
    )


def _not_writable(exc: PermissionError, key_dir: Path) -> StorageError:
    """EACCES creating a key directory: who owns the nearest existing directory, and the fix.

    A volume whose driver ignores the pod's fsGroup (NFS-style exports, root-owned 0755)
    refuses the compile Job's user the first directory under the store root.
    """
    parent = key_dir
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    info = parent.stat()
    return StorageError(
        f"{_storage_error(exc, key_dir).message}: {parent} is owned by uid {info.st_uid} "
        f"gid {info.st_gid} mode {stat.S_IMODE(info.st_mode):04o}, and this process is uid "
        f"{os.geteuid()} gid {os.getegid()}; a volume that ignores fsGroup needs its owner "
        "set first (Helm: operator.fixStoreOwnership=true; see 'The compile Job cannot "
        "write the volume' in docs/troubleshooting.md)",
        path=os.fsdecode(parent),
    )


@contextmanager
def io_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn an OSError into a one-line StorageError naming the path and the errno."""
    try:
        yield
    except OSError as exc:
        raise _storage_error(exc, path) from exc


def _write_all(fd: int, data: bytes | memoryview) -> None:
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
            _write_all(fd, data)
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


def _open_regular(path: Path) -> tuple[int, os.stat_result]:
    """Open a regular file for reading without following a symlink or blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(
                f"{path}: is a symlink (to {_link_target(path)!r})", path=str(path)
            ) from exc
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePathError(f"{path}: not a regular file", path=str(path))
    return fd, st


def _shareable_mode(st_mode: int) -> int:
    """The mode a stored or materialized file gets: readable by every user (a serving process
    runs as its own user), executable by all when it was by anyone, writable by none but its
    owner, whatever the warmer's umask or the store's copy holds."""
    return 0o755 if st_mode & 0o111 else 0o644


def _mode_problem(st: os.stat_result) -> str | None:
    """Why an entry of a generation is unusable by a non-root reader, or None.

    Root reads a file of mode 0000 and lists a directory of mode 0000, so a check that only
    opens them passes as root while every other reader fails: refuse the mode itself.
    """
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        if not any(mode >> shift & 0o5 == 0o5 for shift in (6, 3, 0)):
            return f"mode {mode:04o}: no user but root can list this directory"
    elif not mode & 0o444:
        return f"mode {mode:04o}: no user but root can read this file"
    return None


def _hard_link_problem(st: os.stat_result) -> str | None:
    """A file of a generation with other names can change through them after it was
    verified (or be another generation's file): each file must be the generation's own."""
    if st.st_nlink > 1:
        return f"has {st.st_nlink} hard links: it can change through a name outside the generation"
    return None


def _hash_fd(
    fd: int, size_hint: int, sink: Callable[[memoryview], None] | None = None
) -> tuple[str, int]:
    """Digest a file from fd in one pass, handing each chunk to sink (a copy) as it goes."""
    # Files are hashed in parallel by the caller's pool; only a file big enough to keep several
    # cores busy on its own is hashed multithreaded (multithreading small updates costs more
    # in coordination than it gains).
    big = size_hint > _BIG_FILE
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if big else 1)
    if sink is None and size_hint >= _MAP_FROM:
        return _hash_mapped(fd, hasher)
    buf = bytearray(_BIG_CHUNK if big else _CHUNK)
    view = memoryview(buf)
    total = 0
    while n := os.readv(fd, [buf]):
        chunk = view[:n]
        hasher.update(chunk)
        if sink is not None:
            sink(chunk)
        total += n
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


def _parallel(fn: Callable[[T], R], items: Iterable[T], workers: int | None) -> list[R]:
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


def _walk(root: Path) -> Iterator[tuple[str, os.DirEntry[str]]]:
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


def _regular_files(root: Path) -> tuple[list[tuple[str, int]], list[str]]:
    """(files as (path, size), directories) under root; any other kind of entry is refused."""
    files: list[tuple[str, int]] = []
    dirs: list[str] = []
    with io_errors(root):
        for rel, entry in _walk(root):
            if entry.is_symlink():
                raise UnsafePathError(f"{root / rel}: is a symlink", path=str(root / rel))
            if entry.is_dir(follow_symlinks=False):
                dirs.append(rel)
                continue
            if not entry.is_file(follow_symlinks=False):
                raise UnsafePathError(f"{root / rel}: not a regular file", path=str(root / rel))
            problem = _path_problem(rel)
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


def _fsync_tree_dirs(root: Path, dirs: list[str], workers: int | None) -> None:
    _parallel(fsync_dir, [root / d for d in dirs], workers)
    fsync_dir(root)


# --------------------------------------------------------------------------- digests


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative POSIX path under files/
    size: int
    digest: str  # "blake3:<hex>"


def digest_file(path: str | os.PathLike[str]) -> str:
    """The "blake3:<hex>" digest of a regular file (a symlink is refused)."""
    path = Path(path)
    with io_errors(path):
        fd, st = _open_regular(path)
        try:
            return _hash_fd(fd, st.st_size)[0]
        finally:
            os.close(fd)


def _digest_one(root: Path, rel: str, fsync: bool) -> FileEntry:
    path = root / rel
    with io_errors(path):
        fd, st = _open_regular(path)
        try:
            digest, size = _hash_fd(fd, st.st_size)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    return FileEntry(rel, size, digest)


def _seal_one(root: Path, rel: str) -> FileEntry:
    """Digest and fsync a staged file, made the generation's own first: a file with other
    hard links (a warmer that linked its cache to elsewhere) is replaced by a copy, and
    every file gets ``_shareable_mode``."""
    path = root / rel
    with io_errors(path):
        if os.lstat(path).st_nlink > 1:
            copy = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
            digest, size = _copy_file(path, copy)
            os.replace(copy, path)
            return FileEntry(rel, size, digest)
        fd, st = _open_regular(path)
        try:
            if stat.S_IMODE(st.st_mode) != _shareable_mode(st.st_mode):
                os.fchmod(fd, _shareable_mode(st.st_mode))
            digest, size = _hash_fd(fd, st.st_size)
            os.fsync(fd)
        finally:
            os.close(fd)
    return FileEntry(rel, size, digest)


def _digest_files(
    root: Path, files: list[tuple[str, int]], workers: int | None, seal: bool
) -> list[FileEntry]:
    """Digest files in parallel; ``seal``: as ``_seal_one`` (the staged files of a publish)."""
    # Largest first, so one big file does not start last and leave the other threads idle.
    ordered = sorted(files, key=lambda f: -f[1])

    def one(item: tuple[str, int]) -> FileEntry:
        return _seal_one(root, item[0]) if seal else _digest_one(root, item[0], fsync=False)

    return sorted(_parallel(one, ordered, workers), key=lambda e: e.path)


def digest_tree(root: Path, workers: int | None = None) -> list[FileEntry]:
    """Digest every file under root in parallel, sorted by path; symlinks are refused."""
    root = Path(root)
    files, _ = _regular_files(root)
    return _digest_files(root, files, workers, seal=False)


def generation_id(stamp_digest: str, files: Iterable[FileEntry]) -> str:
    """The content address of a generation: same stamp and same files, same id."""
    hasher = blake3.blake3()
    hasher.update(stamp_digest.encode() + b"\n")
    for entry in sorted(files, key=lambda e: e.path):
        hasher.update(f"{entry.path}\0{entry.size}\0{entry.digest}\n".encode())
    return hasher.hexdigest()[:_GENERATION_ID_CHARS]


# --------------------------------------------------------------------------- keys and paths


def _key_problem(key: str) -> str | None:
    segments = key.split("/")
    if len(segments) != 3:
        return "must be namespace/name/arch"
    for segment in segments:
        if not _SEGMENT_RE.match(segment):
            return f"segment {segment!r} must match {_SEGMENT_RE.pattern}"
    return None


def _path_problem(path: str) -> str | None:
    """Why a manifest path could escape files/ or be ambiguous, or None when it is safe."""
    if not path:
        return "empty path"
    if "\0" in path:
        return "contains NUL"
    if "\\" in path:
        return "contains a backslash"
    if path.startswith("/"):
        return "absolute path"
    for segment in path.split("/"):
        if segment == "":
            return "empty path segment"
        if segment in (".", ".."):
            return f"{segment!r} segment"
    return None


# --------------------------------------------------------------------------- manifest


def _parse_created(created: str) -> datetime:
    fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if "." in created else "%Y-%m-%dT%H:%M:%SZ"
    return datetime.strptime(created, fmt).replace(tzinfo=timezone.utc)


def _now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _FileModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str
    size: int = Field(ge=0)
    digest: str = Field(pattern=_DIGEST_PATTERN)


class _ManifestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: str
    key: str
    generation: str = Field(pattern=_GENERATION_RE.pattern)
    created: str = Field(pattern=_CREATED_PATTERN)
    stamp: dict[str, Any]
    files: list[_FileModel]
    report: dict[str, Any]
    # Absent only in manifests written before it existed.
    checksum: str | None = Field(default=None, pattern=r"^blake3:[0-9a-f]{64}$")

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value != MANIFEST_FORMAT:
            raise ValueError(f"expected {MANIFEST_FORMAT!r}")
        return value

    @field_validator("key")
    @classmethod
    def _valid_key(cls, key: str) -> str:
        problem = _key_problem(key)
        if problem:
            raise ValueError(problem)
        return key

    @field_validator("created")
    @classmethod
    def _valid_time(cls, created: str) -> str:
        _parse_created(created)  # ValueError for e.g. month 13
        return created

    @field_validator("stamp")
    @classmethod
    def _stamp_has_digest(cls, stamp: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(stamp.get("digest"), str) or not stamp["digest"]:
            raise ValueError("stamp.digest must be a non-empty string")
        return stamp


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@dataclass(frozen=True)
class Manifest:
    format: str
    key: str
    generation: str
    created: str  # RFC 3339, UTC
    stamp: dict[str, Any]
    files: tuple[FileEntry, ...]
    report: dict[str, Any]
    checksum: str | None = field(default=None, compare=False)  # as read; written by to_bytes

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    @property
    def created_at(self) -> datetime:
        return _parse_created(self.created)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "key": self.key,
            "generation": self.generation,
            "created": self.created,
            "stamp": self.stamp,
            "files": [
                {"path": e.path, "size": e.size, "digest": e.digest}
                for e in sorted(self.files, key=lambda e: e.path)
            ],
            "report": self.report,
        }

    def to_bytes(self) -> bytes:
        """Canonical bytes: the same manifest always serialises (and signs) identically."""
        body = self.to_dict()
        body["checksum"] = manifest_checksum(body)
        text = json.dumps(body, sort_keys=True, indent=1, allow_nan=False)
        return (text + "\n").encode("ascii")

    @classmethod
    def parse(cls, data: bytes, source: str) -> Manifest:
        """Parse strictly; every error is one line naming source and the field at fault."""
        manifest = _parse_schema(data, source)
        _check_paths(manifest, source)
        if (problem := _checksum_problem(manifest)) is not None:
            raise ManifestError(f"{source}: {problem}", path=source)
        return manifest


def manifest_checksum(body: dict[str, Any]) -> str:
    """A digest of everything else in a manifest.

    The generation id covers only the stamp's digest and the file list (it must stay the
    same for the same content); this covers the stamp's factors, the warm report and the
    creation time too, so a flipped bit anywhere in an unsigned manifest is found.
    """
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "blake3:" + blake3.blake3(text.encode("ascii")).hexdigest()


def _parse_schema(data: bytes, source: str) -> Manifest:
    """Everything Manifest.parse checks except path safety (verify checks that after the
    signature, so a forged manifest reports a bad signature first)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{source}: not UTF-8 (byte {exc.start})", path=source) from exc
    try:
        obj = json.loads(
            text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant
        )
    except _DuplicateKeyError as exc:
        raise ManifestError(f"{source}: duplicate JSON key {exc}", path=source) from exc
    except json.JSONDecodeError as exc:
        raise ManifestError(
            f"{source}: invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            path=source,
        ) from exc
    except ValueError as exc:
        raise ManifestError(f"{source}: invalid JSON: {exc}", path=source) from exc
    try:
        model = _ManifestModel.model_validate(obj)
    except ValidationError as exc:
        raise ManifestError(_validation_message(exc, source), path=source) from exc

    seen: set[str] = set()
    for f in model.files:
        if f.path in seen:
            raise ManifestError(f"{source}: files: duplicate path {f.path!r}", path=source)
        seen.add(f.path)
    for f in model.files:
        parent = f.path.rpartition("/")[0]
        while parent:
            if parent in seen:
                raise ManifestError(
                    f"{source}: files: {parent!r} is listed as a file and as a directory",
                    path=source,
                )
            parent = parent.rpartition("/")[0]

    return Manifest(
        format=model.format,
        key=model.key,
        generation=model.generation,
        created=model.created,
        stamp=model.stamp,
        files=tuple(
            FileEntry(f.path, f.size, f.digest) for f in sorted(model.files, key=lambda f: f.path)
        ),
        report=model.report,
        checksum=model.checksum,
    )


def _validation_message(exc: ValidationError, source: str) -> str:
    errors = exc.errors()
    first = errors[0]
    where = _one_line(".".join(str(part) for part in first["loc"])) or "(document)"
    message = f"{source}: field {where}: {_one_line(first['msg'])}"
    value = first.get("input")
    if isinstance(value, (str, int, float)) and first["type"] != "missing":
        message += f" (got {_one_line(repr(value))[:80]})"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    return message


def _checksum_problem(manifest: Manifest) -> str | None:
    if manifest.checksum is None or manifest.checksum == manifest_checksum(manifest.to_dict()):
        return None
    return "checksum mismatch: the manifest changed after it was written"


def _check_paths(manifest: Manifest, source: str) -> None:
    for entry in manifest.files:
        problem = _path_problem(entry.path)
        if problem is not None:
            raise UnsafePathError(f"{source}: files: {problem}: {entry.path!r}", path=source)


def _read_regular(path: Path) -> bytes:
    fd, _ = _open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _load_manifest(gen_dir: Path) -> Manifest:
    path = gen_dir / MANIFEST_NAME
    try:
        data = _read_regular(path)
    except FileNotFoundError as exc:
        raise ManifestError(f"{path}: missing", path=str(path)) from exc
    except OSError as exc:
        raise _storage_error(exc, path) from exc
    return Manifest.parse(data, str(path))


# --------------------------------------------------------------------------- signing keys


def _load_key(
    path: str | os.PathLike[str],
    what: str,
    from_pem: Callable[[bytes], object],
    from_raw: Callable[[bytes], object],
) -> object:
    """A key from a PEM file or a file of exactly 32 raw bytes; any failure names the path."""
    name = os.fsdecode(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SignatureError(
            f"{name}: cannot read {what} key: {_one_line(exc.strerror or exc)}", path=name
        ) from exc
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return from_pem(data)
        if len(data) == 32:
            return from_raw(data)
        raise ValueError("neither PEM nor 32 raw bytes")
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise SignatureError(f"{name}: unusable {what} key: {_one_line(exc)}", path=name) from exc


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """An ed25519 private key from a PEM (PKCS#8, unencrypted) file or 32 raw bytes."""
    key = _load_key(
        path,
        "private",
        lambda data: serialization.load_pem_private_key(data, password=None),
        Ed25519PrivateKey.from_private_bytes,
    )
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(
            f"{os.fsdecode(path)}: not an ed25519 private key", path=os.fsdecode(path)
        )
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """An ed25519 public key from a PEM (SubjectPublicKeyInfo) file or 32 raw bytes."""
    key = _load_key(
        path, "public", serialization.load_pem_public_key, Ed25519PublicKey.from_public_bytes
    )
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(
            f"{os.fsdecode(path)}: not an ed25519 public key", path=os.fsdecode(path)
        )
    return key


def generate_keypair(directory: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write a new ed25519 key pair as PEM files; existing files are never overwritten.

    The file names are the signing Secret's keys, so ``kubectl create secret generic NAME
    --from-file=DIR/kernelcache.key --from-file=DIR/kernelcache.pub`` makes a working Secret.
    """
    directory = Path(directory)
    with io_errors(directory):
        directory.mkdir(parents=True, exist_ok=True)
    private = Ed25519PrivateKey.generate()
    priv_path = directory / SIGNING_KEY_FILE
    pub_path = directory / PUBLIC_KEY_FILE
    write_file_synced(
        priv_path,
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        mode=0o600,
    )
    write_file_synced(
        pub_path,
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    )
    return priv_path, pub_path


def _signature_bytes(key: Ed25519PrivateKey, manifest_bytes: bytes) -> bytes:
    return base64.b64encode(key.sign(manifest_bytes)) + b"\n"


# --------------------------------------------------------------------------- verify


@dataclass
class Problem:
    code: ExitCode
    path: str | None
    message: str  # one line, names the file


_ERROR_CLASSES: dict[ExitCode, type[KernelCacheError]] = {
    ExitCode.MISSING_GENERATION: MissingGenerationError,
    ExitCode.INTEGRITY: IntegrityError,
    ExitCode.SIGNATURE: SignatureError,
    ExitCode.MALFORMED_MANIFEST: ManifestError,
    ExitCode.UNSAFE_PATH: UnsafePathError,
    ExitCode.IO: StorageError,
}


@dataclass
class VerifyResult:
    gen_dir: Path
    manifest: Manifest | None
    problems: list[Problem]
    bytes_checked: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        if not self.problems:
            return
        first = self.problems[0]
        message = first.message
        if len(self.problems) > 1:
            message += f" (and {len(self.problems) - 1} more)"
        raise _ERROR_CLASSES.get(first.code, KernelCacheError)(message, path=first.path)


def verify(
    gen_dir: Path,
    *,
    key: str | None = None,
    public_key: PublicKeyLike | None = None,
    require_signature: bool = False,
    workers: int | None = None,
    digests: bool = True,
) -> VerifyResult:
    """Check a generation against its manifest; content problems are returned, not raised.

    Checks, in order: the generation directory is one (not a symlink); the manifest parses;
    its signature (when a key is given or one is required); its paths are safe; with ``key``,
    that the manifest was published for that key under this directory's name
    (``_binding_problem``); files/ holds no symlink, special file, file with other hard links
    or entry only root can read; every listed file is present with its size and digest;
    nothing unlisted is in files/.
    ``digests=False`` skips only the digests, for a caller that materializes next:
    ``materialize`` checks every digest of the bytes it copies, so reading twice is waste.
    """
    started = time.monotonic()
    result = VerifyResult(Path(gen_dir), None, [], 0, 0.0)
    try:
        _verify_into(result, key, public_key, require_signature, workers, digests)
    finally:
        result.seconds = time.monotonic() - started
    return result


def _verify_into(
    result: VerifyResult,
    key: str | None,
    public_key: PublicKeyLike | None,
    require_signature: bool,
    workers: int | None,
    digests: bool,
) -> None:
    gen_dir = result.gen_dir
    problems = result.problems

    def add(code: ExitCode, path: Path | str, what: str) -> None:
        problems.append(Problem(code, str(path), f"{path}: {what}"))

    try:
        gen_st = os.lstat(gen_dir)
    except OSError:
        gen_st = None
    if gen_st is not None and stat.S_ISLNK(gen_st.st_mode):
        add(ExitCode.UNSAFE_PATH, gen_dir, f"is a symlink (to {_link_target(gen_dir)!r})")
        return
    if gen_st is None or not stat.S_ISDIR(gen_st.st_mode):
        add(ExitCode.MISSING_GENERATION, gen_dir, "no such generation directory")
        return
    if (unusable := _mode_problem(gen_st)) is not None:
        add(ExitCode.IO, gen_dir, unusable)
        return
    manifest_path = gen_dir / MANIFEST_NAME
    try:
        data = _read_regular(manifest_path)
        manifest_st = os.lstat(manifest_path)
        if (unusable := _mode_problem(manifest_st)) is not None:
            add(ExitCode.IO, manifest_path, unusable)
            return
        if (shared := _hard_link_problem(manifest_st)) is not None:
            add(ExitCode.UNSAFE_PATH, manifest_path, shared)
            return
    except FileNotFoundError:
        add(ExitCode.MALFORMED_MANIFEST, manifest_path, "missing")
        return
    except UnsafePathError as exc:
        problems.append(Problem(exc.code, exc.path, exc.message))
        return
    except OSError as exc:
        err = _storage_error(exc, manifest_path)
        problems.append(Problem(err.code, err.path, err.message))
        return
    try:
        manifest = _parse_schema(data, str(manifest_path))
    except ManifestError as exc:
        problems.append(Problem(exc.code, exc.path, exc.message))
        return
    result.manifest = manifest

    signature_problem = None
    if public_key is not None or require_signature:
        signature_problem = _signature_problem(gen_dir, data, public_key)
        if signature_problem is not None:
            problems.append(signature_problem)

    try:
        _check_paths(manifest, str(manifest_path))
    except UnsafePathError as exc:
        problems.append(Problem(exc.code, exc.path, exc.message))
        return  # touch no file a manifest path could lead outside the generation
    if signature_problem is None and (altered := _checksum_problem(manifest)) is not None:
        add(ExitCode.MALFORMED_MANIFEST, manifest_path, altered)
        return  # its file list is not to be trusted either
    if key is not None and (foreign := _binding_problem(manifest, key, gen_dir)) is not None:
        add(ExitCode.INTEGRITY, manifest_path, foreign)
        return  # another key's generation: what it holds is not this key's to check
    files_root = gen_dir / FILES_DIR
    on_disk: dict[str, int] = {}
    flagged: set[str] = set()  # symlinks and special files, already reported
    try:
        if files_root.is_symlink():
            add(ExitCode.UNSAFE_PATH, files_root, "is a symlink")
            return
        if files_root.exists():
            if (unusable := _mode_problem(os.lstat(files_root))) is not None:
                add(ExitCode.IO, files_root, unusable)
                return
            for rel, dirent in _walk(files_root):
                if dirent.is_symlink():
                    target = os.readlink(dirent.path)
                    add(ExitCode.UNSAFE_PATH, dirent.path, f"is a symlink (to {target!r})")
                    flagged.add(rel)
                    continue
                st = dirent.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    on_disk[rel] = st.st_size
                    if (shared := _hard_link_problem(st)) is not None:
                        add(ExitCode.UNSAFE_PATH, dirent.path, shared)
                        flagged.add(rel)
                elif not stat.S_ISDIR(st.st_mode):
                    add(ExitCode.INTEGRITY, dirent.path, "not a regular file")
                    flagged.add(rel)
                    continue
                if rel not in flagged and (unusable := _mode_problem(st)) is not None:
                    add(ExitCode.IO, dirent.path, unusable)
                    flagged.add(rel)
    except OSError as exc:
        err = _storage_error(exc, files_root)
        problems.append(Problem(err.code, err.path, err.message))
        return

    def under_flagged(rel: str) -> bool:
        while rel:
            if rel in flagged:
                return True
            rel = rel.rpartition("/")[0]
        return False

    to_digest: list[FileEntry] = []
    for entry in manifest.files:
        path = files_root / entry.path
        if under_flagged(entry.path):
            continue
        if entry.path not in on_disk:
            add(ExitCode.INTEGRITY, path, "missing")
        elif on_disk[entry.path] != entry.size:
            add(ExitCode.INTEGRITY, path, f"size {on_disk[entry.path]} != manifest {entry.size}")
        else:
            to_digest.append(entry)

    def check(entry: FileEntry) -> tuple[int, Problem | None]:
        path = files_root / entry.path
        try:
            actual = _digest_one(files_root, entry.path, fsync=False)
        except KernelCacheError as exc:
            return 0, Problem(exc.code, exc.path, exc.message)
        if actual.digest != entry.digest:
            return actual.size, Problem(ExitCode.INTEGRITY, str(path), f"{path}: digest mismatch")
        return actual.size, None

    ordered = sorted(to_digest, key=lambda e: -e.size) if digests else []
    outcomes = dict(zip((e.path for e in ordered), _parallel(check, ordered, workers), strict=True))
    for entry in ordered:
        size, problem = outcomes[entry.path]
        result.bytes_checked += size
        if problem is not None:
            problems.append(problem)

    listed = {entry.path for entry in manifest.files}
    for rel in sorted(set(on_disk) - listed):
        add(ExitCode.INTEGRITY, files_root / rel, "not in manifest")
    # Last, so that an edited entry is reported by its file's name before this.
    content_id = generation_id(manifest.stamp["digest"], manifest.files)
    if content_id != manifest.generation:
        add(
            ExitCode.INTEGRITY,
            manifest_path,
            f"generation {manifest.generation} does not match its content ({content_id})",
        )


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _binding_problem(manifest: Manifest, key: str, gen_dir: Path) -> str | None:
    """Why a generation is not the one ``key`` may serve, naming both sides; None when it is.

    A manifest names the key it was published for (namespace, name and arch), and the
    signature and checksum cover that with the rest of its bytes; neither covers the
    directory the generation lies in. So a generation of another KernelCache or another
    arch, copied or replayed into this key (with its signature intact), is refused here
    rather than served. The directory must also be named by the manifest's generation id:
    CURRENT names a directory, and that directory must hold that generation.
    """
    if manifest.key != key:
        return f"published for key {manifest.key}, not for {key}"
    if gen_dir.name != manifest.generation:
        return f"holds generation {manifest.generation}, not {gen_dir.name} (its directory name)"
    return None


def _signature_problem(
    gen_dir: Path, manifest_bytes: bytes, public_key: PublicKeyLike | None
) -> Problem | None:
    sig_path = gen_dir / SIGNATURE_NAME

    def problem(what: str) -> Problem:
        return Problem(ExitCode.SIGNATURE, str(sig_path), f"{sig_path}: {what}")

    if public_key is None:
        return problem("signature required but no public key to check it with")
    if not isinstance(public_key, Ed25519PublicKey):
        try:
            public_key = load_public_key(public_key)
        except SignatureError as exc:
            return Problem(exc.code, exc.path, exc.message)
    try:
        encoded = _read_regular(sig_path)
    except FileNotFoundError:
        return problem("missing")
    except (OSError, UnsafePathError) as exc:
        return problem(f"unreadable: {_one_line(exc)}")
    try:
        signature = base64.b64decode(encoded.removesuffix(b"\n"), validate=True)
    except ValueError:
        return problem("not base64")
    if encoded != base64.b64encode(signature) + b"\n":  # exactly as written: no byte may change
        return problem("not in its written form (base64 and one newline)")
    try:
        public_key.verify(signature, manifest_bytes)
    except InvalidSignature:
        return problem(f"does not match {MANIFEST_NAME}")
    return None


# --------------------------------------------------------------------------- copying


def _copy_file(src: Path, dst: Path, durable: bool = True) -> tuple[str, int]:
    """Copy src to a new file dst in one read, returning the digest of the bytes copied.
    dst gets ``_shareable_mode``, whatever src's mode and the umask."""
    with io_errors(src):
        fd, st = _open_regular(src)
    try:
        with io_errors(dst):
            out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with io_errors(dst):
                os.fchmod(out, _shareable_mode(st.st_mode))

            def write(chunk: memoryview) -> None:
                with io_errors(dst):
                    _write_all(out, chunk)

            with io_errors(src):
                digest, size = _hash_fd(fd, st.st_size, write)
            if durable:
                with io_errors(dst):
                    os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return digest, size


def _make_dirs(root: Path, rel_files: Iterable[str]) -> list[str]:
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


def materialize(
    gen_dir: Path,
    manifest: Manifest,
    target: Path,
    workers: int | None = None,
    *,
    durable: bool = True,
) -> Path:
    """Copy a generation into target/<generation-id>/, checking every byte as it is copied.

    The copy is built in a hidden target/.partial-* directory and renamed into place only
    when complete (with its .complete marker written last), so an interrupted or failed copy
    never leaves anything that looks valid. Returns at once if the copy already exists.
    ``durable=False`` skips the fsyncs, for a target that does not outlive a crash anyway (a
    pod's emptyDir): syncing costs about as much as the copy itself.
    """
    gen_dir, target = Path(gen_dir), Path(target)
    result = target / manifest.generation
    if (result / COMPLETE_MARKER).is_file():
        return result
    with io_errors(target):
        target.mkdir(parents=True, exist_ok=True)
    partial = target / f".partial-{secrets.token_hex(4)}"
    try:
        with io_errors(partial):
            partial.mkdir()
            partial.chmod(0o755)  # the serving user lists it, whatever the umask
        _copy_manifest(gen_dir, manifest, partial)
        src_root, dst_root = gen_dir / FILES_DIR, partial / FILES_DIR
        dirs = _make_dirs(dst_root, (e.path for e in manifest.files))

        def copy(entry: FileEntry) -> None:
            src = src_root / entry.path
            try:
                digest, size = _copy_file(src, dst_root / entry.path, durable)
            except StorageError as exc:
                if exc.path == str(src) and isinstance(exc.__cause__, FileNotFoundError):
                    raise IntegrityError(f"{src}: missing", path=str(src)) from exc
                raise
            if size != entry.size:
                raise IntegrityError(f"{src}: size {size} != manifest {entry.size}", path=str(src))
            if digest != entry.digest:
                raise IntegrityError(f"{src}: digest mismatch", path=str(src))

        _parallel(copy, sorted(manifest.files, key=lambda e: -e.size), workers)
        write_file_synced(partial / COMPLETE_MARKER, f"{manifest.generation}\n".encode())
        if durable:
            _fsync_tree_dirs(dst_root, dirs, workers)
            fsync_dir(partial)
        if result.exists():  # no marker: not ours, or not complete; never reuse it
            stale = target / f".partial-{secrets.token_hex(4)}"
            with io_errors(result):
                os.rename(result, stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(partial, result)
        except OSError as exc:
            # Another copy of the same generation finished first: use it.
            if (
                exc.errno in (errno.EEXIST, errno.ENOTEMPTY)
                and (result / COMPLETE_MARKER).is_file()
            ):
                shutil.rmtree(partial, ignore_errors=True)
                return result
            raise _storage_error(exc, result) from exc
        fsync_dir(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return result


def _copy_manifest(gen_dir: Path, manifest: Manifest, dst: Path) -> None:
    """Copy MANIFEST.json (and its signature) byte for byte, so the copy verifies the same.
    The bytes must still be the manifest the caller verified."""
    path = gen_dir / MANIFEST_NAME
    with io_errors(path):
        data = _read_regular(path)
    if Manifest.parse(data, str(path)) != manifest:
        raise IntegrityError(f"{path}: changed since it was verified", path=str(path))
    write_file_synced(dst / MANIFEST_NAME, data)
    sig = gen_dir / SIGNATURE_NAME
    if sig.is_file():
        with io_errors(sig):
            write_file_synced(dst / SIGNATURE_NAME, _read_regular(sig))


# --------------------------------------------------------------------------- the store


def _created_or_oldest(manifest: Manifest | None) -> datetime:
    return manifest.created_at if manifest else datetime.min.replace(tzinfo=timezone.utc)


class Store:
    """A directory of keys, each holding immutable generations and a CURRENT pointer."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).absolute()

    def key_dir(self, key: str) -> Path:
        problem = _key_problem(key)
        if problem is not None:
            raise SpecError(f"key {key!r}: {problem}")
        return self.root / key

    def keys(self) -> list[str]:
        """Keys with a published generation."""
        found = []
        for current in self.root.glob(f"*/*/*/{CURRENT_NAME}"):
            key = current.parent.relative_to(self.root).as_posix()
            if _key_problem(key) is None and current.is_file():
                found.append(key)
        return sorted(found)

    def _read_current(self, key_dir: Path) -> str | None:
        path = key_dir / CURRENT_NAME
        try:
            # Not through a symlink (CURRENT would name another key's generation), and
            # never blocking on a FIFO.
            text = _read_regular(path).decode("ascii", errors="replace").strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _storage_error(exc, path) from exc
        if not _GENERATION_RE.match(text):
            raise IntegrityError(f"{path}: not a generation id: {text[:40]!r}", path=str(path))
        return text

    def current(self, key: str) -> Path | None:
        """The generation directory CURRENT names, or None before the first publish.

        Every name from the root down to the generation must be what it says (a directory,
        CURRENT a regular file), never a symlink: one would lead to another key's
        generation, or out of the store (``_check_key_path``).
        """
        key_dir = self.key_dir(key)
        self._check_key_path(key)
        gen_id = self._read_current(key_dir)
        for _ in range(3):
            if gen_id is None:
                return None
            if _is_real_dir(key_dir / gen_id):
                return key_dir / gen_id
            # Collected after we read CURRENT: CURRENT must have moved on since.
            again = self._read_current(key_dir)
            if again == gen_id:
                break
            gen_id = again
        raise MissingGenerationError(
            f"{key_dir / CURRENT_NAME}: names generation {gen_id}, which does not exist",
            path=str(key_dir / CURRENT_NAME),
        )

    def _check_key_path(self, key: str) -> None:
        """Refuse a key whose namespace, name or arch directory is a symlink or no directory.

        The root itself may be a symlink (a mount point chosen by whoever runs kernelcache);
        below it the store's own layout is trusted only as kernelcache writes it.
        """
        path = self.root
        for segment in key.split("/"):
            path = path / segment
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return  # nothing published there yet
            except OSError as exc:
                raise _storage_error(exc, path) from exc
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePathError(
                    f"{path}: is a symlink (to {_link_target(path)!r}); a key's directories "
                    "must be the store's own",
                    path=str(path),
                )
            if not stat.S_ISDIR(st.st_mode):
                raise StorageError(f"{path}: not a directory", path=str(path))

    def current_manifest(self, key: str) -> Manifest | None:
        gen_dir = self.current(key)
        return None if gen_dir is None else _load_manifest(gen_dir)

    def generations(self, key: str) -> list[Manifest]:
        """The manifests of the key's readable generations, oldest first."""
        return [m for _, m in self._generation_dirs(key) if m is not None]

    def _generation_dirs(self, key: str) -> list[tuple[Path, Manifest | None]]:
        """Every generation directory with its manifest (None when unreadable: such a
        generation sorts oldest), oldest first."""
        key_dir = self.key_dir(key)
        try:
            entries = list(os.scandir(key_dir))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise _storage_error(exc, key_dir) from exc
        found = []
        for entry in entries:
            if _GENERATION_RE.match(entry.name) and entry.is_dir(follow_symlinks=False):
                path = Path(entry.path)
                try:
                    manifest: Manifest | None = _load_manifest(path)
                except KernelCacheError:
                    manifest = None
                found.append((path, manifest))
        return sorted(found, key=lambda g: (_created_or_oldest(g[1]), g[0].name))

    @contextmanager
    def writer(
        self,
        key: str,
        timeout: float | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> Iterator[Writer]:
        """Hold the key's writer lock; waits at most timeout seconds (None: forever).

        ``on_wait`` is told who holds the lock when it is taken, before the wait begins.
        """
        key_dir = self.key_dir(key)
        lock_path = key_dir / LOCK_NAME
        self._check_key_path(key)  # never publish into another key through a symlink
        with io_errors(key_dir):
            try:
                key_dir.mkdir(parents=True, exist_ok=True)
            except PermissionError as exc:
                raise _not_writable(exc, key_dir) from exc
            # Not through a symlink: the holder truncates the lock file to write its pid.
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            if on_wait is not None and not _try_lock(fd, lock_path):
                on_wait(_holder(fd))
            _lock(fd, lock_path, key, timeout)
            _remove_transient(key_dir)
            writer = Writer(self, key)
            try:
                yield writer
            finally:
                writer._close()
        finally:
            os.close(fd)  # releases the lock

    def gc(
        self, key: str, keep: int, timeout: float | None = None, dry_run: bool = False
    ) -> list[str]:
        """Remove all generations but the one CURRENT names and the `keep` most recently
        current besides it (``rollback_order``); ``dry_run`` removes nothing and returns what
        would be removed."""
        with self.writer(key, timeout=timeout):
            return self._gc_locked(key, keep, dry_run)

    def rollback_order(self, key: str) -> list[tuple[Path, Manifest | None]]:
        """The key's generations other than the current one, the most recently current first
        (the one CURRENT named before comes first: the rollback target)."""
        key_dir = self.key_dir(key)
        current = self._read_current(key_dir)  # a corrupt CURRENT raises: nothing to order
        history = _read_history(key_dir)
        others = [g for g in self._generation_dirs(key) if g[0].name != current]
        return sorted(others, key=lambda g: (_last_current(g, history), g[0].name), reverse=True)

    def _gc_locked(self, key: str, keep: int, dry_run: bool = False) -> list[str]:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, not {keep}")
        key_dir = self.key_dir(key)
        removed = []
        for path, _ in self.rollback_order(key)[keep:]:
            if not dry_run:
                _trash(key_dir, path)
            removed.append(path.name)
        return removed


def _is_real_dir(path: Path) -> bool:
    """A directory, not a symlink to one; a symlink under a generation's name is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise _storage_error(exc, path) from exc
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(
            f"{path}: is a symlink (to {_link_target(path)!r}); a generation must be a "
            "directory of its key",
            path=str(path),
        )
    return stat.S_ISDIR(st.st_mode)


def _read_history(key_dir: Path) -> dict[str, datetime]:
    """HISTORY.json: generation id -> when it was last replaced as CURRENT.

    Only ordering depends on it, never what is served, so an unreadable or malformed history
    counts as empty (with a warning): generations then order by their creation time.
    """
    path = key_dir / HISTORY_NAME
    try:
        doc = json.loads(_read_regular(path))
        if doc.get("format") != HISTORY_FORMAT:
            raise ValueError(f"format is not {HISTORY_FORMAT!r}")
        return {
            gen: _parse_created(when)
            for gen, when in doc["replaced"].items()
            if _GENERATION_RE.match(gen)
        }
    except FileNotFoundError:
        return {}
    except (OSError, KernelCacheError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("%s: ignored (%s); generations order by creation time", path, exc)
        return {}


def _record_replaced(key_dir: Path, outgoing: str) -> None:
    """Record that outgoing stops being CURRENT now; only a lock holder calls this, before
    the CURRENT swap (a crash in between leaves a record for a generation still current,
    which orders nothing: the current one is always kept). Entries of generations no longer
    in the key are dropped."""
    history = _read_history(key_dir)
    history[outgoing] = datetime.now(timezone.utc)
    doc = {
        "format": HISTORY_FORMAT,
        "replaced": {
            gen: when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            for gen, when in sorted(history.items())
            if os.path.lexists(key_dir / gen)
        },
    }
    tmp = key_dir / f".HISTORY.{os.getpid()}-{secrets.token_hex(4)}"
    try:
        write_file_synced(tmp, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
        with io_errors(key_dir / HISTORY_NAME):
            os.replace(tmp, key_dir / HISTORY_NAME)
    except BaseException:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(key_dir)  # on disk before CURRENT moves on


def _last_current(
    generation: tuple[Path, Manifest | None], history: dict[str, datetime]
) -> datetime:
    """When a generation was last current: when it was last replaced, else (never replaced,
    or replaced before the history was kept) when it was created."""
    path, manifest = generation
    created = _created_or_oldest(manifest)
    replaced = history.get(path.name)
    return max(created, replaced) if replaced is not None else created


def _try_lock(fd: int, lock_path: Path) -> bool:
    """Take the lock if it is free; False when another writer holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        raise _storage_error(exc, lock_path) from exc
    return True


def _lock(fd: int, lock_path: Path, key: str, timeout: float | None) -> None:
    if timeout is None:
        with io_errors(lock_path):
            fcntl.flock(fd, fcntl.LOCK_EX)
    else:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LockedError(
                        f"{key}: another writer holds {lock_path} ({_holder(fd)});"
                        f" gave up after {timeout:g}s",
                        path=str(lock_path),
                    ) from None
                time.sleep(min(0.02, remaining))
            except OSError as exc:
                raise _storage_error(exc, lock_path) from exc
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError as exc:
        # Only a diagnostic: a full disk must not stop the writer that would free space.
        log.warning("could not record the lock holder in %s: %s", lock_path, exc)


def _holder(fd: int) -> str:
    try:
        fields = os.pread(fd, 256, 0).decode(errors="replace").split()
    except OSError:
        fields = []
    if len(fields) >= 2:
        return f"pid {fields[0]} on {fields[1]}"
    return f"pid {fields[0]}" if fields else "holder unknown"


def _remove_transient(key_dir: Path) -> None:
    """Remove what writers that died left behind; only a lock holder may call this.

    Best effort: a dead writer's warmer can outlive it and go on writing into its staging
    directory, which then cannot be removed yet. Under its hidden name it is in no one's way,
    and the next writer tries again.
    """
    with io_errors(key_dir):
        entries = [e for e in os.scandir(key_dir) if e.name.startswith(_TRANSIENT_PREFIXES)]
    for entry in entries:
        log.info("removing leftover %s", entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError as exc:
            log.warning("could not remove leftover %s yet: %s", entry.path, exc)


def _trash(key_dir: Path, path: Path) -> None:
    """Delete a directory so that it is never seen half-deleted under its own name."""
    trash = key_dir / f".trash-{path.name}-{secrets.token_hex(4)}"
    with io_errors(path):
        os.rename(path, trash)
    fsync_dir(key_dir)
    with io_errors(trash):
        if trash.is_symlink() or not trash.is_dir():  # a symlink or file under an id
            trash.unlink()
        else:
            shutil.rmtree(trash)


def _private_key(signing_key: PrivateKeyLike | None) -> Ed25519PrivateKey | None:
    if signing_key is None or isinstance(signing_key, Ed25519PrivateKey):
        return signing_key
    return load_private_key(signing_key)


class Writer:
    """The holder of a key's writer lock; valid only inside ``Store.writer``."""

    def __init__(self, store: Store, key: str) -> None:
        self.store = store
        self.key = key
        self.key_dir = store.key_dir(key)
        self._stagings: set[Path] = set()
        self._open = True

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(f"writer for {self.key} used after its lock was released")

    def _close(self) -> None:
        for staging in list(self._stagings):
            self._discard(staging)
        self._open = False

    def _discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)
        self._stagings.discard(staging)

    def current_manifest(self) -> Manifest | None:
        return self.store.current_manifest(self.key)

    def staging(self) -> Path:
        """A fresh, empty files/ directory to build a generation in; publish it or lose it
        when the writer closes. It lies inside the key directory so that publishing is a
        rename on one filesystem."""
        self._check_open()
        root = self.key_dir / f".staging-{os.getpid()}-{secrets.token_hex(4)}"
        with io_errors(root):
            root.mkdir()
            self._stagings.add(root)
            (root / FILES_DIR).mkdir()
            for path in (root, root / FILES_DIR):
                path.chmod(0o755)
        return root / FILES_DIR

    def publish(
        self,
        files_dir: Path,
        stamp: dict[str, Any],
        report: dict[str, Any],
        signing_key: PrivateKeyLike | None = None,
        keep: int = 2,
        workers: int | None = None,
    ) -> Manifest:
        """Publish files_dir as the key's CURRENT generation and collect old ones.

        files_dir is ideally a directory from ``staging()`` (moved, not copied); any other
        directory is copied in. On an I/O error a StorageError naming the path and errno is
        raised and CURRENT and every existing generation are left as they were.
        """
        self._check_open()
        stamp_digest = stamp.get("digest")
        if not isinstance(stamp_digest, str) or not stamp_digest:
            raise ValueError("stamp has no 'digest'")
        if keep < 0:
            raise ValueError(f"keep must be >= 0, not {keep}")
        signing_key = _private_key(signing_key)

        files_dir = Path(files_dir).absolute()
        staging = files_dir.parent
        if staging not in self._stagings or files_dir.name != FILES_DIR:
            staging = self.staging().parent
        try:
            entries = self._fill(staging / FILES_DIR, files_dir, workers)
            manifest = Manifest(
                format=MANIFEST_FORMAT,
                key=self.key,
                generation=generation_id(stamp_digest, entries),
                created=_now_rfc3339(),
                stamp=stamp,
                files=tuple(entries),
                report=report,
            )
            data = manifest.to_bytes()
            write_file_synced(staging / MANIFEST_NAME, data)
            if signing_key is not None:
                write_file_synced(staging / SIGNATURE_NAME, _signature_bytes(signing_key, data))
            fsync_dir(staging)
            manifest, created_new = self._install(staging, manifest, signing_key, workers)
        except BaseException:
            self._discard(staging)
            raise

        gen_dir = self.key_dir / manifest.generation
        try:
            self._point_current(manifest.generation)
        except BaseException:
            if created_new and self._current_or_none() != manifest.generation:
                # CURRENT still names the old one: take back the new one
                with suppress(StorageError):
                    _trash(self.key_dir, gen_dir)
            raise
        self._collect(keep, gen_dir)
        return manifest

    def make_current_again(
        self,
        stamp_digest: str,
        signing_key: PrivateKeyLike | None = None,
        keep: int = 2,
        workers: int | None = None,
    ) -> Manifest | None:
        """Point CURRENT back at a kept generation built with this stamp, without building.

        A reverted spec or engine image finds its generation still in the store: of those
        with this stamp digest, the most recently current one that verifies for this key is
        made current (re-signed with signing_key when given, as a re-publish would), then old
        generations are collected. None when no kept generation has the stamp. The swap is
        the same as a publish's: a crash leaves CURRENT naming the old or the kept one.
        """
        self._check_open()
        signing_key = _private_key(signing_key)
        candidates = [
            (path, manifest)
            for path, manifest in self.store.rollback_order(self.key)
            if manifest is not None and manifest.stamp.get("digest") == stamp_digest
        ]
        for path, _ in candidates:
            result = verify(path, key=self.key, workers=workers)
            if not result.ok or result.manifest is None:
                log.warning("not making %s current again: %s", path, result.problems[0].message)
                continue
            if signing_key is not None:
                self._resign(path, signing_key)
            self._point_current(path.name)
            self._collect(keep, path)
            return result.manifest
        return None

    def _current_or_none(self) -> str | None:
        with suppress(KernelCacheError):
            return self.store._read_current(self.key_dir)
        return None

    def _point_current(self, generation: str) -> None:
        """Make CURRENT name generation, by rename, last: the outgoing generation's moment is
        recorded in HISTORY.json first (retention orders by it)."""
        outgoing = self._current_or_none()  # a corrupt CURRENT is replaced, not recorded
        if outgoing is not None and outgoing != generation:
            _record_replaced(self.key_dir, outgoing)
        tmp = self.key_dir / f".CURRENT.{os.getpid()}-{secrets.token_hex(4)}"
        try:
            write_file_synced(tmp, f"{generation}\n".encode())
            with io_errors(self.key_dir / CURRENT_NAME):
                os.replace(tmp, self.key_dir / CURRENT_NAME)
        except BaseException:
            with suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        # If this fsync fails, CURRENT already names the new, complete generation.
        fsync_dir(self.key_dir)

    def _collect(self, keep: int, gen_dir: Path) -> None:
        try:
            self.store._gc_locked(self.key, keep)
        except StorageError as exc:
            log.warning("made %s current but could not collect old generations: %s", gen_dir, exc)

    def _fill(self, files_root: Path, files_dir: Path, workers: int | None) -> list[FileEntry]:
        """Digest (and fsync) the staging files, copying them in from files_dir if needed."""
        if files_dir == files_root:
            files, dirs = _regular_files(files_root)
            for rel in dirs:  # listable by every reader, whatever the warmer's umask
                with io_errors(files_root / rel):
                    (files_root / rel).chmod(0o755)
            entries = _digest_files(files_root, files, workers, seal=True)
        else:
            files, _ = _regular_files(files_dir)
            dirs = _make_dirs(files_root, (rel for rel, _ in files))

            def copy(item: tuple[str, int]) -> FileEntry:
                digest, size = _copy_file(files_dir / item[0], files_root / item[0])
                return FileEntry(item[0], size, digest)

            entries = sorted(
                _parallel(copy, sorted(files, key=lambda f: -f[1]), workers),
                key=lambda e: e.path,
            )
        _fsync_tree_dirs(files_root, dirs, workers)
        return entries

    def _install(
        self,
        staging: Path,
        manifest: Manifest,
        signing_key: Ed25519PrivateKey | None,
        workers: int | None,
    ) -> tuple[Manifest, bool]:
        """Rename staging to its generation id; returns (manifest in effect, created new).

        The same content published before keeps its directory (and its manifest), unless
        that directory no longer verifies, in which case the fresh copy replaces it.
        """
        gen_dir = self.key_dir / manifest.generation
        if os.path.lexists(gen_dir):
            existing = verify(gen_dir, key=self.key, workers=workers)
            if existing.ok and existing.manifest is not None:
                self._discard(staging)
                if signing_key is not None:
                    self._resign(gen_dir, signing_key)
                return existing.manifest, False
            log.warning("replacing generation %s, which fails verification", gen_dir)
            _trash(self.key_dir, gen_dir)
        with io_errors(staging):
            os.rename(staging, gen_dir)
        self._stagings.discard(staging)
        fsync_dir(self.key_dir)
        return manifest, True

    def _resign(self, gen_dir: Path, signing_key: Ed25519PrivateKey) -> None:
        """Sign a kept generation's manifest with this publisher's key (atomically)."""
        manifest_path = gen_dir / MANIFEST_NAME
        with io_errors(manifest_path):
            data = _read_regular(manifest_path)
        tmp = gen_dir / f".{SIGNATURE_NAME}.{secrets.token_hex(4)}"
        try:
            write_file_synced(tmp, _signature_bytes(signing_key, data))
            with io_errors(gen_dir / SIGNATURE_NAME):
                os.replace(tmp, gen_dir / SIGNATURE_NAME)
        except BaseException:
            with suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        fsync_dir(gen_dir)
