"""Verify: check a generation against its manifest, reporting every problem as one line
naming the file, with the exit code of its class.

The path of a check (``verify``): ``_generation_dir_problem`` (a real, listable directory),
``_read_manifest`` (a regular file of its own, that parses), ``_check_signature`` (when a
key is given or one is required), ``_trust_problem`` (safe paths, intact checksum, published
for this key under this id), ``_scan_files`` (nothing in files/ but files and directories of
its own, each readable), ``_size_problems``, ``_digest_problems``, ``_unlisted_problems`` and
last ``_content_problem`` (the generation id is its content's).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelcache.errors import (
    ExitCode,
    IntegrityError,
    KernelCacheError,
    ManifestError,
    MissingGenerationError,
    SignatureError,
    StorageError,
    UnsafePathError,
    and_more,
)
from kernelcache.store.digests import FileEntry, digest_one, generation_id
from kernelcache.store.fs import link_target, one_line, parallel, read_regular, storage_error, walk
from kernelcache.store.layout import FILES_DIR, MANIFEST_NAME, SIGNATURE_NAME
from kernelcache.store.manifest import Manifest, check_paths, checksum_problem, parse_schema
from kernelcache.store.signing import PublicKeyLike, fingerprint, public_keys, signer


@dataclass
class Problem:
    code: ExitCode
    path: str | None
    message: str  # one line, names the file


def _problem(code: ExitCode, path: Path | str, what: str) -> Problem:
    return Problem(code, str(path), f"{path}: {what}")


def _problem_of(exc: KernelCacheError) -> Problem:
    return Problem(exc.code, exc.path, exc.message)


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
    """What was checked. ``manifest_bytes`` and ``signature`` are the very bytes the checks
    read (each file once): ``materialize`` writes these, never the store's files read again,
    so what a copy holds is what was checked. ``signature`` is the generation's signature
    as read (a copy carries it: pods that require one check it there), checked only when
    ``signer``, the fingerprint of the trusted key that made it, is set."""

    gen_dir: Path
    manifest: Manifest | None
    problems: list[Problem]
    bytes_checked: int
    seconds: float
    manifest_bytes: bytes | None = None
    signature: bytes | None = None
    signer: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        if not self.problems:
            return
        first, *others = self.problems
        message = first.message + and_more([_within(p.path) or p.message for p in others])
        raise _ERROR_CLASSES.get(first.code, KernelCacheError)(
            message, path=first.path, details=[p.message for p in self.problems]
        )


def _within(path: str | None) -> str | None:
    """A problem's path as the generation names it (``files/...``), for a line that already
    named the generation with its first problem."""
    if path is None or f"/{FILES_DIR}/" not in path:
        return path
    return f"{FILES_DIR}/" + path.split(f"/{FILES_DIR}/", 1)[1]


def verified(gen_dir: Path, **options: Any) -> tuple[VerifyResult, Manifest]:
    """``verify`` (with its options), its first problem raised as that problem's class: the
    result and its manifest, for a caller that goes on only with a sound generation."""
    result = verify(gen_dir, **options)
    result.raise_for_problems()
    assert result.manifest is not None  # verify reports a problem whenever it has no manifest
    return result, result.manifest


def verify(
    gen_dir: Path,
    *,
    key: str | None = None,
    public_key: PublicKeyLike | None = None,
    require_signature: bool = False,
    workers: int | None = None,
    digests: bool | Callable[[str], bool] = True,
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
    A predicate digests the files (as named under files/) it holds for: those a caller
    reads in place rather than copies.
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
    digests: bool | Callable[[str], bool],
) -> None:
    """The checks in order; one that leaves nothing further to trust ends the run."""
    gen_dir, problems = result.gen_dir, result.problems
    if (unusable := _generation_dir_problem(gen_dir)) is not None:
        problems.append(unusable)
        return
    read = _read_manifest(gen_dir / MANIFEST_NAME)
    if isinstance(read, Problem):
        problems.append(read)
        return
    data, manifest = read
    result.manifest, result.manifest_bytes = manifest, data
    signature_problem = None
    if public_key is not None or require_signature:
        checked = _check_signature(gen_dir, data, public_key)
        if isinstance(checked, Problem):
            signature_problem = checked
            problems.append(signature_problem)
        else:
            result.signature, result.signer = checked
    else:
        result.signature = _unchecked_signature(gen_dir)
    untrusted = _trust_problem(manifest, gen_dir, key, checksum=signature_problem is None)
    if untrusted is not None:
        problems.append(untrusted)
        return
    files_root = gen_dir / FILES_DIR
    scanned = _scan_files(files_root, problems)
    if scanned is None:
        return
    on_disk, flagged = scanned
    to_digest = _size_problems(manifest, files_root, on_disk, flagged, problems)
    if callable(digests):
        to_digest = [e for e in to_digest if digests(e.path)]
    elif not digests:
        to_digest = []
    result.bytes_checked += _digest_problems(files_root, to_digest, workers, problems)
    problems.extend(_unlisted_problems(manifest, files_root, on_disk))
    # Last, so that an edited entry is reported by its file's name before this.
    if (altered := _content_problem(manifest, gen_dir / MANIFEST_NAME)) is not None:
        problems.append(altered)


def _generation_dir_problem(gen_dir: Path) -> Problem | None:
    """A generation is a directory (not a symlink to one) that users other than root list."""
    try:
        gen_st = os.lstat(gen_dir)
    except OSError:
        gen_st = None
    if gen_st is not None and stat.S_ISLNK(gen_st.st_mode):
        return _problem(
            ExitCode.UNSAFE_PATH, gen_dir, f"is a symlink (to {link_target(gen_dir)!r})"
        )
    if gen_st is None or not stat.S_ISDIR(gen_st.st_mode):
        return _problem(ExitCode.MISSING_GENERATION, gen_dir, "no such generation directory")
    if (unusable := _mode_problem(gen_st)) is not None:
        return _problem(ExitCode.IO, gen_dir, unusable)
    return None


def _read_manifest(manifest_path: Path) -> tuple[bytes, Manifest] | Problem:
    """The manifest's bytes and what they parse to (all but path safety: that is checked
    after the signature, so a forged manifest reports a bad signature first)."""
    try:
        data = read_regular(manifest_path)
        manifest_st = os.lstat(manifest_path)
        if (unusable := _mode_problem(manifest_st)) is not None:
            return _problem(ExitCode.IO, manifest_path, unusable)
        if (shared := _hard_link_problem(manifest_st)) is not None:
            return _problem(ExitCode.UNSAFE_PATH, manifest_path, shared)
    except FileNotFoundError:
        return _problem(ExitCode.MALFORMED_MANIFEST, manifest_path, "missing")
    except UnsafePathError as exc:
        return _problem_of(exc)
    except OSError as exc:
        return _problem_of(storage_error(exc, manifest_path))
    try:
        return data, parse_schema(data, str(manifest_path))
    except ManifestError as exc:
        return _problem_of(exc)


def _unchecked_signature(gen_dir: Path) -> bytes | None:
    """The signature's bytes when there is one, unchecked (no key to check it with)."""
    try:
        return read_regular(gen_dir / SIGNATURE_NAME)
    except (OSError, UnsafePathError):
        return None


