"""The manifest: what a generation's files/ holds, in canonical bytes that sign and verify
identically, parsed strictly so every fault is one line naming the field."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import blake3
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kernelcache.documents import load_json
from kernelcache.errors import ManifestError, UnsafePathError, and_more
from kernelcache.store.digests import FileEntry
from kernelcache.store.fs import one_line, read_regular, storage_error
from kernelcache.store.layout import GENERATION_RE, MANIFEST_NAME, key_problem, path_problem

MANIFEST_FORMAT = "kernelcache.dev/manifest/v1"

_DIGEST_PATTERN = r"^blake3:[0-9a-f]{64}$"
_CREATED_PATTERN = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z$"


def parse_created(created: str) -> datetime:
    fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if "." in created else "%Y-%m-%dT%H:%M:%SZ"
    return datetime.strptime(created, fmt).replace(tzinfo=timezone.utc)


def now_rfc3339() -> str:
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
    generation: str = Field(pattern=GENERATION_RE.pattern)
    created: str = Field(pattern=_CREATED_PATTERN)
    stamp: dict[str, Any]
    files: list[_FileModel]
    report: dict[str, Any]
    # Absent only in manifests written before it existed.
    checksum: str | None = Field(default=None, pattern=_DIGEST_PATTERN)

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value != MANIFEST_FORMAT:
            raise ValueError(f"expected {MANIFEST_FORMAT!r}")
        return value

    @field_validator("key")
    @classmethod
    def _valid_key(cls, key: str) -> str:
        problem = key_problem(key)
        if problem:
            raise ValueError(problem)
        return key

    @field_validator("created")
    @classmethod
    def _valid_time(cls, created: str) -> str:
        parse_created(created)  # ValueError for e.g. month 13
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
        return parse_created(self.created)

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
        manifest = parse_schema(data, source)
        check_paths(manifest, source)
        if (problem := checksum_problem(manifest)) is not None:
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


def parse_schema(data: bytes, source: str) -> Manifest:
    """Everything Manifest.parse checks except path safety (verify checks that after the
    signature, so a forged manifest reports a bad signature first)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{source}: not UTF-8 (byte {exc.start})", path=source) from exc
    try:
        obj = load_json(
            text,
            source,
            ManifestError,
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_reject_constant,
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
    where = one_line(".".join(str(part) for part in first["loc"])) or "(document)"
    message = f"{source}: field {where}: {one_line(first['msg'])}"
    value = first.get("input")
    if isinstance(value, (str, int, float)) and first["type"] != "missing":
        message += f" (got {one_line(repr(value))[:80]})"
    others = [".".join(str(part) for part in e["loc"]) or "(document)" for e in errors[1:]]
    return message + and_more(others)


def checksum_problem(manifest: Manifest) -> str | None:
    if manifest.checksum is None or manifest.checksum == manifest_checksum(manifest.to_dict()):
        return None
    return "checksum mismatch: the manifest changed after it was written"


def check_paths(manifest: Manifest, source: str) -> None:
    for entry in manifest.files:
        problem = path_problem(entry.path)
        if problem is not None:
            raise UnsafePathError(f"{source}: files: {problem}: {entry.path!r}", path=source)


def load_manifest(gen_dir: Path) -> Manifest:
    path = gen_dir / MANIFEST_NAME
    try:
        data = read_regular(path)
    except FileNotFoundError as exc:
        raise ManifestError(f"{path}: missing", path=str(path)) from exc
    except OSError as exc:
        raise storage_error(exc, path) from exc
    return Manifest.parse(data, str(path))
