"""A store's keys: CURRENT and the generations it names, read without a lock, and the one
writer per key that publishes, makes a kept generation current again and collects old ones."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from kernelcache.errors import (
    IntegrityError,
    KernelCacheError,
    MissingGenerationError,
    SpecError,
    StorageError,
    UnsafePathError,
)
from kernelcache.store.digests import (
    FileEntry,
    copy_file,
    digest_files,
    generation_id,
)
from kernelcache.store.fs import (
    fsync_dir,
    fsync_tree_dirs,
    io_errors,
    lstat_refusing_symlink,
    make_dirs,
    parallel,
    read_regular,
    regular_files,
    replace_synced,
    storage_error,
    sync_filesystem,
    write_file_synced,
)
from kernelcache.store.history import (
    created_or_oldest,
    last_current,
    read_history,
    record_replaced,
)
from kernelcache.store.layout import (
    CURRENT_NAME,
    FILES_DIR,
    GENERATION_RE,
    LOCK_NAME,
    MANIFEST_NAME,
    SIGNATURE_NAME,
    TRANSIENT_PREFIXES,
    key_problem,
)
from kernelcache.store.locking import holder, lock, try_lock
from kernelcache.store.manifest import MANIFEST_FORMAT, Manifest, load_manifest, now_rfc3339
from kernelcache.store.signing import (
    PrivateKeyLike,
    PublicKeyLike,
    fingerprint,
    private_key,
    signature_bytes,
    signer,
)
from kernelcache.store.verification import VerifyResult, verified, verify

log = logging.getLogger(__name__)


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
        f"{storage_error(exc, key_dir).message}: {parent} is owned by uid {info.st_uid} "
        f"gid {info.st_gid} mode {stat.S_IMODE(info.st_mode):04o}, and this process is uid "
        f"{os.geteuid()} gid {os.getegid()}; a volume that ignores fsGroup needs its owner "
        "set first (Helm: operator.fixStoreOwnership=true; see 'The compile Job cannot "
        "write the volume' in docs/troubleshooting.md)",
        path=os.fsdecode(parent),
    )


def _visible(directory: Path) -> list[str]:
    """A directory's entries a store could hold (hidden names and ``lost+found`` aside)."""
    with os.scandir(directory) as entries:
        return sorted(
            e.name for e in entries if not e.name.startswith(".") and e.name != "lost+found"
        )


