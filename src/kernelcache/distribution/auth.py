"""Registry credentials: from a docker config (``--authfile``, ``$DOCKER_CONFIG/config.json``,
``~/.docker/config.json``) or a Kubernetes pull secret's ``.dockerconfigjson`` (the same
format, mounted from a Secret)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias


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
    raise NotImplementedError


def default_config(environ: Mapping[str, str] | None = None) -> Path | None:
    """The docker config the environment names, when it exists."""
    raise NotImplementedError