def _check_signature(
    gen_dir: Path, manifest_bytes: bytes, public_key: PublicKeyLike | None
) -> tuple[bytes, str] | Problem:
    """The signature's bytes (read once) and the fingerprint of the trusted key that made
    it, or why there is none."""
    sig_path = gen_dir / SIGNATURE_NAME
    if public_key is None:
        return _problem(
            ExitCode.SIGNATURE, sig_path, "signature required but no public key to check it with"
        )
    try:
        trusted = public_keys(public_key)
    except SignatureError as exc:
        return _problem_of(exc)
    try:
        encoded = read_regular(sig_path)
    except FileNotFoundError:
        return _problem(ExitCode.SIGNATURE, sig_path, "missing")
    except (OSError, UnsafePathError) as exc:
        return _problem(ExitCode.SIGNATURE, sig_path, f"unreadable: {one_line(exc)}")
    made_by, mismatch = signer(encoded, manifest_bytes, trusted)
    if made_by is None:
        return _problem(ExitCode.SIGNATURE, sig_path, str(mismatch))
    return encoded, fingerprint(made_by)


def _trust_problem(
    manifest: Manifest, gen_dir: Path, key: str | None, checksum: bool
) -> Problem | None:
    """Why nothing the manifest lists may be looked at, or None: a path that could lead
    outside the generation, a checksum that shows the manifest altered (``checksum``: unless
    a bad signature said so already), or a generation published for another key or under
    another id."""
    manifest_path = gen_dir / MANIFEST_NAME
    try:
        check_paths(manifest, str(manifest_path))
    except UnsafePathError as exc:
        return _problem_of(exc)  # touch no file a manifest path could lead outside the generation
    if checksum and (altered := checksum_problem(manifest)) is not None:
        return _problem(ExitCode.MALFORMED_MANIFEST, manifest_path, altered)  # nor its file list
    if key is not None and (foreign := _binding_problem(manifest, key, gen_dir)) is not None:
        # another key's generation: what it holds is not this key's to check
        return _problem(ExitCode.INTEGRITY, manifest_path, foreign)
    return None


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


