"""A token service for the registry's ``auth: token`` scheme (the distribution spec's token
authentication, as Docker Hub, Harbor, GitLab and Quay run it): the registry answers an
unauthenticated request with ``Bearer realm=…,service=…,scope=…``; the client sends its
credentials (HTTP basic) to the realm and gets a JWT granting that scope, which the registry
checks against the certificate it trusts (``rootcertbundle``).

The JWT is ES256, signed by a key whose self-signed certificate travels in the token's
``x5c`` header (how distribution finds the key when no ``kid`` names it). Served over TLS on
a port the kernel picks, in a thread of the test process; every grant is recorded.
"""

from __future__ import annotations

import base64
import datetime
import json
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID
from tests.helpers.local_http import local_server

SERVICE, ISSUER = "kernelcache-test-registry", "kernelcache-test-token-issuer"


@dataclass
class TokenService:
    realm: str  # https://127.0.0.1:<port>/token
    cert_file: Path  # the signing certificate the registry trusts (rootcertbundle)
    granted: list[str] = field(default_factory=list)  # "user scope" of every token issued
    refused: int = 0  # requests with wrong or no credentials
    lifetime: int = 300  # seconds from issue to a token's exp (the registry allows 60 more)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _signing_key(folder: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, Path]:
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kernelcache test token signer")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .sign(key, hashes.SHA256())
    )
    cert_file = folder / "token-signer.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, cert_file


def _token(
    key: ec.EllipticCurvePrivateKey,
    cert: x509.Certificate,
    user: str,
    scopes: list[str],
    lifetime: int,
) -> str:
    """A JWT as distribution checks it: issuer, audience (the service), times, and an
    ``access`` claim per scope ``repository:NAME:ACTIONS``."""
    now = int(time.time())
    access = []
    for scope in scopes:
        kind, _, rest = scope.partition(":")
        name, _, actions = rest.rpartition(":")
        access.append({"type": kind, "name": name, "actions": actions.split(",")})
    header = {
        "typ": "JWT",
        "alg": "ES256",
        "x5c": [base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()],
    }
    claims = {
        "iss": ISSUER, "sub": user, "aud": SERVICE, "exp": now + lifetime,
        "nbf": now - 70, "iat": now - 70, "jti": secrets.token_hex(8), "access": access,
    }  # fmt: skip
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    r, s = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
    return f"{signing_input}.{_b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


@contextmanager
def running_token_service(
    folder: Path, tls_cert: Path, tls_key: Path, users: dict[str, str]
) -> Iterator[TokenService]:
    """Serve ``GET /token?service=…&scope=…`` with HTTP basic credentials of ``users``."""
    key, cert, cert_file = _signing_key(folder)
    service = TokenService("", cert_file)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            query = parse_qs(urlparse(self.path).query)
            user = self._user()
            if user is None or query.get("service") != [SERVICE]:
                service.refused += 1
                self._reply(401, {"details": "incorrect username or password"})
                return
            scopes = query.get("scope", [])
            service.granted.extend(f"{user} {scope}" for scope in scopes)
            token = _token(key, cert, user, scopes, service.lifetime)
            self._reply(200, {"token": token, "access_token": token, "expires_in": 300})

        def _user(self) -> str | None:
            scheme, _, encoded = self.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "basic":
                return None
            user, _, password = base64.b64decode(encoded).decode().partition(":")
            return user if users.get(user) == password else None

        def _reply(self, status: int, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    with local_server(Handler, tls_cert, tls_key) as port:
        service.realm = f"https://127.0.0.1:{port}/token"
        yield service
