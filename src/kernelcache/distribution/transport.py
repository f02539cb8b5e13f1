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

Plain HTTP is spoken only when asked for (``--plain-http``) and only to a loopback registry
or one named in ``KERNELCACHE_PLAIN_HTTP_HOSTS``, as ORAS and skopeo ask for it explicitly. A
redirect from https to plain http (a blob GET sent to a storage backend) is refused:
credentials and the blob would cross the network in clear, and a generation's integrity
would rest on the digest check alone.
"""

from __future__ import annotations

import ipaddress
import os
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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Network:
        """The registry settings alone: another variable's bad value is not a pull's."""
        env = os.environ if environ is None else environ
        return cls(
            contract.REGISTRY_CONNECT_S.read(env),
            contract.REGISTRY_READ_S.read(env),
            contract.REGISTRY_TRIES.read(env),
            contract.PLAIN_HTTP_HOSTS.read(env),
        )

    @property
    def timeout(self) -> tuple[float, float]:
        return (self.connect_s, self.read_s)

    def check_plain_http(self, registry: str) -> None:
        """Refuse ``--plain-http`` for a registry that is neither loopback nor allowed."""
        if _is_loopback(registry) or registry.lower() in self.plain_http_hosts:
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
    session.hooks["response"].append(_no_downgrade(registry))


def _no_downgrade(registry: str) -> Any:
    def check(response: Any, *args: Any, **kwargs: Any) -> None:
        if not response.is_redirect:
            return
        location = urljoin(response.url, response.headers.get("Location", ""))
        if urlsplit(response.url).scheme == "https" and urlsplit(location).scheme != "https":
            response.close()
            raise StorageError(
                f"{registry}: {response.request.method} {step_of(response.url)} redirected from "
                f"https to {urlsplit(location).scheme or 'no scheme'} "
                f"({urlsplit(location).netloc}): refused, a download leaves TLS only by mistake"
            )

    return check


def step_of(url: str) -> str:
    """A request's path, short: the step a failure line names."""
    path = urlsplit(url).path
    return path[:96] + "…" if len(path) > 96 else path
