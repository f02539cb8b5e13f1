"""A proxy in front of the test registry that fails the way networks and middleboxes do.

It forwards every request to the real registry (TLS, its CA) and answers over TLS with the
registry's own certificate, or over plain HTTP (a local registry without TLS). A ``Fault``
picks requests by a piece of their path and breaks them: silent before any response
header, silent in the middle of a blob after ``after_bytes`` (for the first ``times``
requests, then forwarded: a resume with ``Range`` goes through), a blob that trickles
(``after_bytes`` at once, then ``trickle`` bytes every ``every_s``), or a redirect to plain
http (on the proxy itself, or to ``location``). ``silent_listener`` accepts connections and
never says a word (not even TLS).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

import requests
from tests.helpers.local_http import local_server
from tests.helpers.registry import Registry

_FORWARDED = ("Authorization", "Accept", "Range", "Content-Type", "Content-Length")
_NOT_RETURNED = {"transfer-encoding", "connection", "keep-alive"}


@dataclass
class Fault:
    path_part: str  # requests whose path holds this (e.g. "/blobs/") are broken
    kind: str  # "silent-headers" | "silent-mid-blob" | "trickle" | "redirect-to-http"
    after_bytes: int = 0  # silent-mid-blob, trickle: what is sent before the silence or trickle
    trickle: int = 512  # trickle: bytes sent each every_s
    every_s: float = 5.0
    location: str = ""  # redirect-to-http: where to (default: the same path on the proxy)
    times: int = 1_000_000  # how many matching requests are broken; later ones forwarded
    hits: list[str] = field(default_factory=list)  # "METHOD path Range" of each match


@dataclass
class Proxy:
    host: str  # 127.0.0.1:<port>
    faults: list[Fault]
    requests: list[str]  # "METHOD path" of every request seen

    def repo(self, name: str) -> str:
        return f"{self.host}/{name}"


@contextmanager
def running_proxy(registry: Registry, *faults: Fault, tls: bool = True) -> Iterator[Proxy]:
    release = threading.Event()  # set on exit: every silent handler returns
    upstream = requests.Session()
    proxy = Proxy("", list(faults), [])

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._handle()

        do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = do_GET

        def _handle(self) -> None:
            proxy.requests.append(f"{self.command} {self.path}")
            fault = next(
                (f for f in proxy.faults if f.path_part in self.path and len(f.hits) < f.times),
                None,
            )
            if fault is not None:
                fault.hits.append(f"{self.command} {self.path} {self.headers.get('Range', '')}")
                if fault.kind == "silent-headers":
                    release.wait()
                    return
                if fault.kind == "redirect-to-http":
                    self.send_response(307)
                    self.send_header(
                        "Location", fault.location or f"http://{proxy.host}{self.path}"
                    )
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k in _FORWARDED if (v := self.headers.get(k)) is not None}
            headers["Host"] = proxy.host
            headers["X-Forwarded-Proto"] = "https" if tls else "http"
            reply = upstream.request(
                self.command,
                f"https://{registry.host}{self.path}",
                data=body,
                headers=headers,
                verify=str(registry.ca_file),
                stream=True,
                allow_redirects=False,
            )
            self.send_response(reply.status_code)
            for name, value in reply.headers.items():
                if name.lower() not in _NOT_RETURNED:
                    self.send_header(name, value)
            self.end_headers()
            if self.command == "HEAD":
                return
            sent = 0
            if fault is not None and fault.kind == "trickle":
                body = reply.raw.read(decode_content=False)
                self.wfile.write(body[: fault.after_bytes])
                self.wfile.flush()
                for at in range(fault.after_bytes, len(body), fault.trickle):
                    if release.wait(fault.every_s):
                        return
                    self.wfile.write(body[at : at + fault.trickle])
                    self.wfile.flush()
                return
            for chunk in reply.raw.stream(64 << 10, decode_content=False):
                if fault is not None and fault.kind == "silent-mid-blob":
                    chunk = chunk[: max(0, fault.after_bytes - sent)]
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    sent += len(chunk)
                    if sent >= fault.after_bytes:
                        release.wait()
                        return
                    continue
                self.wfile.write(chunk)

        def log_message(self, format: str, *args: object) -> None:
            pass

    folder = registry.ca_file.parent
    cert, key = (folder / "server.pem", folder / "server.key") if tls else (None, None)
    with local_server(Handler, cert, key) as port:
        proxy.host = f"127.0.0.1:{port}"
        try:
            yield proxy
        finally:
            release.set()  # a handler held mid-body lets go before the server shuts down


@contextmanager
def silent_listener() -> Iterator[str]:
    """A host:port that accepts connections and then says nothing, not even TLS."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        listener.close()
