"""The cluster quickstart's exact commands, as the README, ``docs/cluster-quickstart.md`` and
``docs/operations.md`` print them, run with the real helm and kubectl against the API test
double: each ``helm install`` is rendered (``helm template``, same chart and values: what it
would apply) and applied server-side, then each ``kubectl label`` and ``kubectl apply -f
examples/...`` in the order shown.

The double is a bare API server: no Prometheus Operator CRDs (an install that enables the
monitors must still apply: the chart leaves them out), no StorageClass, no kubelet. What it
cannot play (a Ready KernelCache, a pod's logs) is checked from the objects instead: the
kind path's KernelCache compiles on the CPU into a ReadWriteOnce claim, its pod asks for no
GPU, and the labelled node is the arch the KernelCache builds.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, scaled

KUBECTL = REPO / ".tools" / "bin" / "kubectl"
HELM = REPO / ".tools" / "bin" / "helm"

pytestmark = pytest.mark.skipif(
    not (os.access(KUBECTL, os.X_OK) and os.access(HELM, os.X_OK)),
    reason="kubectl or helm is not installed: run scripts/install-kube-tools.sh",
)

from kernelcache.node import arch_from_labels  # noqa: E402
from kernelcache.spec import parse_kernelcache  # noqa: E402
from tests.helpers.operator_cluster import emulated_cluster  # noqa: E402

PAGES = ["README.md", "docs/cluster-quickstart.md", "docs/operations.md"]
# Flags of a release helm template has no use for (it installs nothing).
RELEASE_FLAGS = {"--create-namespace", "--wait", "--atomic"}
# What a bare local cluster has that the double has not: a node to label.
NODE = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "kind-control-plane"}}


def blocks(page: str) -> Iterator[tuple[str, list[str]]]:
    """(info string, its helm and kubectl commands) of each fenced block: continuation lines
    joined, comments dropped."""
    info, lines = None, []
    for line in (REPO / page).read_text().splitlines():
        if line.strip().startswith("```"):
            if info is None:
                info, lines = line.strip()[3:].strip(), []
            else:
                joined: list[str] = []
                for text in lines:
                    if joined and joined[-1].endswith("\\"):
                        joined[-1] = joined[-1][:-1] + " " + text.strip()
                    else:
                        joined.append(text.strip())
                shell = [c for c in joined if c.startswith(("helm ", "kubectl "))]
                yield info, [shlex.join(shlex.split(c, comments=True)) for c in shell]
                info = None
        elif info is not None:
            lines.append(line)


def titled_files(page: str) -> dict[str, str]:
    """The files a page shows whole (a block opened with ``yaml title=NAME``)."""
    found = {}
    text = (REPO / page).read_text().split("```")
    for i in range(1, len(text), 2):
        head, _, body = text[i].partition("\n")
        if "title=" in head:
            found[head.split("title=", 1)[1].strip('"')] = body
    return found


def cluster_steps(page: str) -> list[list[str]]:
    """Each block that changes a cluster, as the commands to run on a fresh one: a block
    without its own ``helm install`` (the kind path: "after the first two lines above") runs
    after the page's last install shown before it."""
    steps, install = [], None
    for info, commands in blocks(page):
        if info.startswith(("yaml", "text")):
            continue
        ours = [c for c in commands if c.startswith(("helm install", "kubectl apply -f examples/",
                                                      "kubectl label nodes"))]  # fmt: skip
        installs = [c for c in ours if c.startswith("helm install")]
        if installs:
            install = installs[-1]
        applies = [c for c in ours if not c.startswith("helm install")]
        if installs or applies:
            steps.append(ours if installs or install is None else [install, *ours])
    return steps


def run(tool: Path, *args: str, stdin: str | None = None, cwd: Path = REPO) -> str:
    proc = subprocess.run(
        [str(tool), *args], input=stdin, capture_output=True, text=True, cwd=cwd,
        timeout=scaled(120),
    )  # fmt: skip
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc.stdout


