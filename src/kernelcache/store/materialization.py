"""Materialize: copy a verified generation out of the store (into a pod's emptyDir, a node's
local disk), writing exactly the bytes that were checked and renaming the copy into place
only whole.

What a copy holds is what was checked, by construction: MANIFEST.json and its signature are
written from the bytes ``verify`` read and checked (``VerifyResult``), never read from the
store again; each file is read once, into a buffer that is hashed and then written, so the
bytes written are the bytes whose digest matched. A store changed under a copy (a file, the
manifest or its signature swapped) gives a copy of what was checked, or a failure.

The target is trusted no more than the store. Nothing it holds is reused: every run copies
afresh and replaces an earlier copy whole (an earlier copy, ``.complete`` marker and all, may
have been changed since). A symlink anywhere under the target is refused, and so is a target
in a store (a copy there would replace a generation or land in another key).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from kernelcache.errors import IntegrityError, StorageError, UnsafePathError, one_line
from kernelcache.store.digests import FileEntry, chunk_buffer, copy_file
from kernelcache.store.fs import (
    fsync_dir,
    fsync_tree_dirs,
    io_errors,
    link_target,
    make_dirs,
    open_dir,
    parallel,
    storage_error,
    walk,
    write_file_synced,
)
from kernelcache.store.layout import (
    COMPLETE_MARKER,
    CURRENT_NAME,
    FILES_DIR,
    MANIFEST_NAME,
    SIGNATURE_NAME,
)
from kernelcache.store.verification import VerifyResult

# What a run leaves in the target while it works: its copy under construction, an earlier
# copy moved aside. A run killed midway leaves them; ``claimed`` removes them.
LEFTOVERS = (".partial-", ".stale-")
# Replacing an earlier copy races only with another materialize of the same target; past
# this many lost races the target is not ours alone.
_REPLACE_ATTEMPTS = 3
# A copy task (``_batches``): a file this big alone, smaller ones in runs up to this size.
_BATCH_BYTES = 4 << 20
_BATCH_FILES = 256


def materialize(
    checked: VerifyResult,
    target: Path,
    workers: int | None = None,
    *,
    durable: bool = True,
    drop: Collection[str] = (),
    leave: Collection[str] = (),
) -> Path:
    """Copy a verified generation into target/<generation-id>/, and return that path.

    ``checked`` is ``verify``'s result for the generation (it must be ok; its digests may
    have been skipped: every byte copied is hashed here). The copy is built in a hidden
    target/.partial-* directory with its .complete marker written last, and renamed into
    place only when complete, so an interrupted or failed copy never leaves anything that
    looks valid. ``drop``: files left out (tuning another GPU may not use); the copy is then
    target/<generation-id>-untuned, never mistaken for the full one. ``leave``: files not
    copied because they are used where they are (a read-only mount whose digests ``verify``
    checked); the copy is then target/<generation-id>-writable. ``durable=False`` skips
    the fsyncs, for a target that does not outlive a crash anyway (a pod's emptyDir):
    syncing costs about as much as the copy itself.
    """
    manifest, manifest_bytes = checked.manifest, checked.manifest_bytes
    if not checked.ok or manifest is None or manifest_bytes is None:
        raise ValueError(f"{checked.gen_dir}: materialize needs a generation that verified")
    target = Path(target).absolute()
    _check_target(target, checked.gen_dir)
    name = manifest.generation + ("-untuned" if drop else "") + ("-writable" if leave else "")
    with io_errors(target):
        target.mkdir(parents=True, exist_ok=True)
    partial = target / f".partial-{secrets.token_hex(4)}"
    try:
        with io_errors(partial):
            partial.mkdir()
            partial.chmod(0o755)  # the serving user lists it, whatever the umask
        write_file_synced(partial / MANIFEST_NAME, manifest_bytes)
        if checked.signature is not None:
            write_file_synced(partial / SIGNATURE_NAME, checked.signature)
        src_root, dst_root = checked.gen_dir / FILES_DIR, partial / FILES_DIR
        skipped = {*drop, *leave}
        entries = [e for e in manifest.files if e.path not in skipped]
        dirs = make_dirs(dst_root, (e.path for e in entries))

        parallel(
            lambda batch: _copy_batch(batch, src_root, dst_root, durable),
            _batches(entries),
            workers,
        )
        write_file_synced(partial / COMPLETE_MARKER, f"{manifest.generation}\n".encode())
        if durable:
            fsync_tree_dirs(dst_root, dirs, workers)
            fsync_dir(partial)
        result = _replace(target, name, partial)
        if durable:
            fsync_dir(target)
    except BaseException:
        _remove(partial)
        raise
    return result


def _batches(entries: list[FileEntry]) -> list[list[FileEntry]]:
    """The copy's tasks, largest first: each file of at least ``_BATCH_BYTES`` alone, the
    others in runs of one directory's files of up to ``_BATCH_BYTES`` and ``_BATCH_FILES``.

    A run opens its two directories once and creates its files one after another on one
    thread: the kernel creates one file of a directory at a time, so threads creating in
    one directory spin on its lock, and a small file on a task of its own costs more in
    scheduling than in copying.
    """
    batches: list[list[FileEntry]] = []
    run: list[FileEntry] = []
    run_bytes = 0
    for entry in sorted(entries, key=lambda e: e.path.rpartition("/")):
        if entry.size >= _BATCH_BYTES:
            batches.append([entry])
            continue
        if run and (
            _parent(run[0]) != _parent(entry)
            or run_bytes + entry.size > _BATCH_BYTES
            or len(run) == _BATCH_FILES
        ):
            batches.append(run)
            run, run_bytes = [], 0
        run.append(entry)
        run_bytes += entry.size
    if run:
        batches.append(run)
    return sorted(batches, key=lambda batch: -sum(e.size for e in batch))


def _parent(entry: FileEntry) -> str:
    return entry.path.rpartition("/")[0]


def _copy_batch(batch: list[FileEntry], src_root: Path, dst_root: Path, durable: bool) -> None:
    """Copy a run of one directory's files (``_batches``), each hashed as it is copied and
    refused unless its size and digest are the manifest's."""
    parent = _parent(batch[0])
    buf = chunk_buffer()
    try:
        with open_dir(src_root, parent) as src_fd, open_dir(dst_root, parent) as dst_fd:
            for entry in batch:
                src = src_root / entry.path
                try:
                    digest, size = copy_file(
                        src, dst_root / entry.path, durable, buf=buf, dirs=(src_fd, dst_fd)
                    )
                except StorageError as exc:
                    if exc.path == str(src) and isinstance(exc.__cause__, FileNotFoundError):
                        raise IntegrityError(f"{src}: missing", path=str(src)) from exc
                    raise
                if size != entry.size:
                    raise IntegrityError(
                        f"{src}: size {size} != manifest {entry.size}", path=str(src)
                    )
                if digest != entry.digest:
                    raise IntegrityError(f"{src}: digest mismatch", path=str(src))
    except StorageError as exc:  # a directory of the store's went missing after verify
        missing = isinstance(exc.__cause__, FileNotFoundError)
        if missing and exc.path is not None and Path(exc.path).is_relative_to(src_root):
            src = src_root / batch[0].path
            raise IntegrityError(f"{src}: missing", path=str(src)) from exc
        raise


@contextmanager
def claimed(
    target: Path, leftovers: Collection[str] = (), stores: Collection[Path] = ()
) -> Iterator[None]:
    """Hold the target for one run: refused before anything in it is touched when it is
    unsafe (``check_target``) or lies in one of ``stores``, made when missing, and locked
    (a shared ``flock`` on the directory) while the run works. A run that finds no other
    live run (it gets the lock exclusively first) removes what dead runs left: entries
    named with ``LEFTOVERS`` or ``leftovers`` prefixes. A live run's entries are never
    touched: it holds the lock."""
    check_target(target)
    real = target.resolve()
    for store in stores:
        root = Path(store).resolve()
        if root == real or root in real.parents:
            raise UnsafePathError(
                f"{target}: lies in a store ({root}); materialize outside it", path=str(target)
            )
    with io_errors(target):
        target.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # another run is live: its entries are its own
        else:
            prefixes = (*LEFTOVERS, *leftovers)
            with io_errors(target), os.scandir(target) as entries:
                dead = [Path(e.path) for e in entries if e.name.startswith(prefixes)]
            for path in dead:
                _remove(path)
        with io_errors(target):
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def check_target(target: Path) -> None:
    """Refuse a target that is a symlink (a loop too: 8) or not a directory (10), or that
    lies under a directory holding a CURRENT (a key of any store) or a MANIFEST.json (a
    generation): before anything in it is read, removed or written."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise storage_error(exc, target) from exc
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(
            f"{target}: is a symlink (to {link_target(target)!r}); give the directory itself",
            path=str(target),
        )
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise StorageError(f"{target}: not a directory", path=str(target))
    try:
        real = target.resolve(strict=False)
    except (OSError, RuntimeError) as exc:  # a loop in a directory above it
        raise UnsafePathError(
            f"{target}: a symlink loop above it: {one_line(exc)}", path=str(target)
        ) from exc
    for path in (real, *real.parents):
        if any(os.path.lexists(path / name) for name in (CURRENT_NAME, MANIFEST_NAME)):
            raise UnsafePathError(
                f"{target}: lies in a store ({path}); materialize outside it", path=str(target)
            )


def _check_target(target: Path, gen_dir: Path) -> None:
    """``check_target``, and refuse a target under the generation's store root or holding
    a symlink anywhere."""
    check_target(target)
    store_root = _store_root(gen_dir)
    real = target.resolve()
    if store_root == real or store_root in real.parents:
        raise UnsafePathError(
            f"{target}: lies in a store ({store_root}); materialize outside it", path=str(target)
        )
    if not os.path.lexists(target):
        return
    with io_errors(target):
        for _, entry in walk(target):
            if entry.is_symlink():
                path = Path(entry.path)
                raise UnsafePathError(
                    f"{path}: is a symlink (to {link_target(path)!r}); a materialize target "
                    "holds only what kernelcache wrote",
                    path=str(path),
                )


def _store_root(gen_dir: Path) -> Path:
    """The root of the store a generation lies in (<root>/<ns>/<name>/<arch>/<id>), or its
    own directory when it lies in none."""
    real = gen_dir.resolve()
    if os.path.lexists(real.parent / CURRENT_NAME) and len(real.parents) > 4:
        return real.parents[3]
    return real


def _replace(target: Path, name: str, partial: Path) -> Path:
    """Rename partial to target/name, moving whatever is there aside and removing it first."""
    result = target / name
    for _ in range(_REPLACE_ATTEMPTS):
        if os.path.lexists(result):
            stale = target / f".stale-{secrets.token_hex(4)}"
            try:
                os.rename(result, stale)
            except FileNotFoundError:
                pass  # another materialize moved it first
            except OSError as exc:
                raise storage_error(exc, result) from exc
            else:
                _remove(stale)
        try:
            os.rename(partial, result)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                continue  # another copy landed in between: replace it too
            raise storage_error(exc, result) from exc
        return result
    raise StorageError(
        f"{result}: replaced by another writer {_REPLACE_ATTEMPTS} times while materializing",
        path=str(result),
    )


def _remove(path: Path) -> None:
    """Remove a directory we made or moved aside (a symlink or file: only the entry)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(OSError):
            os.unlink(path)
