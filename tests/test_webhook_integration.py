"""The pod injection webhook served by the real kopf operator, called by the API test double.

The operator runs as in ``test_operator_integration`` (``kopf run -m
kernelcache.controller.main`` against the emulator), with its admission webhook server on a
local port over plain HTTP (kopf's ``WebhookServer(insecure=True)``: the emulator is no API
server that insists on TLS). The emulator is told that URL's ``/inject`` (the handler's id)
as its Pod webhook, so every Pod created through the kubernetes client goes through the
operator's ``inject`` handler as it would through a MutatingWebhookConfiguration.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# First: it sets the operator's environment, which kernelcache.controller.main reads on import.
from tests.helpers.operator_cluster import (
    NS,
    Cluster,
    emulated_cluster,
    example,
    kubernetes,
    operator,
    wait_until,
)

# isort: split
import kopf

from kernelcache.controller import main, webhook
from kernelcache.controller.manifests import peering_crds
from kernelcache.crd import crd_manifest

IMAGE = "ghcr.io/kernelcache/examples:0.1.0"

# The webhook server the next operator run serves admission on; none: the operator's own.
_SERVER: dict[str, kopf.WebhookServer] = {}


@kopf.on.startup(id="test_webhook_server")
def _serve_admission_over_http(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Registered after the operator's ``start`` (imported above), so it runs after it."""
    server = _SERVER.get("server")
    if server is not None:
        settings.admission.server = server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    with emulated_cluster(tmp_path, monkeypatch, [crd_manifest(), *peering_crds()]) as cluster:
        yield cluster


@pytest.fixture
def pods(cluster: Cluster, tmp_path: Path) -> Any:
    """The kubernetes client's CoreV1Api on the emulator (the kubeconfig the cluster wrote)."""
    client = kubernetes.config.new_client_from_config(config_file=str(tmp_path / "kubeconfig"))
    with client:
        yield kubernetes.client.CoreV1Api(client)


def serving_pod(name: str, cache: str = "demo") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "llama", webhook.LABEL_CACHE: cache}},
        "spec": {
            "containers": [
                {
                    "name": "server",
                    "image": IMAGE,
                    "env": [{"name": "MODEL", "value": "example"}],
                    "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                },
            ],
            "volumes": [{"name": "models", "emptyDir": {}}],
        },
    }


def test_pods_created_through_the_api_are_injected_once_or_refused(
    cluster: Cluster, pods: Any
) -> None:
    port = _free_port()
    _SERVER["server"] = kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True)
    try:
        with operator(cluster):
            wait_until(lambda: _listening(port), what="the operator's webhook server")
            cluster.emulator.pod_webhook = f"http://127.0.0.1:{port}/inject"
            cluster.apply(example())
            created = pods.create_namespaced_pod(NS, serving_pod("llama-0"))
            pod = pods.api_client.sanitize_for_serialization(created)

            spec = pod["spec"]
            (init,) = spec["initContainers"]
            assert init["name"] == webhook.INIT_CONTAINER
            assert init["image"] == main.CONFIG.init_image
            assert init["command"] == ["kernelcache", "verify"]
            assert init["args"][init["args"].index("--name") + 1] == "demo"
            assert [v["name"] for v in spec["volumes"]] == [
                "models",
                webhook.STORE_VOLUME,
                webhook.CACHE_VOLUME,
                webhook.NODE_MAP_VOLUME,
            ]
            claim = spec["volumes"][1]["persistentVolumeClaim"]
            assert claim == {"claimName": "kernelcache-demo", "readOnly": True}
            (server,) = spec["containers"]
            env = {e["name"]: e.get("value") for e in server["env"]}
            assert env["MODEL"] == "example"
            assert env["KERNELCACHE_RUNTIME"] == "1"
            assert env["KERNELCACHE_ENV_FILE"].startswith(webhook.CACHE_DIR + "/")
            assert server["volumeMounts"][-1] == {
                "name": webhook.CACHE_VOLUME,
                "mountPath": webhook.CACHE_DIR,
                "readOnly": True,
            }
            # What is stored is what came back.
            stored = pods.read_namespaced_pod("llama-0", NS)
            assert pods.api_client.sanitize_for_serialization(stored)["spec"] == spec

            # A pod naming a KernelCache that does not exist is refused with the reason.
            with pytest.raises(kubernetes.client.ApiException) as refused:
                pods.create_namespaced_pod(NS, serving_pod("llama-x", cache="missing"))
            assert refused.value.status == 403
            message = json.loads(refused.value.body)["message"]
            assert "KernelCache default/missing" in message and "does not exist" in message
            names = [p.metadata.name for p in pods.list_namespaced_pod(NS).items]
            assert "llama-x" not in names

            # The already-injected pod admitted again (under another name) gains nothing.
            again = {k: pod[k] for k in ("apiVersion", "kind", "spec")}
            again["metadata"] = {"name": "llama-1", "labels": pod["metadata"]["labels"]}
            readmitted = pods.api_client.sanitize_for_serialization(
                pods.create_namespaced_pod(NS, again)
            )
            assert readmitted["spec"] == spec
    finally:
        _SERVER.clear()
