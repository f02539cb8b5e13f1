"""Registry credentials: from a docker config (``--authfile``, ``$DOCKER_CONFIG/config.json``,
``~/.docker/config.json``) or a Kubernetes pull secret's ``.dockerconfigjson`` (the same
format, mounted from a Secret)."""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from kernelcache.errors import SpecError, one_line


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = ""

    def __repr__(self) -> str:  # never a password in a log or a traceback
        return f"Credentials(username={self.username!r}, password=<hidden>)"


# What push and pull take as ``auth``: credentials, a docker config file to find them in, or
# None (the environment's docker config; anonymous when it names no credentials).
AuthLike: TypeAlias = "Credentials | str | os.PathLike[str] | None"


def credentials_for(
    registry: str, auth: AuthLike = None, environ: Mapping[str, str] | None = None
) -> Credentials | None:
    """The credentials for ``registry`` (host[:port]), or None for anonymous access.

    ``auth`` a file: that docker config or ``.dockerconfigjson`` must exist and parse (a
    SpecError naming it otherwise); None: ``$DOCKER_CONFIG/config.json``, else
    ``~/.docker/config.json``, when present. An entry's ``auth`` (base64 user:password) or
    its ``username``/``password`` are read; the entry may be keyed by the host or by a URL
    of it (``https://host/v1/``), as docker and the kubelet accept.
    """
    if isinstance(auth, Credentials):
        return auth
    path = _config_path(auth, environ)
    if path is None:
        return None
    for name, entry in _read_auths(path).items():
        if _host_of(name) == registry:
            return _entry_credentials(entry, f"{path}: auths.{name}")
    return None


def where_looked(registry: str, auth: AuthLike = None) -> str:
    """Where ``credentials_for`` looked and found none, for the line that says so: the file
    itself when there was one (in a pod, the mounted pull secret)."""
    path = None if isinstance(auth, Credentials) else _config_path(auth, None)
    if path is None:
        return "no docker config (--authfile, DOCKER_CONFIG or ~/.docker/config.json)"
    return f"no entry for {registry} in {path}"


def _config_path(
    auth: str | os.PathLike[str] | None, environ: Mapping[str, str] | None
) -> Path | None:
    return Path(auth) if auth is not None else default_config(environ)


def default_config(environ: Mapping[str, str] | None = None) -> Path | None:
    """The docker config the environment names, when it exists: ``$DOCKER_CONFIG/config.json``
    (docker's own variable), else ``~/.docker/config.json``."""
    env = os.environ if environ is None else environ
    directory = env.get("DOCKER_CONFIG")
    path = Path(directory) / "config.json" if directory else Path.home() / ".docker/config.json"
    return path if path.is_file() else None


def _read_auths(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_bytes())
    except OSError as exc:
        raise SpecError(f"{path}: cannot read registry credentials: {exc.strerror}") from exc
    except ValueError as exc:
        raise SpecError(f"{path}: not a docker config: {one_line(exc)}") from exc
    auths = document.get("auths") if isinstance(document, dict) else None
    if not isinstance(auths, dict):
        raise SpecError(f"{path}: not a docker config: no 'auths' object")
    return auths


def _host_of(name: str) -> str:
    """The host[:port] of an ``auths`` key: a bare host, or a URL of one (docker's
    ``https://index.docker.io/v1/``)."""
    return name.split("://", 1)[-1].split("/", 1)[0]


def _entry_credentials(entry: object, where: str) -> Credentials:
    if not isinstance(entry, dict):
        raise SpecError(f"{where}: not an object")
    if isinstance(entry.get("auth"), str) and entry["auth"]:
        try:
            decoded = base64.b64decode(entry["auth"], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise SpecError(f"{where}.auth: not base64 of user:password") from exc
        username, sep, password = decoded.partition(":")
        if not sep:
            raise SpecError(f"{where}.auth: not base64 of user:password (no colon)")
        return Credentials(username, password)
    user, secret = entry.get("username"), entry.get("password", "")
    if isinstance(user, str) and user and isinstance(secret, str):
        return Credentials(user, secret)
    raise SpecError(f"{where}: neither 'auth' nor 'username' and 'password'")
