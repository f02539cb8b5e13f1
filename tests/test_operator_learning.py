"""The operator learns from serving pods (``controller.learning``) against the emulator: a real
HTTP server on loopback stands in for a pod's IP and serves its learned record; another
accepts connections and never answers, and must not stall the resync."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

# First: it sets the operator's environment, which kernelcache.controller.main reads on import.
from tests.helpers.operator_cluster import NS, Cluster, emulated_cluster, example, operator  # isort: split

from kernelcache import learned
from kernelcache.contract import LABEL_CACHE, LEARNED, PORT_METRICS
from kernelcache.controller.kube import path
from kernelcache.controller.manifests import LEARNED_FILE, peering_crds
from kernelcache.crd import crd_manifest
from kernelcache.spec import LearnedKey
from tests.conftest import wait_until

RECORD = learned.document(
    [
        LearnedKey(toolchain="vllm", kernel="fused_moe_kernel", tokens=41, count=3),
        LearnedKey(toolchain="triton", kernel="sampler_kernel", key="ab12"),
    ],
    0,
    cache="default/demo",
    arch="sm_90a",
    generation="g90",
)
SERVED: dict[str, Any] = {}  # what the answering pod serves now


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    with emulated_cluster(tmp_path, monkeypatch, [crd_manifest(), *peering_crds()]) as cluster:
        yield cluster


@pytest.fixture
def answering() -> Iterator[int]:
    """A pod's metrics server: the record at ``learned.PATH``."""
    SERVED["record"] = RECORD

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(SERVED["record"]).encode() if self.path == learned.PATH else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent() -> Iterator[int]:
    """A pod that accepts the connection and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


def serving_pod(name: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {LABEL_CACHE: "demo"}},
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "image": "vllm",
                    "ports": [{"name": PORT_METRICS, "containerPort": port}],
                }
            ]
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_what_ready_pods_compiled_is_in_status_an_event_and_the_next_build(
    cluster: Cluster, answering: int, silent: int
) -> None:
    pods = path("v1", "pods", NS)
    cluster.kube.create(pods, serving_pod("engine-0", answering))
    cluster.kube.create(pods, serving_pod("engine-1", silent))
    with operator(cluster):
        cluster.apply(example())
        status = wait_until(lambda: cluster.status("demo").get("learned"), what="status.learned")
        assert [(k["kernel"], k.get("tokens"), k["count"]) for k in status["keys"]] == [
            ("sampler_kernel", None, 1),
            ("fused_moe_kernel", 41, 3),
        ]
        assert status["pods"] == ["engine-0"]  # engine-1 never answered: skipped, not waited on
        wait_until(lambda: "Learned" in cluster.reasons("demo"), what="a Learned event")
        [event] = [e for e in cluster.events("demo") if e["reason"] == "Learned"]
        assert event["type"] == "Normal"
        assert (
            event["message"] == "learned 2 specializations from serving: the next build warms them"
        )
        # The build this spec starts warms them: its spec ConfigMap holds them, its Jobs read it.
        job = wait_until(lambda: cluster.jobs(), what="a compile Job")[0]
        container = job["spec"]["template"]["spec"]["containers"][0]
        assert {"name": LEARNED.name, "value": f"/etc/kernelcache/spec/{LEARNED_FILE}"} in (
            container["env"]
        )
        [data] = [
            c["data"][LEARNED_FILE]
            for c in cluster.kube.list(path("v1", "configmaps", NS))
            if LEARNED_FILE in (c.get("data") or {})
        ]
        keys, _ = learned.parse(data, "the spec ConfigMap")
        assert learned.sizes(keys) == [41]
        assert cluster.reasons("demo").count("Learned") == 1  # resyncs learn nothing new
        # A key learned later is in status and said, and starts no build by itself.
        jobs = cluster.job_names()
        more = LearnedKey(toolchain="vllm", kernel="fused_moe_kernel", tokens=97)
        SERVED["record"] = {
            **SERVED["record"],
            "keys": [*SERVED["record"]["keys"], more.model_dump()],
        }
        wait_until(lambda: cluster.reasons("demo").count("Learned") == 2, what="a second event")
        assert len(cluster.status("demo")["learned"]["keys"]) == 3
        assert cluster.job_names() == jobs
