"""The writer lock: flock(2) on a key's .lock, which the kernel drops when its holder dies
however it dies; the pid and host written into it only name the holder to a waiter."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from kernelcache.errors import LockedError
from kernelcache.store.fs import io_errors, storage_error

log = logging.getLogger(__name__)


def try_lock(fd: int, lock_path: Path) -> bool:
    """Take the lock if it is free; False when another writer holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        raise storage_error(exc, lock_path) from exc
    return True


def lock(fd: int, lock_path: Path, key: str, timeout: float | None) -> None:
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
                        f"{key}: another writer holds {lock_path} ({holder(fd)});"
                        f" gave up after {timeout:g}s",
                        path=str(lock_path),
                    ) from None
                time.sleep(min(0.02, remaining))
            except OSError as exc:
                raise storage_error(exc, lock_path) from exc
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError as exc:
        # Only a diagnostic: a full disk must not stop the writer that would free space.
        log.warning("could not record the lock holder in %s: %s", lock_path, exc)


def holder(fd: int) -> str:
    try:
        fields = os.pread(fd, 256, 0).decode(errors="replace").split()
    except OSError:
        fields = []
    if len(fields) >= 2:
        return f"pid {fields[0]} on {fields[1]}"
    return f"pid {fields[0]}" if fields else "holder unknown"