class Store:
    """A directory of keys, each holding immutable generations and a CURRENT pointer."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).absolute()

    def key_dir(self, key: str) -> Path:
        problem = key_problem(key)
        if problem is not None:
            raise SpecError(f"key {key!r}: {problem}")
        return self.root / key

    def keys(self) -> list[str]:
        """Keys with a published generation."""
        found = []
        for current in self.root.glob(f"*/*/*/{CURRENT_NAME}"):
            key = current.parent.relative_to(self.root).as_posix()
            if key_problem(key) is None and current.is_file():
                found.append(key)
        return sorted(found)

    def foreign_entries(self) -> list[str]:
        """What makes the root no store, or nothing: a store is an empty directory (a fresh
        volume; ``lost+found`` and hidden names aside), one that holds a key's path,
        ``NS/NAME/ARCH`` (whatever it has become: a broken key is verify's to name), or one
        holding only the ``NS/`` and ``NS/NAME/`` directories its deleted keys left. A typo'd
        path that exists must not read as an empty store."""
        shown = _visible(self.root)
        for found in self.root.glob("*/*/sm_[0-9]*"):  # the last segment an arch's
            if key_problem(found.relative_to(self.root).as_posix()) is None:
                return []
        namespaces = [self.root / name for name in shown]
        try:
            if all(
                ns.is_dir() and all((ns / n).is_dir() for n in _visible(ns)) for ns in namespaces
            ):
                return []
        except OSError:  # a directory that cannot be listed: verify names it
            return []
        return shown

    def _read_current(self, key_dir: Path) -> str | None:
        path = key_dir / CURRENT_NAME
        try:
            # Not through a symlink (CURRENT would name another key's generation), and
            # never blocking on a FIFO.
            text = read_regular(path).decode("ascii", errors="replace").strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise storage_error(exc, path) from exc
        if not GENERATION_RE.match(text):
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
            st = lstat_refusing_symlink(
                key_dir / gen_id, "a generation must be a directory of its key"
            )
            if st is not None and stat.S_ISDIR(st.st_mode):
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
            st = lstat_refusing_symlink(path, "a key's directories must be the store's own")
            if st is None:
                return  # nothing published there yet
            if not stat.S_ISDIR(st.st_mode):
                raise StorageError(f"{path}: not a directory", path=str(path))

    def current_manifest(self, key: str) -> Manifest | None:
        gen_dir = self.current(key)
        return None if gen_dir is None else load_manifest(gen_dir)

    def manifest(self, gen_dir: Path) -> Manifest | None:
        """A generation's manifest as it reads, unverified (to choose among generations,
        which ``verify`` then checks in full); None when it does not parse."""
        try:
            return load_manifest(gen_dir)
        except KernelCacheError:
            return None

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
            raise storage_error(exc, key_dir) from exc
        found = []
        for entry in entries:
            if GENERATION_RE.match(entry.name) and entry.is_dir(follow_symlinks=False):
                path = Path(entry.path)
                found.append((path, self.manifest(path)))
        return sorted(found, key=lambda g: (created_or_oldest(g[1]), g[0].name))

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
            if on_wait is not None and not try_lock(fd, lock_path):
                on_wait(holder(fd))
            lock(fd, lock_path, key, timeout)
            _remove_transient(key_dir)
            writer = Writer(self, key)
            try:
                yield writer
            finally:
                writer._close()
        finally:
            os.close(fd)  # releases the lock

    def gc(
        self,
        key: str,
        keep: int,
        timeout: float | None = None,
        dry_run: bool = False,
        on_wait: Callable[[str], None] | None = None,
    ) -> list[str]:
        """Remove all generations but the one CURRENT names and the `keep` most recently
        current besides it (``rollback_order``); ``dry_run`` removes nothing and returns what
        would be removed. ``on_wait`` as for ``writer``."""
        with self.writer(key, timeout=timeout, on_wait=on_wait):
            return self._gc_locked(key, keep, dry_run)

    def rollback_order(self, key: str) -> list[tuple[Path, Manifest | None]]:
        """The key's generations other than the current one, the most recently current first
        (the one CURRENT named before comes first: the rollback target)."""
        key_dir = self.key_dir(key)
        current = self._read_current(key_dir)  # a corrupt CURRENT raises: nothing to order
        history = read_history(key_dir)
        others = [g for g in self._generation_dirs(key) if g[0].name != current]
        return sorted(others, key=lambda g: (last_current(g, history), g[0].name), reverse=True)

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


def _remove_transient(key_dir: Path) -> None:
    """Remove what writers that died left behind; only a lock holder may call this.

    Best effort: a dead writer's warmer can outlive it and go on writing into its staging
    directory, which then cannot be removed yet. Under its hidden name it is in no one's way,
    and the next writer tries again.
    """
    with io_errors(key_dir):
        entries = [e for e in os.scandir(key_dir) if e.name.startswith(TRANSIENT_PREFIXES)]
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
        signing_key = private_key(signing_key)

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
                created=now_rfc3339(),
                stamp=stamp,
                files=tuple(entries),
                report=report,
            )
            data = manifest.to_bytes()
            write_file_synced(staging / MANIFEST_NAME, data)
            if signing_key is not None:
                write_file_synced(staging / SIGNATURE_NAME, signature_bytes(signing_key, data))
            fsync_dir(staging)
            manifest, created_new = self._install(staging, manifest, signing_key, workers)
        except BaseException:
            self._discard(staging)
            raise

        return self._go_current(manifest, created_new, keep)

    def adopt(
        self,
        staging: Path,
        *,
        public_key: PublicKeyLike | None = None,
        require_signature: bool = False,
        keep: int = 2,
        workers: int | None = None,
        digests: bool = True,
    ) -> Manifest:
        """Publish a generation made elsewhere, byte for byte, as the key's CURRENT one.

        ``staging`` is the parent of a ``staging()`` files/ directory, holding the
        generation's own MANIFEST.json (and signature) beside it: a pulled generation keeps
        its manifest, its creation time and its signature, where ``publish`` would write new
        ones. It must verify whole for this key (``public_key``, ``require_signature`` as
        ``verify``); else the first problem is raised and nothing is published.
        ``digests=False`` is for a caller that checked every file's digest as it wrote it.
        The swap is a publish's: a crash leaves CURRENT naming the old or the new one.
        """
        self._check_open()
        staging = Path(staging).absolute()
        if staging not in self._stagings:
            raise ValueError(f"{staging}: not a staging directory of this writer")
        try:
            _, manifest = verified(
                staging,
                public_key=public_key,
                require_signature=require_signature,
                workers=workers,
                digests=digests,
            )
            if manifest.key != self.key:
                raise IntegrityError(
                    f"{staging / MANIFEST_NAME}: published for key {manifest.key}, "
                    f"not for {self.key}",
                    path=str(staging / MANIFEST_NAME),
                )
            sync_filesystem(staging)  # every file and directory of it, in one call
            manifest, created_new = self._install(staging, manifest, None, workers)
        except BaseException:
            self._discard(staging)
            raise
        return self._go_current(manifest, created_new, keep)

    def make_current_again(
        self,
        stamp_digest: str,
        signing_key: PrivateKeyLike | None = None,
        keep: int = 2,
        workers: int | None = None,
        trusted: Sequence[Ed25519PublicKey] = (),
        accept: Callable[[Path], bool] = lambda generation: True,
    ) -> Manifest | None:
        """Point CURRENT back at a kept generation built with this stamp, without building.

        A reverted spec or engine image finds its generation still in the store: of those
        with this stamp digest, the most recently current one that verifies in full for this
        key is made current, then old generations are collected. With ``signing_key``, in
        full means its signature too: signed by that key or by one of ``trusted`` (a key
        being rotated out; it is then re-signed with signing_key). A kept generation that is
        unsigned or signed by another key is not made current: anyone who can write the
        store can edit one, and signing it now would vouch for the edit. None when no kept
        generation qualifies (the build then compiles). The swap is the same as a publish's:
        a crash leaves CURRENT naming the old or the kept one.
        """
        self._check_open()
        signing_key = private_key(signing_key)
        candidates = [
            (path, manifest)
            for path, manifest in self.store.rollback_order(self.key)
            if manifest is not None and manifest.stamp.get("digest") == stamp_digest
        ]
        for path, _ in candidates:
            result = verify(
                path,
                key=self.key,
                workers=workers,
                public_key=None if signing_key is None else _trusting(signing_key, trusted),
                require_signature=signing_key is not None,
            )
            if not result.ok or result.manifest is None:
                log.warning("not making %s current again: %s", path, result.problems[0].message)
                continue
            if not accept(path):  # the caller's own check (its kernels would be refused)
                continue
            if signing_key is not None and result.signer != fingerprint(signing_key):
                self._resign(path, result, signing_key)
            self._point_current(path.name)
            self._collect(keep, path)
            return result.manifest
        return None

    def sign_current(
        self,
        signing_key: PrivateKeyLike,
        workers: int | None = None,
        trusted: Sequence[Ed25519PublicKey] = (),
    ) -> tuple[Manifest, bool] | None:
        """Make sure the current generation is signed with signing_key, without building:
        (its manifest, whether it was signed now), or None when it cannot be vouched for
        (the build then compiles a new one; a warning says why).

        It is verified in full first (every digest). Signed by signing_key: nothing to do.
        Signed by one of ``trusted`` (a key being rotated out): re-signed. Unsigned, or
        signed by a key not trusted: not vouched for. An unsigned generation is never signed
        here, whatever the key's other generations: whether signing was on before cannot be
        told from files anyone who writes the volume can delete (every signature, then a
        forged CURRENT), so a signing build signs only what it built itself (the build then
        compiles; the same content gets the same id, and its copy replaces the unsigned one)
        or what a trusted key signed.
        """
        self._check_open()
        key = private_key(signing_key)
        assert key is not None
        gen_dir = self.store.current(self.key)
        if gen_dir is None:
            return None
        result = verify(gen_dir, key=self.key, workers=workers)
        if not result.ok or result.manifest is None or result.manifest_bytes is None:
            log.warning("not signing %s: %s", gen_dir, result.problems[0].message)
            return None
        sig_path = gen_dir / SIGNATURE_NAME
        try:
            encoded: bytes | None = read_regular(sig_path)
        except FileNotFoundError:
            encoded = None
        except (OSError, UnsafePathError) as exc:
            log.warning("not signing %s: %s unreadable: %s", gen_dir, sig_path, exc)
            return None
        if encoded is None:
            log.warning(
                "not signing %s: unsigned, and a signing build signs only what it built or a "
                "trusted key signed (compiling it)",
                gen_dir,
            )
            return None
        made_by, mismatch = signer(encoded, result.manifest_bytes, _trusting(key, trusted))
        if made_by is None:
            log.warning(
                "not signing %s: its signature %s (a key being rotated out is trusted "
                "only when given as a public key)",
                gen_dir,
                mismatch,
            )
            return None
        if fingerprint(made_by) == fingerprint(key):
            return result.manifest, False
        self._resign(gen_dir, result, key)
        return result.manifest, True

    def _go_current(self, manifest: Manifest, created_new: bool, keep: int) -> Manifest:
        """Point CURRENT at an installed generation, then collect old ones; a new generation
        is taken back when CURRENT could not be pointed at it."""
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

    def _current_or_none(self) -> str | None:
        with suppress(KernelCacheError):
            return self.store._read_current(self.key_dir)
        return None

    def _point_current(self, generation: str) -> None:
        """Make CURRENT name generation, by rename, last: the outgoing generation's moment is
        recorded in HISTORY.json first (retention orders by it)."""
        outgoing = self._current_or_none()  # a corrupt CURRENT is replaced, not recorded
        if outgoing is not None and outgoing != generation:
            record_replaced(self.key_dir, outgoing)
        # If its last fsync fails, CURRENT already names the new, complete generation.
        replace_synced(
            self.key_dir / CURRENT_NAME, f"{generation}\n".encode(), f".CURRENT.{os.getpid()}-"
        )

    def _collect(self, keep: int, gen_dir: Path) -> None:
        try:
            self.store._gc_locked(self.key, keep)
        except StorageError as exc:
            log.warning("made %s current but could not collect old generations: %s", gen_dir, exc)

    def _fill(self, files_root: Path, files_dir: Path, workers: int | None) -> list[FileEntry]:
        """Digest (and fsync) the staging files, copying them in from files_dir if needed."""
        if files_dir == files_root:
            files, dirs = regular_files(files_root)
            for rel in dirs:  # listable by every reader, whatever the warmer's umask
                with io_errors(files_root / rel):
                    (files_root / rel).chmod(0o755)
            entries = digest_files(files_root, files, workers, seal=True)
        else:
            files, _ = regular_files(files_dir)
            dirs = make_dirs(files_root, (rel for rel, _ in files))

            def copy(item: tuple[str, int]) -> FileEntry:
                digest, size = copy_file(files_dir / item[0], files_root / item[0])
                return FileEntry(item[0], size, digest)

            entries = sorted(
                parallel(copy, sorted(files, key=lambda f: -f[1]), workers),
                key=lambda e: e.path,
            )
        fsync_tree_dirs(files_root, dirs, workers)
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
            # Signing: reused only when signed by this key already (its manifest, report
            # included, is then one this publisher vouched for); else the fresh copy wins.
            existing = verify(
                gen_dir,
                key=self.key,
                workers=workers,
                public_key=None if signing_key is None else signing_key.public_key(),
                require_signature=signing_key is not None,
            )
            if existing.ok and existing.manifest is not None:
                self._discard(staging)
                return existing.manifest, False
            log.warning("replacing generation %s, which fails verification", gen_dir)
            _trash(self.key_dir, gen_dir)
        with io_errors(staging):
            os.rename(staging, gen_dir)
        self._stagings.discard(staging)
        fsync_dir(self.key_dir)
        return manifest, True

    def _resign(self, gen_dir: Path, checked: VerifyResult, signing_key: Ed25519PrivateKey) -> None:
        """Sign a kept generation's manifest, the very bytes just verified, atomically."""
        assert checked.ok and checked.manifest_bytes is not None
        replace_synced(
            gen_dir / SIGNATURE_NAME,
            signature_bytes(signing_key, checked.manifest_bytes),
            f".{SIGNATURE_NAME}.",
        )


def _trusting(
    signing_key: Ed25519PrivateKey, trusted: Sequence[Ed25519PublicKey]
) -> tuple[Ed25519PublicKey, ...]:
    """The keys whose signature a signing publisher accepts: its own and ``trusted``."""
    return (signing_key.public_key(), *trusted)
