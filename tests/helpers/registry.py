"""A real registry for the tests: Debian's ``docker-registry`` (distribution 2.8.2) serving
TLS with a certificate from a CA made here, behind htpasswd basic auth; and ``skopeo``, an
independent client, pointed at it.

The registry listens on a port the kernel picks (``127.0.0.1:0``) and says which in its log;
the fixture waits for that line, not for a time.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tests.conftest import scaled, system_tool
from tests.helpers.token_service import ISSUER, SERVICE, TokenService, running_token_service

USER, PASSWORD = "pusher", "s3cret-pw"


@dataclass(frozen=True)
class Registry:
    host: str  # 127.0.0.1:<port>
    storage: Path  # the filesystem driver's root: where a test damages a blob
    ca_file: Path  # the CA the server certificate chains to (PEM)
    cert_dir: Path  # the same CA as skopeo's --cert-dir wants it (ca.crt)
    authfile: Path  # a docker config with the credentials
    tokens: TokenService | None = None  # the token service, for a registry with token auth

    def repo(self, name: str) -> str:
        return f"{self.host}/{name}"

    def blob_file(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (manifests are blobs too)."""
        hexdigest = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"

    def skopeo(self, *args: str, creds: bool = True) -> subprocess.CompletedProcess:
        """``skopeo COMMAND`` with this registry's CA and (by default) its credentials;
        ``args`` start with the command (inspect, copy)."""
        command, *rest = args
        flags = {"inspect": ["--cert-dir"], "copy": ["--src-cert-dir"]}[command]
        auth = {"inspect": ["--creds"], "copy": ["--src-creds"]}[command]
        extra = [*flags, str(self.cert_dir)] + ([*auth, f"{USER}:{PASSWORD}"] if creds else [])
        return subprocess.run(
            [system_tool("skopeo"), command, *extra, *rest],
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate for 127.0.0.1 and localhost signed by it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kernelcache test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False,
        ), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    ca_file, cert_file, key_file = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    ca_file.write_bytes(ca.public_bytes(pem))
    cert_file.write_bytes(cert.public_bytes(pem))
    key_file.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return ca_file, cert_file, key_file


def authfile(path: Path, host: str, user: str = USER, password: str = PASSWORD) -> Path:
    """A docker config holding credentials for host (``auth``: base64 of user:password)."""
    import base64

    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": token}}}))
    return path


@contextmanager
def running_registry(folder: Path, token_auth: bool = False) -> Iterator[Registry]:
    """Start ``docker-registry serve`` with TLS and basic auth (htpasswd), or with
    ``token_auth`` the token scheme against a token service started here
    (``tests.helpers.token_service``: the same user and password); stop both on exit."""
    with ExitStack() as stack:
        yield stack.enter_context(_running(folder, stack, token_auth))


@contextmanager
def _running(folder: Path, stack: ExitStack, token_auth: bool) -> Iterator[Registry]:
    binary = system_tool("docker-registry")
    folder.mkdir(parents=True, exist_ok=True)
    ca_file, cert_file, key_file = _certificates(folder)
    cert_dir = folder / "certs.d"
    cert_dir.mkdir()
    (cert_dir / "ca.crt").write_bytes(ca_file.read_bytes())
    tokens: TokenService | None = None
    if token_auth:
        tokens = stack.enter_context(
            running_token_service(folder, cert_file, key_file, {USER: PASSWORD})
        )
        auth: dict[str, object] = {"token": {
            "realm": tokens.realm, "service": SERVICE, "issuer": ISSUER,
            "rootcertbundle": str(tokens.cert_file),
        }}  # fmt: skip
    else:
        users = folder / "htpasswd"
        htpasswd = system_tool("htpasswd")
        subprocess.run(
            [htpasswd, "-Bbc", str(users), USER, PASSWORD], check=True, capture_output=True
        )
        auth = {"htpasswd": {"realm": "kernelcache-tests", "path": str(users)}}
    storage = folder / "storage"
    config = {
        "version": 0.1,
        "log": {"level": "info", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
        "http": {
            "addr": "127.0.0.1:0",
            "secret": hashlib.sha256(str(folder).encode()).hexdigest(),
            "tls": {"certificate": str(cert_file), "key": str(key_file)},
        },
        "auth": auth,
    }
    config_file = folder / "config.yml"
    config_file.write_text(json.dumps(config))  # YAML is a superset of JSON
    log = folder / "registry.log"
    process = subprocess.Popen(
        [binary, "serve", str(config_file)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    listening: list[str] = []
    ready = threading.Event()

    def read_log() -> None:
        assert process.stderr is not None
        with log.open("w") as out:
            for line in process.stderr:
                out.write(line)
                out.flush()
                if not listening and 'msg="listening on ' in line:
                    listening.append(line.split('msg="listening on ', 1)[1].split(",")[0])
                    ready.set()
        ready.set()  # exited: do not wait any longer

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        ready.wait(timeout=scaled(120))  # an event: the line, or the log closing when it exits
        assert listening, f"docker-registry did not start: {log.read_text()[-2000:]}"
        host = listening[0].split('"')[0]
        credentials = authfile(folder / "auth.json", host)
        yield Registry(host, storage, ca_file, cert_dir, credentials, tokens)
    finally:
        process.terminate()
        try:
            process.wait(timeout=scaled(30))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(timeout=30)
