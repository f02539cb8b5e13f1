"""Immutable, content-addressed generations of kernel caches (being split by concept)."""

from kernelcache.store.writer import *  # noqa: F403
from kernelcache.store.writer import (  # noqa: F401
    __all__,
    fsync_dir,
    io_errors,
    manifest_checksum,
    write_file_synced,
)