def kubectl(tmp_path: Path, *args: str, stdin: str | None = None) -> str:
    return run(KUBECTL, "--cache-dir", str(tmp_path / "kube-cache"), *args, stdin=stdin)


def test_every_page_shows_the_kind_path_and_an_install() -> None:
    shown = {page: [c for step in cluster_steps(page) for c in step] for page in PAGES}
    assert any(c.startswith("helm install") for c in shown["docs/operations.md"])
    for page in ("README.md", "docs/cluster-quickstart.md"):
        assert "kubectl apply -f examples/kernelcache-kind.yaml" in shown[page], page
        assert "kubectl apply -f examples/kind-serving-pod.yaml" in shown[page], page
        assert any(c.startswith("kubectl label nodes") for c in shown[page]), page


@pytest.mark.parametrize(
    ("page", "index"),
    [(page, i) for page in PAGES for i in range(len(cluster_steps(page)))],
    ids=lambda v: str(v),
)
def test_a_quickstart_block_applies_as_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: str, index: int
) -> None:
    step = cluster_steps(page)[index]
    for name, text in titled_files(page).items():
        (tmp_path / name).write_text(text)
    with emulated_cluster(tmp_path, monkeypatch, []):
        kubectl(tmp_path, "apply", "--server-side", "--validate=false", "-f", "-",
                stdin=yaml.safe_dump(NODE))  # fmt: skip
        for command in step:
            words = shlex.split(command)
            if words[0] == "helm":
                args = [w for w in words[2:] if w not in RELEASE_FLAGS]
                # A values file the page shows whole was written beside the test's files.
                args = [
                    str(tmp_path / a) if p == "-f" else a
                    for p, a in zip(["", *args[:-1]], args, strict=True)
                ]
                rendered = run(HELM, "template", *args)
                kinds = {d["kind"] for d in yaml.safe_load_all(rendered) if d}
                # Without the Prometheus Operator's CRDs these would fail the whole install.
                assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}, command
                out = kubectl(tmp_path, "apply", "--server-side", "--validate=false", "-f", "-",
                              stdin=rendered)  # fmt: skip
            else:
                out = kubectl(tmp_path, *words[1:], *(["--server-side", "--validate=false"]
                                                      if words[1] == "apply" else []))  # fmt: skip
            assert out.strip(), command
        applied = [w for c in step for w in shlex.split(c)[3:4] if c.startswith("kubectl apply")]
        if "examples/kernelcache-kind.yaml" in applied:
            check_the_kind_path(tmp_path, applied)


def check_the_kind_path(tmp_path: Path, applied: list[str]) -> None:
    """What a GPU-less cluster with only local-path storage needs, read from what was applied."""
    kc = parse_kernelcache(
        yaml.safe_load(kubectl(tmp_path, "get", "kc", "demo", "-n", "default", "-o", "yaml")),
        "kc/demo",
    )
    assert kc.spec.storage.pvc is not None
    assert kc.spec.storage.pvc.access_modes == ["ReadWriteOnce"]  # local-path has no RWX
    for gpu_class in kc.spec.gpu_classes:
        assert gpu_class.compile_on == "cpu" and gpu_class.node_selector == {}
    node = yaml.safe_load(kubectl(tmp_path, "get", "node", "kind-control-plane", "-o", "yaml"))
    arch, _ = arch_from_labels(node["metadata"]["labels"])
    assert arch in kc.spec.arches()  # the serving pod's init-container picks this generation
    if "examples/kind-serving-pod.yaml" in applied:
        pod = yaml.safe_load(kubectl(tmp_path, "get", "pod", "demo-serve", "-n", "default",
                                     "-o", "yaml"))  # fmt: skip
        assert pod["metadata"]["labels"]["kernelcache.dev/cache"] == "demo"
        assert "nodeSelector" not in pod["spec"] and "tolerations" not in pod["spec"]
        for container in pod["spec"]["containers"]:
            assert "nvidia.com/gpu" not in str(container.get("resources", {}))
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("CUTE_DSL_ARCH") == arch