def _scan_files(
    files_root: Path, problems: list[Problem]
) -> tuple[dict[str, int], set[str]] | None:
    """The regular files in files/ with their sizes, and the entries already reported
    (``_entry_problem``); None when files/ itself cannot be looked into."""
    on_disk: dict[str, int] = {}
    flagged: set[str] = set()
    try:
        if files_root.is_symlink():
            problems.append(_problem(ExitCode.UNSAFE_PATH, files_root, "is a symlink"))
            return None
        if not files_root.exists():
            return on_disk, flagged
        if (unusable := _mode_problem(os.lstat(files_root))) is not None:
            problems.append(_problem(ExitCode.IO, files_root, unusable))
            return None
        for rel, dirent in walk(files_root):
            if dirent.is_symlink():
                found: tuple[ExitCode, str] | None = (
                    ExitCode.UNSAFE_PATH,
                    f"is a symlink (to {os.readlink(dirent.path)!r})",
                )
            else:
                st = dirent.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    on_disk[rel] = st.st_size
                found = _entry_problem(st)
            if found is not None:
                problems.append(_problem(found[0], dirent.path, found[1]))
                flagged.add(rel)
    except OSError as exc:
        problems.append(_problem_of(storage_error(exc, files_root)))
        return None
    return on_disk, flagged


def _entry_problem(st: os.stat_result) -> tuple[ExitCode, str] | None:
    """Why an entry of files/ (not a symlink) is not the generation's to serve, or None: a
    file with other hard links, anything but a file or directory, or only root can read it."""
    if stat.S_ISREG(st.st_mode) and (shared := _hard_link_problem(st)) is not None:
        return ExitCode.UNSAFE_PATH, shared
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        return ExitCode.INTEGRITY, "not a regular file"
    if (unusable := _mode_problem(st)) is not None:
        return ExitCode.IO, unusable
    return None


def _size_problems(
    manifest: Manifest,
    files_root: Path,
    on_disk: dict[str, int],
    flagged: set[str],
    problems: list[Problem],
) -> list[FileEntry]:
    """Report each listed file missing or of another size; returns those left to digest
    (a file under an entry already reported is not looked at again)."""

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
            problems.append(_problem(ExitCode.INTEGRITY, path, "missing"))
        elif on_disk[entry.path] != entry.size:
            problems.append(
                _problem(
                    ExitCode.INTEGRITY, path, f"size {on_disk[entry.path]} != manifest {entry.size}"
                )
            )
        else:
            to_digest.append(entry)
    return to_digest


def _digest_problems(
    files_root: Path, entries: list[FileEntry], workers: int | None, problems: list[Problem]
) -> int:
    """Digest entries in parallel, largest first, reporting each mismatch; returns the bytes
    read."""

    def check(entry: FileEntry) -> tuple[int, Problem | None]:
        path = files_root / entry.path
        try:
            actual = digest_one(files_root, entry.path)
        except KernelCacheError as exc:
            return 0, _problem_of(exc)
        if actual.digest != entry.digest:
            return actual.size, _problem(ExitCode.INTEGRITY, path, "digest mismatch")
        return actual.size, None

    ordered = sorted(entries, key=lambda e: -e.size)
    checked = 0
    for size, problem in parallel(check, ordered, workers):
        checked += size
        if problem is not None:
            problems.append(problem)
    return checked


def _unlisted_problems(
    manifest: Manifest, files_root: Path, on_disk: dict[str, int]
) -> list[Problem]:
    listed = {entry.path for entry in manifest.files}
    return [
        _problem(ExitCode.INTEGRITY, files_root / rel, "not in manifest")
        for rel in sorted(set(on_disk) - listed)
    ]


def _content_problem(manifest: Manifest, manifest_path: Path) -> Problem | None:
    content_id = generation_id(manifest.stamp["digest"], manifest.files)
    if content_id == manifest.generation:
        return None
    return _problem(
        ExitCode.INTEGRITY,
        manifest_path,
        f"generation {manifest.generation} does not match its content ({content_id})",
    )


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
