"""A layer read in one pass as it arrives: its tar entries, each file's bytes handed on as
views of the chunks the network delivered (no copy), and the blob's sha256, size and diff id
checked at its end.

Not ``tarfile``'s stream mode: it copies every byte three times more under the GIL (joins
and slices of its buffer), a tenth of a pull's CPU. The headers are still ``tarfile``'s own
(``TarInfo.frombuf``: checksums, numbers, the ustar prefix); this adds PAX and GNU long
names, and refuses anything but regular files and directories with safe relative paths.
"""

from __future__ import annotations

import gzip as gziplib
import hashlib
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from typing import Any, Protocol

from kernelcache.distribution.artifact import LAYER_TAR_GZIP, Descriptor
from kernelcache.errors import (
    IntegrityError,
    KernelCacheError,
    StorageError,
    UnsafePathError,
    one_line,
)
from kernelcache.store.layout import path_problem

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
# A PAX or GNU long-name header's data is a few names: more is not a layer of ours.
_MAX_HEADER_DATA = 1 << 20


class Source(Protocol):
    def view(self, size: int) -> memoryview:
        """At most ``size`` bytes (at least one until the end), without a copy."""


class _Hashed:
    """A source that hashes what it hands on: ``digest`` once ``drain`` has read it all."""

    hasher: Any

    def view(self, size: int) -> memoryview:
        raise NotImplementedError

    def drain(self) -> None:
        while self.view(1 << 20):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.hasher.hexdigest()


class BlobReader(_Hashed):
    """A blob's chunks, hashed and counted as they are handed on; more than ``limit`` bytes
    (a blob larger than its descriptor) is refused."""

    def __init__(
        self, chunks: Iterable[bytes], limit: int, on_excess: Callable[[], Exception]
    ) -> None:
        self._chunks = iter(chunks)
        self._chunk, self._offset = memoryview(b""), 0
        self._limit, self._on_excess = limit, on_excess
        self.hasher, self.size = hashlib.sha256(), 0

    def view(self, size: int) -> memoryview:
        while self._offset == len(self._chunk):
            chunk = next(self._chunks, None)
            if chunk is None:
                return memoryview(b"")
            self.hasher.update(chunk)
            self.size += len(chunk)
            if self.size > self._limit:
                raise self._on_excess()
            self._chunk, self._offset = memoryview(chunk), 0
        start = self._offset
        self._offset = min(start + size, len(self._chunk))
        return self._chunk[start : self._offset]

    def read(self, size: int = -1) -> bytes:
        """For ``gzip.GzipFile``, which reads the compressed blob through this."""
        return bytes(self.view(size if size >= 0 else 1 << 20))


class _Gunzipped(_Hashed):
    """What a gzip layer decompresses to, hashed as it is handed on (the diff id)."""

    def __init__(self, source: BlobReader) -> None:
        self._gzip = gziplib.GzipFile(fileobj=source, mode="rb")  # type: ignore[call-overload]
        self.hasher = hashlib.sha256()

    def view(self, size: int) -> memoryview:
        data = self._gzip.read(min(size, 1 << 20))
        self.hasher.update(data)
        return memoryview(data)


class Content:
    """One file's bytes in the layer: ``read`` hands on views until the entry's size."""

    def __init__(self, source: Source, size: int) -> None:
        self._source, self.left = source, size

    def read(self, size: int = -1) -> memoryview:
        if self.left == 0:
            return memoryview(b"")
        view = self._source.view(self.left if size < 0 else min(size, self.left))
        if not view:
            raise EOFError("unexpected end of data")
        self.left -= len(view)
        return view

    def read_all(self) -> bytes:
        return b"".join(bytes(view) for view in iter(lambda: self.read(1 << 20), memoryview(b"")))


def _exactly(source: Source, size: int) -> bytes:
    parts, left = [], size
    while left:
        view = source.view(left)
        if not view:
            raise EOFError("unexpected end of data")
        parts.append(bytes(view))
        left -= len(view)
    return b"".join(parts)


def _skip(source: Source, size: int) -> None:
    while size:
        view = source.view(size)
        if not view:
            raise EOFError("unexpected end of data")
        size -= len(view)


def _padding(size: int) -> int:
    return -size % _BLOCK


