"""Failure classes and their exit codes.

Every failure the CLI and the init-container can report is one of these classes. Each maps
to a distinct exit code so a Job, an init-container or a script can tell them apart, and
carries a one-line message that names the file, factor or field at fault.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1  # an unexpected error (a bug): reported with its type, never a traceback
    USAGE = 2  # bad command line or invalid spec file
    MISSING_GENERATION = 3  # no published generation for this key/arch
    STAMP_MISMATCH = 4  # the generation was built for another environment
    INTEGRITY = 5  # a file is missing, altered, truncated or not in the manifest
    SIGNATURE = 6  # signature missing or invalid; a signing or public key missing or unusable
    MALFORMED_MANIFEST = 7  # MANIFEST.json unreadable or not the expected schema
    UNSAFE_PATH = 8  # a manifest path or symlink that escapes the generation
    NO_GPU_INFO = 9  # the target arch could not be determined
    IO = 10  # the store or target could not be read or written (disk full, permissions)
    WARM_FAILED = 11  # a warmer failed, exited or timed out, or a declared one produced nothing
    LOCKED = 12  # another writer holds the key and the wait timed out
    NOT_INSTALLED = 13  # a package or a kernel module a command needs cannot be imported here
    INTERRUPTED = 130  # stopped by SIGINT (Ctrl-C): 128 + the signal, as shells report it
    BROKEN_PIPE = 141  # the reader of stdout went away (`| head`): 128 + SIGPIPE, as `yes` exits


EXIT_CODE_HELP = {
    ExitCode.OK: "success",
    ExitCode.FAILURE: "unexpected internal error",
    ExitCode.USAGE: "bad arguments or invalid spec",
    ExitCode.MISSING_GENERATION: "no published generation for the key",
    ExitCode.STAMP_MISMATCH: "stamp does not match this environment (factor named)",
    ExitCode.INTEGRITY: "a file is missing, altered, truncated or unlisted",
    ExitCode.SIGNATURE: "manifest signature missing or invalid; a key missing or unusable",
    ExitCode.MALFORMED_MANIFEST: "manifest unreadable or wrong schema",
    ExitCode.UNSAFE_PATH: "a path or symlink escapes the generation",
    ExitCode.NO_GPU_INFO: "target arch could not be determined",
    ExitCode.IO: "store, target or kubeconfig missing or unusable (disk full, permissions)",
    ExitCode.WARM_FAILED: "a warmer failed, exited, timed out or produced nothing",
    ExitCode.LOCKED: "another writer holds the key (and the wait timed out)",
    ExitCode.NOT_INSTALLED: "a package or kernel module the command needs does not import here",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C): nothing half-published",
    ExitCode.BROKEN_PIPE: "the output's reader went away (a closed pipe): stopped quietly",
}


# Terminal escapes (colours, cursor moves) and other control characters: a toolchain's
# coloured error text must not reach a log, a termination message or a CI annotation.
_ESCAPES = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def plain(text: str) -> str:
    """``text`` without terminal escape sequences or control characters (newlines kept)."""
    return _CONTROL.sub("", _ESCAPES.sub("", text))


def one_line(text: object) -> str:
    """A message as one plain line: escapes dropped, whitespace runs (newlines) collapsed."""
    return " ".join(plain(str(text)).split())


class KernelCacheError(Exception):
    """A failure with a one-line message and the exit code of its class; what it is about,
    where known, as fields too (``--json`` carries them): the file (``path``), the stamp
    factor or the spec field."""

    code: ExitCode = ExitCode.FAILURE

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        factor: str | None = None,
        field: str | None = None,
        details: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.factor = factor
        self.field = field
        # Every problem found, each one line, the first (the message's) included: a line
        # names one and counts the others, --json lists them all.
        self.details = [one_line(d) for d in details]


class SpecError(KernelCacheError):
    code = ExitCode.USAGE


class MissingGenerationError(KernelCacheError):
    code = ExitCode.MISSING_GENERATION


class StampMismatchError(KernelCacheError):
    code = ExitCode.STAMP_MISMATCH


class IntegrityError(KernelCacheError):
    code = ExitCode.INTEGRITY


class SignatureError(KernelCacheError):
    code = ExitCode.SIGNATURE


class ManifestError(KernelCacheError):
    code = ExitCode.MALFORMED_MANIFEST


class UnsafePathError(KernelCacheError):
    code = ExitCode.UNSAFE_PATH


class NoGpuInfoError(KernelCacheError):
    code = ExitCode.NO_GPU_INFO


class StorageError(KernelCacheError):
    code = ExitCode.IO


class WarmError(KernelCacheError):
    code = ExitCode.WARM_FAILED


class LockedError(KernelCacheError):
    code = ExitCode.LOCKED


class NotInstalledError(KernelCacheError):
    code = ExitCode.NOT_INSTALLED


def and_more(others: Sequence[str], named: int = 3) -> str:
    """What a one-line failure leaves out, named: `` (and 2 more: b, c)``; past ``named``
    names, counted (`` (and 5 more: b, c, d, …)``); nothing when nothing is left out."""
    if not others:
        return ""
    shown = ", ".join(one_line(o) for o in others[:named]) + (", …" if others[named:] else "")
    return f" (and {len(others)} more: {shown})"


def error_line(exc: BaseException) -> str:
    """The one line a failure is reported as, on stderr and in a termination log alike."""
    if isinstance(exc, KernelCacheError):
        return f"kernelcache: error: {one_line(exc.message)}"
    if isinstance(exc, KeyboardInterrupt):
        return "kernelcache: interrupted"
    return f"kernelcache: internal error: {type(exc).__name__}: {one_line(exc)}"


def exit_code_of(exc: BaseException) -> int:
    """The exit code of a failure's class: an unexpected error is FAILURE, a bug to report."""
    if isinstance(exc, KernelCacheError):
        return int(exc.code)
    if isinstance(exc, KeyboardInterrupt):
        return int(ExitCode.INTERRUPTED)
    return int(ExitCode.FAILURE)


def ended_by_interrupt(returncode: int | None) -> bool:
    """Whether a child process ended because of a Ctrl-C: killed by SIGINT, or exiting 130
    as shells and kernelcache do after one. Its parent is interrupted too, whichever of the
    two saw the signal first."""
    return returncode in (-signal.SIGINT, ExitCode.INTERRUPTED)


def error_object(exc: BaseException) -> dict[str, object]:
    """What every ``--json`` command prints when it fails (``docs/cli-schemas/error.json``):
    a script reads the class, the file, factor or field, and the line from stdout, whatever
    the command."""
    code = exit_code_of(exc)
    error: dict[str, object] = {
        "exit_code": code,
        "class": ExitCode(code).name.lower(),
        "message": error_line(exc),
    }
    if isinstance(exc, KernelCacheError):
        subject = {"path": exc.path, "factor": exc.factor, "field": exc.field}
        error.update({name: value for name, value in subject.items() if value is not None})
        if exc.details:
            error["details"] = list(exc.details)
    return {"ok": False, "error": error}


class ColdCompileError(RuntimeError):
    """A compile was needed in strict mode, where every kernel must come from the cache.

    Raised inside the serving process by every toolchain's refusal (not a command's exit
    class): one type, so serving code can catch a refusal as such.
    """
