"""Image references compared as container runtimes resolve them (``kernelcache.images``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

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


# --- make images / load-images / push-images ----------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
BUILDERS = ("docker", "podman", "nerdctl", "buildah")
SYSTEM_PATH = "/usr/bin:/bin"
DEFAULTS = {
    "operator": "ghcr.io/kernelcache/kernelcache-operator:0.1.0",
    "init": "ghcr.io/kernelcache/kernelcache-init:0.1.0",
    "examples": "ghcr.io/kernelcache/examples:0.1.0",
}
DOCKERFILES = {"operator": "operator/Dockerfile", "init": "initcontainer/Dockerfile",
               "examples": "examples/Dockerfile"}  # fmt: skip


def make(tmp: Path, fakes: tuple[str, ...], *args: str) -> tuple[subprocess.CompletedProcess, list]:
    """``make ARGS`` with only ``fakes`` of the builders and cluster tools on PATH, each
    recording its arguments; returns the run and the recorded calls."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    if real := [b for b in (*BUILDERS, "kind", "k3d") if shutil.which(b, path=SYSTEM_PATH)]:
        pytest.skip(f"{real} on {SYSTEM_PATH} would shadow the fakes' absence")
    bin_dir, log = tmp / "bin", tmp / "calls.log"
    bin_dir.mkdir(exist_ok=True)
    for fake in fakes:
        (bin_dir / fake).write_text(f'#!/bin/sh\necho "{fake} $*" >> "{log}"\n')
        (bin_dir / fake).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("REGISTRY", "TAG", "IMAGES", "BUILDER")}
    proc = subprocess.run(
        ["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
        timeout=60, env={**env, "PATH": f"{bin_dir}:{SYSTEM_PATH}"},
    )  # fmt: skip
    calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


@pytest.mark.parametrize("builder", BUILDERS)
def test_make_images_builds_what_the_chart_and_examples_name_with_any_builder(tmp_path, builder):
    proc, calls = make(tmp_path, (builder,), "images")
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        [builder, "build", "-f", DOCKERFILES[image], "-t", DEFAULTS[image], "."]
        for image in ("operator", "init", "examples")
    ]


def test_make_images_says_when_no_builder_is_installed(tmp_path):
    proc, _ = make(tmp_path, (), "images")
    assert proc.returncode != 0
    assert "images: no image builder on PATH: install docker, podman, nerdctl or buildah" in (
        proc.stderr
    )


def test_the_built_names_are_the_defaults_of_the_chart_and_examples():
    values = yaml.safe_load((REPO / "charts" / "kernelcache" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "kernelcache" / "Chart.yaml").read_text())
    assert f"{values['image']['repository']}:{chart['appVersion']}" == DEFAULTS["operator"]
    assert values["operator"]["initImage"] == DEFAULTS["init"]
    spec = yaml.safe_load((REPO / "examples" / "kernelcache.yaml").read_text())
    assert spec["spec"]["engine"]["image"] == DEFAULTS["examples"]
    from kernelcache.controller.config import OperatorConfig

    assert OperatorConfig().init_image == DEFAULTS["init"]


def test_every_image_the_docs_and_examples_name_is_one_make_images_builds():
    texts = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "examples").iterdir(),
             REPO / "charts" / "kernelcache" / "values.yaml"]  # fmt: skip
    built = {ref.rsplit(":", 1)[0].rsplit("/", 1)[1] for ref in DEFAULTS.values()}
    built.add("kernelcache-serving")
    for path in texts:
        if path.suffix not in (".md", ".yaml", ".py", "") and path.name != "Dockerfile":
            continue
        for name in re.findall(r"ghcr\.io/kernelcache/([a-z0-9-]+)", path.read_text()):
            assert name in built, f"{path.relative_to(REPO)}: ghcr.io/kernelcache/{name}"
        for name in re.findall(r"\$REGISTRY/([a-z0-9-]+)", path.read_text()):
            assert name in built, f"{path.relative_to(REPO)}: $REGISTRY/{name}"


@pytest.mark.parametrize(
    ("cluster", "loader"),
    [("kind", ["kind", "load", "image-archive", "--name", "kind"]),
     ("k3d", ["k3d", "image", "import", "--cluster", "k3s-default"])],
)  # fmt: skip
def test_make_load_images_imports_an_archive_of_each_image(tmp_path, cluster, loader):
    proc, calls = make(tmp_path, ("podman", cluster), "load-images", f"CLUSTER={cluster}")
    assert proc.returncode == 0, proc.stderr
    saves = [c for c in calls if c[0] == "podman"]
    assert [(c[1], c[4]) for c in saves] == [("save", DEFAULTS[i]) for i in DEFAULTS]
    loads = [c for c in calls if c[0] == cluster]
    assert [[w for w in c if not w.endswith(".tar")] for c in loads] == [loader] * 3
    assert [c[3] for c in saves] == [next(w for w in c if w.endswith(".tar")) for c in loads]


def test_buildah_images_are_loaded_through_a_docker_archive(tmp_path):
    proc, calls = make(tmp_path, ("buildah", "kind"), "load-images", "CLUSTER=kind", "IMAGES=init")
    assert proc.returncode == 0, proc.stderr
    (push, load) = calls
    assert push[:3] == ["buildah", "push", DEFAULTS["init"]]
    assert push[3].startswith("docker-archive:") and push[3].endswith(":" + DEFAULTS["init"])
    assert load[:3] == ["kind", "load", "image-archive"]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ((), "CLUSTER=kind or CLUSTER=k3d"),
        (("CLUSTER=minikube",), "CLUSTER=kind or CLUSTER=k3d"),
        (("CLUSTER=kind",), "images: kind is not on PATH"),
        (("CLUSTER=k3d", "IMAGES=operatr"), "unknown image 'operatr' in IMAGES"),
    ],
)
def test_make_load_images_names_what_is_missing(tmp_path, args, line):
    fakes = ("docker", "k3d") if "CLUSTER=k3d" in args else ("docker",)
    proc, _ = make(tmp_path, fakes, "load-images", *args)
    assert proc.returncode != 0 and line in proc.stderr, proc.stderr


def test_make_push_images_needs_a_registry_and_prints_the_values_to_set(tmp_path):
    refused, calls = make(tmp_path, ("docker",), "push-images")
    assert refused.returncode != 0 and "set REGISTRY to a registry your nodes pull from" in (
        refused.stderr
    )
    assert calls == []
    registry = "REGISTRY=registry.example.com/ml"
    built, _ = make(tmp_path, ("docker",), "images", registry)
    assert "--set operator.initImage=registry.example.com/ml/kernelcache-init:0.1.0" in built.stdout
    pushed, calls = make(tmp_path, ("docker",), "push-images", registry)
    assert pushed.returncode == 0, pushed.stderr
    assert [c for c in calls if c[1] == "push"] == [
        ["docker", "push", f"registry.example.com/ml/{n}:0.1.0"]
        for n in ("kernelcache-operator", "kernelcache-init", "examples")
    ]
