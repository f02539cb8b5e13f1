"""Materialize: copy a generation out of the store (into a pod's emptyDir, a node's local
disk), checking every byte as it is copied and renaming the copy into place only whole."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path

from kernelcache.errors import IntegrityError, StorageError
from kernelcache.store.digests import FileEntry, copy_file
from kernelcache.store.fs import (
    fsync_dir,
    fsync_tree_dirs,
    io_errors,
    make_dirs,
    parallel,
    read_regular,
    storage_error,
    write_file_synced,
)
from kernelcache.store.layout import COMPLETE_MARKER, FILES_DIR, MANIFEST_NAME, SIGNATURE_NAME
from kernelcache.store.manifest import Manifest


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
        dirs = make_dirs(dst_root, (e.path for e in manifest.files))

        def copy(entry: FileEntry) -> None:
            src = src_root / entry.path
            try:
                digest, size = copy_file(src, dst_root / entry.path, durable)
            except StorageError as exc:
                if exc.path == str(src) and isinstance(exc.__cause__, FileNotFoundError):
                    raise IntegrityError(f"{src}: missing", path=str(src)) from exc
                raise
            if size != entry.size:
                raise IntegrityError(f"{src}: size {size} != manifest {entry.size}", path=str(src))
            if digest != entry.digest:
                raise IntegrityError(f"{src}: digest mismatch", path=str(src))

        parallel(copy, sorted(manifest.files, key=lambda e: -e.size), workers)
        write_file_synced(partial / COMPLETE_MARKER, f"{manifest.generation}\n".encode())
        if durable:
            fsync_tree_dirs(dst_root, dirs, workers)
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
            raise storage_error(exc, result) from exc
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
        data = read_regular(path)
    if Manifest.parse(data, str(path)) != manifest:
        raise IntegrityError(f"{path}: changed since it was verified", path=str(path))
    write_file_synced(dst / MANIFEST_NAME, data)
    sig = gen_dir / SIGNATURE_NAME
    if sig.is_file():
        with io_errors(sig):
            write_file_synced(dst / SIGNATURE_NAME, read_regular(sig))
