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

One module per concept: ``layout`` (the names on disk, valid keys and paths), ``fs`` (file
primitives), ``digests``, ``manifest``, ``signing``, ``verification`` (``verify``),
``materialization`` (``materialize``), ``history`` (retention order), ``locking`` (the
writer lock) and ``writer`` (``Store`` and its ``Writer``).
"""

from kernelcache.store.digests import FileEntry, digest_file, digest_tree, generation_id
from kernelcache.store.fs import fsync_dir, io_errors, write_file_synced
from kernelcache.store.layout import (
    COMPLETE_MARKER,
    CURRENT_NAME,
    FILES_DIR,
    MANIFEST_NAME,
    SIGNATURE_NAME,
)
from kernelcache.store.manifest import MANIFEST_FORMAT, Manifest, manifest_checksum
from kernelcache.store.materialization import claimed, materialize
from kernelcache.store.signing import (
    fingerprint,
    generate_keypair,
    load_private_key,
    load_public_key,
    load_public_keys,
)
from kernelcache.store.verification import Problem, VerifyResult, verified, verify
from kernelcache.store.writer import Store, Writer

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
    "claimed",
    "digest_file",
    "digest_tree",
    "fingerprint",
    "fsync_dir",
    "generate_keypair",
    "generation_id",
    "io_errors",
    "load_private_key",
    "load_public_key",
    "load_public_keys",
    "manifest_checksum",
    "materialize",
    "verified",
    "verify",
    "write_file_synced",
]
