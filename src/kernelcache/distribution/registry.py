"""The registry client: a thin layer over oras-py's ``Registry``, which speaks the
distribution API (auth challenges, tokens, upload sessions, TLS with a CA bundle).

What this layer adds and why: manifests are sent and read as bytes (oras-py re-serializes a
dict, and a manifest's digest is that of its exact bytes); requests are not retried with
oras-py's backoff (minutes before an unreachable registry is reported); credentials are
sent from the first request (a basic-auth registry would otherwise see every body twice);
blobs are read as urllib3 receives them (its decoding buffer copies every byte), and one
that breaks off is asked for again from where it stopped; every step has the deadlines and
tries of ``transport.Network``; every failure becomes one line of its exit class, naming the
registry and the step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kernelcache.distribution.auth import AuthLike, credentials_for, where_looked
from kernelcache.distribution.reference import Reference
from kernelcache.distribution.transport import Network, RateFloor, configure, step_of
from kernelcache.errors import (
    IntegrityError,
    KernelCacheError,
    MissingGenerationError,
    StorageError,
    one_line,
)

# A manifest is a page of JSON; more than this is not one of ours (and is not read whole).
MAX_MANIFEST_BYTES = 4 << 20
# Blobs above this go up in chunks of this size: oras-py reads a monolithic upload into memory.
CHUNK = 64 << 20
# What a blob read hands on at a time.
READ_CHUNK = 1 << 20


def _oras() -> Any:
    try:
        import oras.provider
    except ModuleNotFoundError as exc:
        raise KernelCacheError(
            f"OCI distribution: {exc.name} is missing; install kernelcache[oci]"
        ) from None
    return oras


class Client:
    """One repository of one registry, spoken to through oras-py."""

    def __init__(
        self,
        ref: Reference,
        auth: AuthLike = None,
        ca_file: str | os.PathLike[str] | None = None,
        actions: str = "pull",
        *,
        plain_http: bool = False,
        network: Network | None = None,
    ) -> None:
        oras = _oras()
        self.ref = ref
        self.network = Network.from_env() if network is None else network
        if plain_http:
            self.network.check_plain_http(ref.registry)
        self._scheme = "http" if plain_http else "https"
        self._actions = actions  # what a token registry is asked to grant: pull, or pull,push
        self._verify: bool | str = os.fspath(ca_file) if ca_file is not None else True
        self._registry = _unretried_registry(oras)(
            hostname=ref.registry, insecure=plain_http, tls_verify=self._verify
        )
        configure(self._registry.session, self.network, ref.registry)
        self._container = oras.container.Container(ref.name)
        self._auth = auth
        self._credentials = credentials_for(ref.registry, auth)
        self._authenticated = False

    # ---------------------------------------------------------------- requests

    def _url(self, path: str) -> str:
        return f"{self._scheme}://{self.ref.registry}/v2/{self.ref.repository}/{path}"

    def _request(self, method: str, url: str, **kwargs: Any) -> Any:
        """One request, authenticated."""
        self._ensure_authenticated()
        with self._transport_errors(f"{method} {step_of(url)}"):
            try:
                return self._registry.do_request(url, method, **kwargs)
            except ValueError as exc:  # oras-py: an authentication challenge it cannot answer
                raise StorageError(f"{self.ref.registry}: {one_line(exc)}") from exc

    @contextmanager
    def _transport_errors(self, step: str) -> Iterator[None]:
        """A failure to reach the registry as one StorageError line (exit class IO) naming
        the registry and the step; the transport has tried ``network.tries`` times."""
        import requests
        import urllib3

        net, host = self.network, self.ref.registry
        start = time.monotonic()
        try:
            yield
        except requests.exceptions.RequestException as exc:
            # What happened, then how long and how often it was tried: a refused port fails
            # each try at once, a silent one takes the whole deadline per try.
            seconds = time.monotonic() - start
            spent = f"{net.tries} {'try' if net.tries == 1 else 'tries'} in {seconds:.1f} s"
            # urllib3's reason: after its retries a timeout reaches requests as MaxRetryError.
            reason = getattr(exc.args[0] if exc.args else None, "reason", exc)
            if isinstance(exc, requests.exceptions.JSONDecodeError):
                why = f"answered what is not JSON ({one_line(exc)[:120]}): {NOT_A_REGISTRY}"
            elif isinstance(reason, urllib3.exceptions.NewConnectionError):
                # A subclass of ConnectTimeoutError in urllib3, but nothing waited here.
                why = f"no connection: {_reason(exc)}, {spent}"
            elif isinstance(exc, requests.exceptions.ConnectTimeout) or isinstance(
                reason, urllib3.exceptions.ConnectTimeoutError
            ):
                why = f"no connection within {net.connect_s:g} s per try, {spent}"
            elif isinstance(exc, requests.exceptions.Timeout) or isinstance(
                reason, urllib3.exceptions.ReadTimeoutError
            ):
                why = (
                    f"no answer: no TLS handshake within {net.connect_s:g} s or no response "
                    f"within {net.read_s:g} s per try, {spent}"
                )
            elif isinstance(exc, requests.exceptions.SSLError):
                detail = _reason(exc)
                hint = "a CA bundle: --ca-file"
                if "WRONG_VERSION_NUMBER" in detail.upper() or "record layer" in detail:
                    hint = "it answers plain HTTP: --plain-http, for a loopback or allowed registry"
                why = f"TLS refused: {detail} ({hint})"
            else:
                why = f"unreachable: {_reason(exc)}, {spent}"
            raise StorageError(f"{host}: {step}: {why}") from exc

    def _ensure_authenticated(self) -> None:
        """Pick oras-py's backend from the registry's challenge to ``/v2/``: a token service
        (``Bearer``) is asked for a token with the credentials, for the scope the client
        needs from the start (a push's reads and writes one token, not a ``pull`` one
        first); a registry that asks for ``Basic`` gets them on every request from the
        first."""
        if self._authenticated:
            return
        with self._transport_errors("GET /v2/"):
            ping = self._registry.session.get(
                f"{self._scheme}://{self.ref.registry}/v2/", verify=self._verify
            )
        # Checked before it counts as done: a push uploads layers from several threads, and
        # one that found the flag set would upload to a server that is no registry.
        _check_is_registry(ping, f"{self.ref.registry}: GET /v2/")
        self._authenticated = True
        challenge = ping.headers.get("Www-Authenticate", "")
        basic = challenge.lower().startswith("basic")
        if basic:
            if self._credentials is None:
                raise StorageError(
                    f"{self.ref.registry}: asks for credentials and none were given "
                    f"({where_looked(self.ref.registry, self._auth)})"
                )
            self._registry.auth = _oras().auth.get_auth_backend(
                "basic", self._registry.session, tls_verify=self._verify
            )
        if self._credentials is not None:
            self._registry.auth.set_basic_auth(
                self._credentials.username, self._credentials.password
            )
            if basic:
                self._registry.headers.update(self._registry.auth.get_auth_header())
            elif challenge.lower().startswith("bearer"):
                self._request_token(challenge)

    def _request_token(self, challenge: str) -> None:
        """A token for this repository and ``actions`` from the challenge's realm, through
        oras-py's token flow; refused credentials are one line naming the realm."""
        header = _oras().auth.utils.parse_auth_header(challenge)
        header.scope = f"repository:{self.ref.repository}:{self._actions}"
        with self._transport_errors(f"a token from {header.realm}"):
            token = self._registry.auth.request_token(header)
        if not token:
            raise StorageError(
                f"{self.ref.registry}: its token service {header.realm} refused the "
                f"credentials of {self._credentials.username if self._credentials else '?'}"
            )
        self._registry.auth.set_token_auth(token)

    def _check(self, response: Any, what: str) -> None:
        if response.status_code in (200, 201, 202, 206):
            return
        status = response.status_code
        if status in (401, 403):
            raise StorageError(f"{what}: the registry refused the credentials (HTTP {status})")
        raise StorageError(f"{what}: HTTP {status} {_error_text(response)}")

    # ---------------------------------------------------------------- manifests

    def get_manifest(self, reference: str, accept: tuple[str, ...]) -> tuple[bytes, str]:
        """A manifest's exact bytes and media type; a missing one is MissingGenerationError."""
        url = self._url(f"manifests/{reference}")
        what = (
            f"{self.ref.name}@{reference}" if ":" in reference else f"{self.ref.name}:{reference}"
        )
        headers = {"Accept": ", ".join(accept)}
        with self._request("GET", url, headers=headers, stream=True) as response:
            if response.status_code == 404:
                raise MissingGenerationError(f"{what}: not in the registry")
            self._check(response, what)
            data = self._small_body(response, f"GET {step_of(url)}")
            media_type = response.headers.get("Content-Type", "")
        if len(data) > MAX_MANIFEST_BYTES:
            raise IntegrityError(f"{what}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
        return data, media_type.split(";")[0].strip()

    def _small_body(self, response: Any, step: str) -> bytes:
        """A manifest's bytes, at most ``MAX_MANIFEST_BYTES + 1``, at the floor rate."""
        import requests
        import urllib3

        data = bytearray()
        with RateFloor(response, self.network) as floor:
            try:
                while len(data) <= MAX_MANIFEST_BYTES and (
                    chunk := response.raw.read1(MAX_MANIFEST_BYTES + 1 - len(data), True)
                ):
                    data += chunk
                    floor.add(len(chunk))
            except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError):
                if floor.tripped is None:
                    raise
        if floor.tripped is not None:
            raise StorageError(f"{self.ref.registry}: {step}: the answer came {floor.tripped}")
        return bytes(data)

    def put_manifest(self, reference: str, data: bytes, media_type: str) -> None:
        """Upload a manifest as these very bytes (its digest is theirs)."""
        url = self._url(f"manifests/{reference}")
        headers = {"Content-Type": media_type}
        response = self._request("PUT", url, data=data, headers=headers)
        self._check(response, f"{self.ref.name}: manifest {reference}")

    # ---------------------------------------------------------------- blobs

    def has_blob(self, digest: str) -> bool:
        response = self._request("HEAD", self._url(f"blobs/{digest}"))
        return bool(response.status_code == 200)

    def upload_blob(self, path: Path, digest: str, size: int) -> None:
        """Upload a file as a blob (in chunks when big), unless the registry holds it."""
        layer = {"digest": digest, "size": size}
        self._ensure_authenticated()
        try:
            with self._transport_errors(f"upload of blob {digest}"):
                response = self._registry.upload_blob(
                    os.fspath(path),
                    self._container,
                    layer,
                    do_chunked=size > CHUNK,
                    chunk_size=CHUNK,
                )
        except ValueError as exc:  # oras-py: an upload session it could not follow
            raise StorageError(f"{self.ref.name}: blob {digest}: {one_line(exc)}") from exc
        self._check(response, f"{self.ref.name}: blob {digest}")

    @contextmanager
    def blob(self, digest: str, what: str) -> Iterator[Iterator[bytes]]:
        """A blob's bytes as they arrive (unchecked: the caller hashes them). One that
        breaks off or goes silent is asked for again from the byte where it stopped
        (``Range``), up to ``network.tries`` times in all."""
        chunks = self._chunks(digest, what)
        try:
            yield chunks
        finally:
            chunks.close()

    def _chunks(self, digest: str, what: str) -> Generator[bytes, None, None]:
        import requests
        import urllib3

        received, tries = 0, 0
        while True:
            tries += 1
            headers = {"Range": f"bytes={received}-"} if received else {}
            response = self._request(
                "GET", self._url(f"blobs/{digest}"), stream=True, headers=headers
            )
            with response:
                if response.status_code == 404:
                    raise IntegrityError(f"{what}: missing from the registry")
                self._check(response, what)
                if received and response.status_code != 206:
                    raise StorageError(
                        f"{what}: broke off at byte {received} and the "
                        f"registry cannot resume it (HTTP {response.status_code} to a Range)"
                    )
                # A blob is bytes as stored: read it as urllib3 receives it (decoding, with
                # its copy into a buffer, only for a registry that sends it content-encoded).
                encoded = response.headers.get("Content-Encoding", "identity") != "identity"
                failure: Exception | None = None
                # read1: each piece as it arrives, so the floor sees a trickle byte by byte.
                with RateFloor(response, self.network) as floor:
                    try:
                        while chunk := response.raw.read1(READ_CHUNK, decode_content=encoded):
                            received += len(chunk)
                            floor.add(len(chunk))
                            yield chunk
                    except (
                        requests.exceptions.RequestException,
                        urllib3.exceptions.HTTPError,
                        OSError,
                    ) as exc:
                        failure = exc
                if failure is None and floor.tripped is None:
                    return
                if tries < self.network.tries and not encoded:
                    continue
                stalled = isinstance(failure, urllib3.exceptions.ReadTimeoutError)
                why = (
                    floor.tripped
                    or (f"silent for {self.network.read_s:g} s" if stalled else None)
                    or f"broke off: {_reason(failure) if failure else 'closed early'}"
                )
                raise StorageError(
                    f"{what}: the download {why} at byte {received}, "
                    f"{tries} {'try' if tries == 1 else 'tries'}"
                ) from failure


