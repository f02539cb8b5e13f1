"""Container image references, compared as container runtimes resolve them.

``vllm/vllm-openai:v0.12.0``, ``docker.io/vllm/vllm-openai:v0.12.0`` and
``index.docker.io/vllm/vllm-openai:v0.12.0`` pull the same image; ``ubuntu`` is
``docker.io/library/ubuntu:latest``. The parsing is distribution's own grammar and Docker's
familiar-name rules (default registry ``docker.io``, ``library/`` for official images), as
``docker-image-py`` implements them; the one rule it leaves to its caller, ``latest`` for a
reference with neither tag nor digest, is applied here. A reference the grammar refuses (an
uppercase repository, a malformed digest) is an ``InvalidImageReference``, never a string
that happens not to match.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TAG = "latest"


class InvalidImageReference(ValueError):
    """Not an image reference a container runtime would pull; the message says why."""


@dataclass(frozen=True)
class ImageReference:
    name: str  # fully qualified: registry[:port]/path
    tag: str | None
    digest: str | None


def parse_image(reference: str) -> ImageReference:
    """The reference as a runtime resolves it: registry, ``library/`` and tag filled in."""
    from docker_image.reference import Reference  # only where references are compared

    try:
        parsed = Reference.parse_normalized_named(reference)
    except Exception as exc:  # the library's errors share no base class beyond Exception
        raise InvalidImageReference(f"{reference!r}: {exc}") from None
    tag, digest = parsed["tag"], parsed["digest"]
    return ImageReference(parsed["name"], tag or (None if digest else DEFAULT_TAG), digest)


def same_image(built: str, expected: str) -> bool:
    """Same content: equal digests when both name one (a mirror keeps the digest but not the
    name), else the same repository and tag (a tag-only pod cannot be held to a digest)."""
    left, right = parse_image(built), parse_image(expected)
    if left.digest and right.digest:
        return left.digest == right.digest
    return (left.name, left.tag) == (right.name, right.tag)
