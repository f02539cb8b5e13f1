"""A threaded HTTP(S) server on a free loopback port, for the fault and token stand-ins."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@contextmanager
def local_server(
    handler: type[BaseHTTPRequestHandler], cert: Path | None = None, key: Path | None = None
) -> Iterator[int]:
    """``handler`` served on 127.0.0.1 (TLS with ``cert`` and ``key``); its port. Shut down
    after, every request thread a daemon (a handler held on an event cannot hang the exit)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    if cert is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
