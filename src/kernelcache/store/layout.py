"""The names a store lays out on disk, and which keys and manifest paths are valid."""

from __future__ import annotations

import re

MANIFEST_NAME = "MANIFEST.json"
SIGNATURE_NAME = "MANIFEST.json.sig"
CURRENT_NAME = "CURRENT"
HISTORY_NAME = "HISTORY.json"
LOCK_NAME = ".lock"
FILES_DIR = "files"
COMPLETE_MARKER = ".complete"

# Hidden names a crashed writer can leave in a key directory; the next writer removes them.
TRANSIENT_PREFIXES = (".staging-", ".trash-", ".CURRENT.", ".HISTORY.")

SEGMENT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
GENERATION_RE = re.compile(r"^[0-9a-f]{16,64}$")


def key_problem(key: str) -> str | None:
    segments = key.split("/")
    if len(segments) != 3:
        return "must be namespace/name/arch"
    for segment in segments:
        if not SEGMENT_RE.match(segment):
            return f"segment {segment!r} must match {SEGMENT_RE.pattern}"
    return None


def path_problem(path: str) -> str | None:
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
