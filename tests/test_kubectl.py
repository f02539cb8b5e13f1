"""The real kubectl against the operator on the Kubernetes API test double (``k8s_emulator``).

What a user does after installing: ``kubectl apply`` the CRD and a KernelCache, then
``kubectl get kc``. kubectl finds the resource (and its short name) through API discovery of
the applied CRD, and prints the server-side Table rendered from its printer columns, with the
status the operator wrote. The binaries come from ``scripts/install-kube-tools.sh``.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KUBECTL = REPO / ".tools" / "bin" / "kubectl"
CRD = REPO / "crds" / "kernelcache.dev_kernelcaches.yaml"

pytestmark = pytest.mark.skipif(
    not os.access(KUBECTL, os.X_OK),
    reason="kubectl is not installed: run scripts/install-kube-tools.sh",
)

from kernelcache.controller.kube import kernelcache_path  # noqa: E402
from kernelcache.controller.manifests import LABEL_ARCH, peering_crds  # noqa: E402
from tests.conftest import scaled  # noqa: E402
from tests.helpers.operator_cluster import (  # noqa: E402
    EXAMPLE,
    NS,
    Cluster,
    emulated_cluster,
    operator,
    result_message,
    wait_until,
)


def kubectl(tmp_path: Path, *args: str) -> str:
    """Run kubectl on ``$KUBECONFIG`` (the emulator); fail on an error or any warning."""
    proc = subprocess.run(
        [str(KUBECTL), "--cache-dir", str(tmp_path / "kube-cache"), *args],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 0 and not proc.stderr, (args, proc.stdout, proc.stderr)
    return proc.stdout


def table(output: str) -> list[list[str]]:
    return [line.split() for line in output.strip().splitlines()]


@pytest.fixture
def bare_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """An emulator with kopf's peering CRDs only: the KernelCache CRD comes from kubectl."""
    with emulated_cluster(tmp_path, monkeypatch, peering_crds()) as cluster:
        yield cluster


def test_kubectl_apply_then_get_shows_the_printer_columns(
    bare_cluster: Cluster, tmp_path: Path
) -> None:
    cluster = bare_cluster
    out = kubectl(tmp_path, "apply", "--validate=false", "-f", str(CRD))
    assert (
        out.strip()
        == "customresourcedefinition.apiextensions.k8s.io/kernelcaches.kernelcache.dev created"
    )
    resources = table(kubectl(tmp_path, "api-resources", "--api-group=kernelcache.dev"))
    assert resources[1] == ["kernelcaches", "kc", "kernelcache.dev/v1alpha1", "true", "KernelCache"]

    with operator(cluster):
        out = kubectl(tmp_path, "apply", "--validate=false", "-f", str(EXAMPLE))
        assert out.strip() == "kernelcache.kernelcache.dev/demo created"
        wait_until(lambda: len(cluster.jobs()) == 2, what="the compile Jobs")
        assert {j["metadata"]["labels"][LABEL_ARCH] for j in cluster.jobs()} == {
            "sm_90a",
            "sm_120a",
        }
        wait_until(lambda: cluster.status("demo").get("readyArches") == "0/2", what="status")

        columns = ["NAME", "MODEL", "SERVING", "READY", "PHASE", "AGE"]
        wide = ["ARCHES", "GENERATIONS", "STAMPS", "MESSAGE"]  # -o wide: priority 1 columns
        for args in (["get", "kc"], ["get", "kernelcaches", "-o", "wide"], ["get", "kc", "demo"]):
            rows = table(kubectl(tmp_path, *args))
            assert rows[0] == columns + (wide if "wide" in args else []), args
            assert len(rows) == 2, rows
            assert rows[1][:5] == ["demo", "example/elementwise-and-tiled", "0/2", "0/2", "Pending"]
            assert re.fullmatch(r"\d+s", rows[1][5]), rows

        # The stored object round-trips: apply again changes nothing.
        out = kubectl(tmp_path, "apply", "--validate=false", "-f", str(EXAMPLE))
        assert out.strip() == "kernelcache.kernelcache.dev/demo unchanged"
        phase = kubectl(tmp_path, "get", "kc", "demo", "-o", "jsonpath={.status.phase}")
        assert phase == "Pending"


def test_kubectl_get_during_a_change_shows_what_serves_beside_what_builds(
    bare_cluster: Cluster, tmp_path: Path
) -> None:
    """A spec change rebuilds every arch while the previous generations still serve; an
    engine-image change serves pods of the new image nothing yet, and says so."""
    cluster = bare_cluster
    kubectl(tmp_path, "apply", "--validate=false", "-f", str(CRD))
    with operator(cluster):
        kubectl(tmp_path, "apply", "--validate=false", "-f", str(EXAMPLE))
        for arch in ("sm_90a", "sm_120a"):
            cluster.finish(cluster.run("demo", arch), message=result_message(arch, f"g-{arch}"))
        wait_until(lambda: cluster.status("demo").get("phase") == "Ready", what="Ready")
        cluster.kube.patch(kernelcache_path(NS, "demo"), {"spec": {"model": "example/other"}})
        wait_until(lambda: cluster.status("demo").get("observedGeneration") == 2, what="gen 2")
        rows = table(kubectl(tmp_path, "get", "kc", "demo"))
        assert rows[1][:5] == ["demo", "example/other", "2/2", "0/2", "Pending"]
        served = kubectl(
            tmp_path, "get", "kc", "demo", "-o", "jsonpath={.status.arches[*].generation}"
        )
        assert served.split() == ["g-sm_120a", "g-sm_90a"]

        cluster.kube.patch(
            kernelcache_path(NS, "demo"),
            {"spec": {"engine": {"image": "ghcr.io/kernelcache/examples:0.2.0"}}},
        )
        wait_until(lambda: cluster.status("demo").get("observedGeneration") == 3, what="gen 3")
        rows = table(kubectl(tmp_path, "get", "kc", "demo"))
        assert rows[1][:5] == ["demo", "example/other", "0/2", "0/2", "Degraded"]