def _pax_records(data: bytes) -> dict[str, str]:
    """``"<length> <key>=<value>\\n"`` records (POSIX pax extended headers)."""
    records, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        record = data[pos : pos + length]
        if length <= space - pos or not record.endswith(b"\n") or b"=" not in record:
            raise tarfile.HeaderError("malformed pax record")
        key, _, value = record[space - pos + 1 : -1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def entries(source: Source) -> Iterator[tuple[tarfile.TarInfo, Content | None]]:
    """Each entry of the tar (its header data folded in), with a file's content; the next
    entry is read only after the caller is done with this one's."""
    pax: dict[str, str] = {}
    long_name: str | None = None
    long_link: str | None = None
    while True:
        header = _exactly(source, _BLOCK)
        if header == _ZERO_BLOCK:
            return  # the end-of-archive marker; the caller drains what follows
        info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME,
                         tarfile.GNUTYPE_LONGLINK):  # fmt: skip
            if info.size > _MAX_HEADER_DATA:
                raise tarfile.HeaderError(f"a {info.size}-byte extended header")
            data = _exactly(source, info.size + _padding(info.size))[: info.size]
            if info.type == tarfile.XHDTYPE:
                pax = _pax_records(data)
            elif info.type == tarfile.GNUTYPE_LONGNAME:
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif info.type == tarfile.GNUTYPE_LONGLINK:
                long_link = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue  # a global header (XGLTYPE) changes nothing kernelcache reads
        info.name = pax.get("path", long_name or info.name)
        info.linkname = pax.get("linkpath", long_link or info.linkname)
        if "size" in pax:
            info.size = int(pax["size"])
        if info.isdir():
            info.name = info.name.rstrip("/")
        pax, long_name, long_link = {}, None, None
        content = Content(source, info.size) if info.isreg() else None
        yield info, content
        _skip(source, (content.left if content is not None else info.size) + _padding(info.size))


# What means the bytes are not a well-formed, or are a truncated, layer.
_UNREADABLE = (tarfile.TarError, EOFError, ValueError, zlib.error, gziplib.BadGzipFile)


def read_layer(
    chunks: Iterable[bytes],
    layer: Descriptor,
    diff_id: str,
    what: str,
    on_entry: Callable[[tarfile.TarInfo, Content | None], None],
) -> None:
    """Stream a layer's tar, handing each entry (a regular file with its content, or a
    directory) to ``on_entry``, then check the blob's size and digest and its diff id.

    Entries are used before the digest is known (one pass, no copy of the blob on disk); a
    caller writes them only into a staging directory it discards on any failure. Every
    entry is refused unless it is a regular file or a directory with a safe relative path
    (UnsafePathError: a symlink, a hard link, a device, ``..``, an absolute path). When
    anything fails, the rest of the blob is read and its digest checked first: a damaged
    blob is reported as such, whatever it broke on the way.
    """
    reader = BlobReader(chunks, layer.size, lambda: too_long(what, layer.size))
    tar: BlobReader | _Gunzipped = (
        _Gunzipped(reader) if layer.media_type == LAYER_TAR_GZIP else reader
    )
    try:
        try:
            for member, content in entries(tar):
                _check_entry(member, what)
                on_entry(member, content)
            tar.drain()
        except _UNREADABLE as exc:
            raise IntegrityError(f"{what}: not a readable tar: {one_line(exc)}") from exc
    except StorageError:
        raise  # the blob stopped coming (the network, the disk): nothing to tell of its bytes
    except KernelCacheError as failure:
        with suppress(KernelCacheError, *_UNREADABLE):
            reader.drain()
        _check_blob(reader, layer, what)
        raise failure
    reader.drain()
    _check_blob(reader, layer, what)
    if tar.digest != diff_id:
        raise IntegrityError(
            f"{what}: its tar's digest {tar.digest} is not the config's diff id {diff_id}"
        )


def too_long(what: str, size: int) -> IntegrityError:
    """A blob that kept coming past its descriptor's size (its reader stops there)."""
    return IntegrityError(f"{what}: longer than its descriptor says ({size} bytes)")


def _check_blob(reader: BlobReader, layer: Descriptor, what: str) -> None:
    if reader.size > layer.size:
        raise too_long(what, layer.size)
    if reader.size < layer.size:
        raise IntegrityError(f"{what}: truncated: {reader.size} of its {layer.size} bytes")
    if reader.digest != layer.digest:
        raise IntegrityError(f"{what}: digest mismatch: the registry served {reader.digest}")


def _check_entry(member: tarfile.TarInfo, what: str) -> None:
    name = member.name
    if member.issym() or member.islnk():
        kind = "a symlink" if member.issym() else "a hard link"
        raise UnsafePathError(
            f"{what}: {one_line(name)!r} is {kind} (to {one_line(member.linkname)!r})"
        )
    if not (member.isreg() or member.isdir()):
        raise UnsafePathError(f"{what}: {one_line(name)!r} is not a regular file or directory")
    if (problem := path_problem(name)) is not None:
        raise UnsafePathError(f"{what}: {problem}: {one_line(name)!r}")
