"""Image references compared as container runtimes resolve them (``kernelcache.images``)."""

from __future__ import annotations

import pytest

from kernelcache.images import ImageReference, InvalidImageReference, parse_image, same_image

A, B = "sha256:" + "a" * 64, "sha256:" + "b" * 64


@pytest.mark.parametrize(
    ("reference", "resolved"),
    [
        ("vllm/vllm-openai:v0.12.0", ("docker.io/vllm/vllm-openai", "v0.12.0", None)),
        ("docker.io/vllm/vllm-openai:v0.12.0", ("docker.io/vllm/vllm-openai", "v0.12.0", None)),
        (
            "index.docker.io/vllm/vllm-openai:v0.12.0",
            ("docker.io/vllm/vllm-openai", "v0.12.0", None),
        ),
        ("ubuntu", ("docker.io/library/ubuntu", "latest", None)),
        ("library/ubuntu:24.04", ("docker.io/library/ubuntu", "24.04", None)),
        ("docker.io/library/ubuntu:latest", ("docker.io/library/ubuntu", "latest", None)),
        ("registry.local:5000/team/vllm", ("registry.local:5000/team/vllm", "latest", None)),
        ("localhost:5000/vllm:1", ("localhost:5000/vllm", "1", None)),
        (f"ghcr.io/org/vllm@{A}", ("ghcr.io/org/vllm", None, A)),  # a digest alone: no tag
        (f"ghcr.io/org/vllm:1@{A}", ("ghcr.io/org/vllm", "1", A)),
    ],
)
def test_references_resolve_as_runtimes_pull_them(
    reference: str, resolved: tuple[str, str | None, str | None]
) -> None:
    assert parse_image(reference) == ImageReference(*resolved)


@pytest.mark.parametrize(
    ("built", "expected", "match"),
    [
        ("vllm/vllm-openai:v0.12.0", "docker.io/vllm/vllm-openai:v0.12.0", True),
        ("index.docker.io/vllm/vllm-openai:v0.12.0", "vllm/vllm-openai:v0.12.0", True),
        ("ubuntu", "docker.io/library/ubuntu:latest", True),
        ("library/ubuntu", "ubuntu:latest", True),
        ("ubuntu", "ubuntu:24.04", False),
        ("registry.local:5000/vllm:1", "registry.local/vllm:1", False),  # the port is the registry
        ("ghcr.io/vllm/vllm-openai:v0.12.0", "vllm/vllm-openai:v0.12.0", False),
        (f"r.io/vllm:1@{A}", f"r.io/vllm:1@{A}", True),
        (f"r.io/vllm:1@{A}", f"mirror.io/vllm:1@{A}", True),  # same content, other name
        (f"r.io/vllm:1@{A}", f"r.io/vllm:1@{B}", False),
        (f"r.io/vllm:1@{A}", "r.io/vllm:1", True),  # the pod names a tag only
        ("r.io/vllm:1", f"r.io/vllm:1@{A}", True),
        ("r.io/vllm:1", "r.io/vllm:2", False),
        (f"r.io/vllm:1@{A}", f"r.io/vllm@{B}", False),
    ],
)
def test_same_image(built: str, expected: str, match: bool) -> None:
    assert same_image(built, expected) is match


@pytest.mark.parametrize(
    ("reference", "why"),
    [
        ("vllm/VLLM-openai:v1", "must be lowercase"),
        ("vllm/vllm-openai@sha256:abc", "invalid reference format"),  # a digest too short
        ("vllm/vllm-openai@sha256:" + "A" * 64, "invalid digest"),
        ("vllm/vllm openai", "invalid reference format"),
        ("", "at least one component"),
    ],
)
def test_references_no_runtime_pulls_are_refused(reference: str, why: str) -> None:
    with pytest.raises(InvalidImageReference, match=why) as refused:
        same_image(reference, "vllm/vllm-openai:v1")
    assert repr(reference) in str(refused.value)