def _unretried_registry(oras: Any) -> type:
    """oras-py's Registry without its retry loop (five tries, sleeping 3 to 83 s between
    them, for any error: an unreachable registry took minutes to report). A pull that fails
    is retried by whoever runs it (the kubelet, the Job's backoff), at once and visibly.
    Every request carries the client's own headers (the basic credentials), which oras-py
    adds to some requests only.

    A token registry's 401 to a request made with a token asks for another one: a push's
    first write needs scope ``pull,push`` where its reads got a token for ``pull``, and a
    token expires (5 minutes is usual) during a long pull. oras-py offers the token it holds
    once more and fails; this drops it and asks the realm for the scope now asked for."""
    unretried = oras.provider.Registry.do_request.__wrapped__

    class Registry(oras.provider.Registry):
        def do_request(
            self, url: str, method: str = "GET", *args: Any, headers: Any = None, **kwargs: Any
        ) -> Any:
            def send() -> Any:
                return unretried(
                    self, url, method, *args, headers={**self.headers, **(headers or {})}, **kwargs
                )

            response = send()
            if response.status_code == 401 and getattr(self.auth, "token", None) is not None:
                response.close()
                self.auth.token = None
                response = send()
            return response

    return Registry


def _reason(exc: BaseException) -> str:
    """The innermost reason of a requests failure: urllib3 wraps it several times, in
    ``reason``, in ``args`` and as the cause, and its wrappers' text is a repr of the
    connection pool; the socket's or TLS library's own words are at the bottom."""
    seen: set[int] = set()
    reason = exc
    while id(reason) not in seen:
        seen.add(id(reason))
        inner = [
            getattr(reason, "reason", None),
            reason.args[0] if reason.args else None,
            reason.__cause__,
            reason.__context__,
        ]
        found = next((e for e in inner if isinstance(e, BaseException) and id(e) not in seen), None)
        if found is None:
            break
        reason = found
    return one_line(reason)[:300]


NOT_A_REGISTRY = "not an OCI registry (the distribution API answers GET /v2/ with 200 or 401)"


def _check_is_registry(ping: Any, what: str) -> None:
    """A server that is not a registry, said so at the first request: a web server answers
    ``/v2/`` with 404 or a page, and every later step would fail with a JSON parser's words
    or "not in the registry". Only what no registry answers is refused: a 404 (the API is
    not there) or HTML."""
    content_type = ping.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if ping.status_code == 404 or content_type in ("text/html", "application/xhtml+xml"):
        answered = f"HTTP {ping.status_code}" + (f" {content_type}" if content_type else "")
        raise StorageError(f"{what}: answered {answered}: {NOT_A_REGISTRY}")


def _error_text(response: Any) -> str:
    """The registry's own error code and message (the distribution API's errors list)."""
    try:
        errors = response.json().get("errors") or []
        first = errors[0]
        return one_line(f"{first.get('code', '')}: {first.get('message', '')}")[:200]
    except Exception:
        return one_line(response.reason or "")[:200]
