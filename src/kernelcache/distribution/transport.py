"""How kernelcache speaks to a registry over the network: deadlines, bounded retries, which
scheme, and which redirects it follows.

A registry or a proxy in front of it can accept a connection and then go silent (during
TLS, before its response headers, in the middle of a blob). Without a deadline a pull, a
``verify --pull`` or a node's prefetch then waits for ever, and the pod or the node's status
says nothing. So every request has a connect deadline (TCP and TLS) and a read deadline (the
longest silence), from one ``Network`` read from the registry settings of ``contract.Settings``;
what never reached the registry, and every idempotent request, is tried ``tries`` times
with a short backoff; a blob that breaks off is resumed where it stopped (``Client.blob``).
What is still failing after that is one line naming the registry and the step (exit 10).

A read deadline is no deadline against a peer that trickles: 512 bytes every 5 s never
leaves it silent for ``read_s``. So a body (a manifest, a blob) must also arrive at a floor
rate, averaged over each ``read_s`` (``RateFloor``): below it the connection is cut, the
blob resumed where it stopped, and after the tries one line says how slow it was.

Plain HTTP is spoken only when asked for (``--plain-http``) and only to a loopback registry
or one named in ``KERNELCACHE_PLAIN_HTTP_HOSTS``, as ORAS and skopeo ask for it explicitly. A
redirect to plain http is followed only to such a host: from https (a blob GET sent to a
storage backend) never, since credentials and the blob would cross the network in clear and
a generation's integrity would rest on the digest check alone; from an allowed plain-http
registry, not to a host that ``--plain-http`` would be refused for.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from kernelcache import contract
from kernelcache.errors import SpecError, StorageError

# Seconds before the second try; each later one waits twice as long (urllib3's backoff).
_BACKOFF_S = 0.5
# Methods whose request may be sent again after the registry saw it.
_IDEMPOTENT = frozenset({"GET", "HEAD"})


@dataclass(frozen=True)
class Network:
    """The deadlines and tries of every registry step."""

    connect_s: float = contract.REGISTRY_CONNECT_S.default
    read_s: float = contract.REGISTRY_READ_S.default
    tries: int = contract.REGISTRY_TRIES.default
    plain_http_hosts: tuple[str, ...] = ()
    min_bytes_s: int = contract.REGISTRY_MIN_BYTES_S.default

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Network:
        """The registry settings alone: another variable's bad value is not a pull's."""
        env = os.environ if environ is None else environ
        return cls(
            contract.REGISTRY_CONNECT_S.read(env),
            contract.REGISTRY_READ_S.read(env),
            contract.REGISTRY_TRIES.read(env),
            contract.PLAIN_HTTP_HOSTS.read(env),
            contract.REGISTRY_MIN_BYTES_S.read(env),
        )

    @property
    def timeout(self) -> tuple[float, float]:
        return (self.connect_s, self.read_s)

    def plain_http_allowed(self, registry: str) -> bool:
        return _is_loopback(registry) or registry.lower() in self.plain_http_hosts

    def check_plain_http(self, registry: str) -> None:
        """Refuse ``--plain-http`` for a registry that is neither loopback nor allowed."""
        if self.plain_http_allowed(registry):
            return
        raise SpecError(
            f"{registry}: --plain-http is for a loopback registry or one named in "
            f"{contract.PLAIN_HTTP_HOSTS.name}; {registry} is neither"
        )


def _is_loopback(registry: str) -> bool:
    host = urlsplit(f"//{registry}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def configure(session: Any, network: Network, registry: str) -> None:
    """Give ``session`` the deadlines, the bounded retries and the redirect rule."""
    import requests.adapters
    from urllib3.util.retry import Retry

    retries = network.tries - 1
    policy = Retry(
        total=retries,
        connect=retries,  # never reached the registry: safe for any method
        read=retries,  # only for _IDEMPOTENT
        status=0,
        other=0,
        redirect=False,  # requests follows redirects itself, through _no_downgrade
        allowed_methods=_IDEMPOTENT,
        backoff_factor=_BACKOFF_S,
        raise_on_status=False,
        respect_retry_after_header=False,
    )

    class Adapter(requests.adapters.HTTPAdapter):
        def send(
            self,
            request: Any,
            stream: bool = False,
            timeout: Any = None,
            verify: Any = True,
            cert: Any = None,
            proxies: Any = None,
        ) -> Any:
            timeout = timeout or network.timeout
            return super().send(request, stream, timeout, verify, cert, proxies)

    for prefix in ("https://", "http://"):
        session.mount(prefix, Adapter(max_retries=policy))
    session.hooks["response"].append(_no_downgrade(registry, network))


def _no_downgrade(registry: str, network: Network) -> Any:
    def check(response: Any, *args: Any, **kwargs: Any) -> None:
        if not response.is_redirect:
            return
        location = urljoin(response.url, response.headers.get("Location", ""))
        to = urlsplit(location)
        step = f"{registry}: {response.request.method} {step_of(response.url)} redirected"
        if urlsplit(response.url).scheme == "https" and to.scheme != "https":
            response.close()
            raise StorageError(
                f"{step} from https to {to.scheme or 'no scheme'} "
                f"({to.netloc}): refused, a download leaves TLS only by mistake"
            )
        if to.scheme != "https" and not network.plain_http_allowed(to.netloc):
            response.close()
            raise StorageError(
                f"{step} to plain http on {to.netloc or 'no host'}, neither loopback nor named "
                f"in {contract.PLAIN_HTTP_HOSTS.name}: refused"
            )

    return check


class RateFloor:
    """A body's floor rate: while it is read (``add`` each piece), a watcher checks every
    ``read_s`` that at least ``min_bytes_s * read_s`` bytes came in, and otherwise cuts the
    connection (the blocked read then fails) and says why in ``tripped``. A per-read
    timeout cannot see a trickle; this does."""

    def __init__(self, response: Any, network: Network) -> None:
        self.window = network.read_s
        self.rate = network.min_bytes_s
        self.received = 0
        self.tripped: str | None = None
        connection = getattr(response.raw, "connection", None)
        self._sock: socket.socket | None = getattr(connection, "sock", None)
        self._done = threading.Event()

    def __enter__(self) -> RateFloor:
        if self.rate and self.window and self._sock is not None:
            threading.Thread(target=self._watch, daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()

    def add(self, size: int) -> None:
        self.received += size

    def _watch(self) -> None:
        mark = self.received
        while not self._done.wait(self.window):
            if self.received - mark < self.rate * self.window:
                got = self.received - mark
                self.tripped = f"slower than {self.rate} bytes/s ({got} bytes in {self.window:g} s)"
                with contextlib.suppress(OSError):
                    assert self._sock is not None
                    self._sock.shutdown(socket.SHUT_RDWR)
                return
            mark = self.received


def step_of(url: str) -> str:
    """A request's path, short: the step a failure line names."""
    path = urlsplit(url).path
    return path[:96] + "…" if len(path) > 96 else path
