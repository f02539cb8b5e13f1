"""An artifact's reference, ``registry/repository[:tag][@sha256:<hex>]``, parsed strictly."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kernelcache.errors import SpecError

# The distribution spec's grammar, restricted to what a push or pull needs: a registry host
# (with a dot, a colon or "localhost", so "library/x" is never mistaken for a host), a
# repository of lower-case path components, an optional tag, an optional sha256 digest.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REFERENCE = re.compile(
    r"^(?P<registry>(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*(?::[0-9]+)?))/"
    rf"(?P<repository>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port]
    repository: str
    tag: str | None = None
    digest: str | None = None  # "sha256:<hex>"

    @property
    def name(self) -> str:
        """``registry/repository``: what a digest or tag is appended to."""
        return f"{self.registry}/{self.repository}"

    def with_digest(self, digest: str) -> str:
        """``registry/repository@sha256:…``: the immutable reference a puller uses."""
        return f"{self.name}@{digest}"

    def __str__(self) -> str:
        text = self.name
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text

    @classmethod
    def parse(cls, text: str) -> Reference:
        """A reference, or a SpecError naming what is wrong with it."""
        match = _REFERENCE.match(text)
        if match is None:
            raise SpecError(
                f"reference {text!r}: expected REGISTRY/REPOSITORY[:TAG][@sha256:<64 hex>] "
                "(the registry a host with a dot or a port, or localhost)"
            )
        registry = match["registry"]
        if "." not in registry and ":" not in registry and registry != "localhost":
            raise SpecError(f"reference {text!r}: {registry!r} is not a registry host")
        return cls(registry, match["repository"], match["tag"], match["digest"])
