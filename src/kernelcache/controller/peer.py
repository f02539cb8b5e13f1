"""One HTTP GET from a peer the operator does not trust (a serving pod's learned record).

A per-socket timeout is not a deadline: a pod that sends one byte every half second never
trips it, and urllib follows redirects to wherever a pod points. So the whole exchange
(connect, request, status line, headers, body) runs against one monotonic deadline, the
answer is capped in bytes (headers and body), and a redirect is refused and named, never
followed. The request is HTTP/1.0 with ``Connection: close``: the answer ends at its
``Content-Length`` or when the peer closes, with no chunked framing to trust.
"""

from __future__ import annotations

import socket
import time
import urllib.parse

from kernelcache.errors import one_line

MAX_HEADER_BYTES = 16 * 1024


class PeerError(Exception):
    """The peer's answer was not taken; ``str()`` is one line saying why."""


class TooLarge(PeerError):
    """The answer (or its declared length) is over the cap."""


def _remaining(deadline: float, budget: float, got: int) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerError(f"no complete answer within {budget:g} s ({got} bytes received)")
    return left


def _head(raw: bytes, max_bytes: int) -> int | None:
    """The body's declared length, after checking the status line: 200 only, a redirect
    refused by name, a declared length over the cap refused unread."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise PeerError(f"not an HTTP answer: {lines[0]!r:.60}")
    status = int(parts[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if 300 <= status < 400:
        where = headers.get("location", "")
        raise PeerError(
            f"redirect ({status}) to {where!r:.120} refused: redirects are not followed"
        )
    if status != 200:
        raise PeerError(f"HTTP {status}")
    declared = headers.get("content-length")
    if declared is None:
        return None
    if not declared.isdigit():
        raise PeerError(f"Content-Length {declared!r:.30} is not a length")
    if int(declared) > max_bytes:
        raise TooLarge(f"too large: {declared} bytes declared, the limit is {max_bytes}")
    return int(declared)


def get(url: str, budget: float, max_bytes: int, deadline: float | None = None) -> bytes:
    """The body of ``GET url`` (plain http, an IP or name and a port), all of it within
    ``budget`` seconds (or by ``deadline``, a ``time.monotonic()`` instant, if earlier),
    at most ``max_bytes`` of body; anything else is one ``PeerError``."""
    start = time.monotonic()
    deadline = min(deadline, start + budget) if deadline is not None else start + budget
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise PeerError(f"not a plain http URL with a port: {url!r:.100}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    request = (
        f"GET {target} HTTP/1.0\r\nHost: {host}:{parts.port}\r\n"
        "Accept: application/json\r\nConnection: close\r\n\r\n"
    ).encode("ascii")
    buf = bytearray()
    try:
        sock = socket.create_connection(
            (parts.hostname, parts.port), timeout=_remaining(deadline, budget, 0)
        )
    except TimeoutError:
        raise PeerError(f"no connection within {budget:g} s") from None
    except OSError as exc:
        raise PeerError(one_line(exc)) from None
    try:
        sock.settimeout(_remaining(deadline, budget, 0))
        sock.sendall(request)
        body_at, length = -1, None
        while True:
            sock.settimeout(_remaining(deadline, budget, len(buf)))
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
            if body_at < 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEADER_BYTES:
                        raise TooLarge(f"too large: headers past {MAX_HEADER_BYTES} bytes")
                    continue
                body_at = end + 4
                length = _head(bytes(buf[:end]), max_bytes)
            if len(buf) - body_at > max_bytes:
                raise TooLarge(f"too large: more than {max_bytes} bytes")
            if length is not None and len(buf) - body_at >= length:
                break
    except TimeoutError:
        raise PeerError(
            f"no complete answer within {budget:g} s ({len(buf)} bytes received)"
        ) from None
    except OSError as exc:
        raise PeerError(one_line(exc)) from None
    finally:
        sock.close()
    if body_at < 0:
        raise PeerError(f"the answer ended before its headers ({len(buf)} bytes)")
    body = bytes(buf[body_at:])
    if length is not None and len(body) < length:
        raise PeerError(f"the answer ended after {len(body)} of {length} bytes")
    return body[:length] if length is not None else body
