"""The Helm chart installed with the real kubectl on the Kubernetes API test double.

``helm template`` of the chart with its default values, piped to ``kubectl apply
--server-side`` against the emulator (``k8s_emulator``); then ``kubectl get`` finds every
object the chart renders, and the example KernelCache applies through the CRD the chart
installed. No schema is checked here (``--validate=false``: the emulator serves no OpenAPI
document; ``test_chart`` validates the manifests) and no controller runs: this is about the
rendered manifests being applicable, kind by kind, in one pass.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KUBECTL = REPO / ".tools" / "bin" / "kubectl"
HELM = REPO / ".tools" / "bin" / "helm"
CHART = REPO / "charts" / "kernelcache"
EXAMPLE = REPO / "examples" / "kernelcache.yaml"
NAMESPACE = "kernelcache-system"
RELEASE = "kc"

pytestmark = pytest.mark.skipif(
    not (os.access(KUBECTL, os.X_OK) and os.access(HELM, os.X_OK)),
    reason="kubectl or helm is not installed: run scripts/install-kube-tools.sh",
)

from tests.conftest import scaled  # noqa: E402
from tests.helpers.operator_cluster import Cluster, emulated_cluster  # noqa: E402

APPLY = ("apply", "--server-side", "--validate=false")

# What the default values render, as `kubectl get -o name` prints it, with its namespace
# (None: cluster-scoped).
EXPECTED = [
    (f"deployment.apps/{RELEASE}-kernelcache", NAMESPACE),
    (f"serviceaccount/{RELEASE}-kernelcache", NAMESPACE),
    (f"service/{RELEASE}-kernelcache-webhook", NAMESPACE),
    (f"service/{RELEASE}-kernelcache-metrics", NAMESPACE),
    (f"secret/{RELEASE}-kernelcache-webhook-tls", NAMESPACE),
    (f"clusterrole.rbac.authorization.k8s.io/{RELEASE}-kernelcache-cluster", None),
    (f"clusterrole.rbac.authorization.k8s.io/{RELEASE}-kernelcache-namespaced", None),
    (f"clusterrolebinding.rbac.authorization.k8s.io/{RELEASE}-kernelcache-cluster", None),
    (f"clusterrolebinding.rbac.authorization.k8s.io/{RELEASE}-kernelcache-namespaced", None),
    (
        f"mutatingwebhookconfiguration.admissionregistration.k8s.io/{RELEASE}-kernelcache",
        None,
    ),
    (
        f"validatingwebhookconfiguration.admissionregistration.k8s.io/{RELEASE}-kernelcache",
        None,
    ),
    ("customresourcedefinition.apiextensions.k8s.io/kernelcaches.kernelcache.dev", None),
    ("customresourcedefinition.apiextensions.k8s.io/kopfpeerings.kopf.dev", None),
    ("customresourcedefinition.apiextensions.k8s.io/clusterkopfpeerings.kopf.dev", None),
]


def kubectl(tmp_path: Path, *args: str, stdin: str | None = None) -> str:
    """Run kubectl on ``$KUBECONFIG`` (the emulator); fail on an error or any warning."""
    proc = subprocess.run(
        [str(KUBECTL), "--cache-dir", str(tmp_path / "kube-cache"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 0 and not proc.stderr, (args, proc.stdout, proc.stderr)
    return proc.stdout


def rendered_chart() -> str:
    """``helm template`` of the chart with its default values."""
    proc = subprocess.run(
        [str(HELM), "template", RELEASE, str(CHART), "--namespace", NAMESPACE],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def bare_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """An emulator serving the built-in kinds only: every CRD comes from the chart."""
    with emulated_cluster(tmp_path, monkeypatch, []) as cluster:
        yield cluster


def test_rendered_chart_applies_server_side_then_the_example_kernelcache(
    bare_cluster: Cluster, tmp_path: Path
) -> None:
    manifests = rendered_chart()
    out = kubectl(tmp_path, *APPLY, "-f", "-", stdin=manifests)
    applied = out.strip().splitlines()
    assert all(line.endswith(" serverside-applied") for line in applied), applied
    assert sorted(line.removesuffix(" serverside-applied") for line in applied) == sorted(
        name for name, _ in EXPECTED
    )
    for name, namespace in EXPECTED:
        scope = ["-n", namespace] if namespace else []
        assert kubectl(tmp_path, "get", name, *scope, "-o", "name").strip() == name
        got = kubectl(tmp_path, "get", name, *scope, "-o", "jsonpath={.metadata.namespace}")
        assert got == (namespace or ""), (name, got)

    # Applying the same manifests again merges into the live objects: still one of each.
    again = kubectl(tmp_path, *APPLY, "-f", "-", stdin=manifests)
    assert again.strip().splitlines() == applied
    names = kubectl(tmp_path, "get", "deployments.apps", "-n", NAMESPACE, "-o", "name")
    assert names.strip().splitlines() == [f"deployment.apps/{RELEASE}-kernelcache"]
    image = kubectl(
        tmp_path,
        "get",
        "deployment",
        f"{RELEASE}-kernelcache",
        "-n",
        NAMESPACE,
        "-o",
        "jsonpath={.spec.template.spec.containers[0].image}",
    )
    assert image, "the Deployment was stored without its pod template"

    # The CRD the chart installed serves KernelCaches: the example applies and reads back.
    out = kubectl(tmp_path, *APPLY, "-f", str(EXAMPLE))
    assert out.strip() == "kernelcache.kernelcache.dev/demo serverside-applied"
    rows = [line.split() for line in kubectl(tmp_path, "get", "kc", "demo").splitlines()]
    assert rows[0] == ["NAME", "MODEL", "SERVING", "READY", "PHASE", "AGE"]
    assert rows[1][:2] == ["demo", "example/elementwise-and-tiled"]
