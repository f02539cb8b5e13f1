"""The pod injection webhook served by the real kopf operator, called by the API test double.

The operator runs as in ``test_operator_integration`` (``kopf run -m
kernelcache.controller.main`` against the emulator), with its admission webhook server on a
local port over plain HTTP (kopf's ``WebhookServer(insecure=True)``: the emulator is no API
server that insists on TLS). The emulator is told that URL's ``/inject`` (the handler's id)
as its Pod webhook, so every Pod created through the kubernetes client goes through the
operator's ``inject`` handler as it would through a MutatingWebhookConfiguration.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import ssl
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

# First: it sets the operator's environment, which kernelcache.controller.main reads on import.
from tests.helpers.operator_cluster import (
    NS,
    Cluster,
    emulated_cluster,
    example,
    kubernetes,
    operator,
    result_message,
    wait_until,
)

# isort: split
import kopf

from kernelcache.controller import main, webhook
from kernelcache.controller.kube import kernelcache_path, path
from kernelcache.controller.manifests import peering_crds
from kernelcache.crd import crd_manifest
from kernelcache.stamp_policy import ENGINE_IMAGE_FACTOR
from tests.conftest import free_port, run_kernelcache, scaled
from tests.helpers.chart import CHART, HELM
from tests.helpers.generations import ARCH, make_stamp, publish
from tests.k8s_emulator import admission_review

IMAGE = "ghcr.io/kernelcache/examples:0.1.0"

# The webhook server the next operator run serves admission on; none: the operator's own.
_SERVER: dict[str, kopf.WebhookServer] = {}


@kopf.on.startup(id="test_webhook_server")
def _serve_admission_over_http(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Registered after the operator's ``start`` (imported above), so it runs after it."""
    server = _SERVER.get("server")
    if server is not None:
        settings.admission.server = server


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
    port = free_port()
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


def _review(url: str, obj: dict[str, Any], kind: str, resource: str) -> dict[str, Any]:
    """POST one AdmissionReview as the API server would, with its default 10 s timeout."""
    group, _, version = obj["apiVersion"].rpartition("/")
    obj = {**obj, "metadata": {**obj["metadata"], "namespace": NS}}  # as the API server sets it
    review = admission_review(
        obj,
        {"group": group, "version": version, "kind": kind},
        {"group": group, "version": version, "resource": resource},
        NS,
        ("kubernetes-admin", ["system:masters"]),
    )
    request = urllib.request.Request(
        url, json.dumps(review).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=scaled(10)) as answer:
        return dict(json.load(answer)["response"])


def test_admission_answers_while_every_reconcile_worker_is_busy(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One handler thread (KERNELCACHE_OPERATOR_WORKERS=1), held by a reconcile that waits
    (as one waiting on a slow pod or API server does): a labelled pod and a KernelCache are
    still admitted, on the admission threads, while it waits."""
    busy, release = threading.Event(), threading.Event()
    reconcile = main.reconcile_kernelcache

    def held(*args: Any, **kwargs: Any) -> Any:
        busy.set()
        release.wait(scaled(60))
        return reconcile(*args, **kwargs)

    monkeypatch.setattr(main, "CONFIG", main.CONFIG.model_copy(update={"workers": 1}))
    monkeypatch.setattr(main, "reconcile_kernelcache", held)
    port = free_port()
    _SERVER["server"] = kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True)
    try:
        with operator(cluster), _released(release):
            wait_until(lambda: _listening(port), what="the operator's webhook server")
            cluster.apply(example())
            assert busy.wait(scaled(30)), "no reconcile started"
            answer = _review(
                f"http://127.0.0.1:{port}/inject", serving_pod("llama-0"), "Pod", "pods"
            )
            assert answer["allowed"] and answer.get("patch"), answer
            ops = json.loads(base64.b64decode(answer["patch"]))
            assert any(op["path"].startswith("/spec/initContainers") for op in ops)
            other = example("other")
            answer = _review(
                f"http://127.0.0.1:{port}/validate", other, "KernelCache", "kernelcaches"
            )
            assert answer["allowed"]
            assert not release.is_set()  # all of it while the one worker was held
    finally:
        _SERVER.clear()


@contextlib.contextmanager
def _released(event: threading.Event) -> Iterator[None]:
    """Set ``event`` on the way out, before the operator is asked to stop."""
    try:
        yield
    finally:
        event.set()


def _verify_as_injected(init: dict[str, Any], store: Path, tmp: Path, arch: str) -> tuple[int, str]:
    """Run the injected init-container's command as the kubelet would, its volumes at local
    paths (the claim at ``store``, a fresh emptyDir, the node's arch given for the node map):
    its exit code and termination message."""
    args = list(init["args"])
    local = {"--store": str(store), "--materialize": str(tmp / "emptydir")}
    local["--termination-log"] = str(tmp / "termination-log")
    for option, value in local.items():
        args[args.index(option) + 1] = value
    at = args.index("--node-map")
    args[at : at + 2] = ["--arch", arch, "--gpu-product", "NVIDIA H200"]
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "emptydir").mkdir(parents=True)
    proc = run_kernelcache(*init["command"][1:], *args)
    said = (tmp / "termination-log").read_text().strip() if proc.returncode else ""
    return proc.returncode, said


def test_an_engine_image_change_serves_the_old_image_and_says_which_pods_are_refused(
    cluster: Cluster, pods: Any, tmp_path: Path
) -> None:
    """spec.engine.image moves from 0.1.0 to 0.2.0 while a Deployment rolls: until 0.2.0's
    generation publishes, a new pod on 0.1.0 is admitted and its init-container loads 0.1.0's
    generation; a pod on 0.2.0 is admitted and refused by its init-container (exit 4, naming
    the image); status and a Warning event say so. Once 0.2.0's publishes, 0.2.0's pods start,
    and a 0.1.0 pod admitted just before still loads the kept 0.1.0 generation."""
    old, new = IMAGE, "ghcr.io/kernelcache/examples:0.2.0"
    store = tmp_path / "store"

    def published(image: str, files: dict[str, bytes]) -> str:
        stamp = make_stamp(**{ENGINE_IMAGE_FACTOR: image, "arch": ARCH})
        return publish(store, f"{NS}/demo/{ARCH}", files, stamp).name

    def admitted(name: str, image: str) -> dict[str, Any]:
        body = serving_pod(name)
        body["spec"]["containers"][0]["image"] = image
        created = pods.api_client.sanitize_for_serialization(pods.create_namespaced_pod(NS, body))
        (init,) = created["spec"]["initContainers"]
        return dict(init)

    def degraded() -> dict[str, Any]:
        found = cluster.status("demo").get("conditions") or []
        return next((c for c in found if c["type"] == "Degraded"), {})

    port = free_port()
    _SERVER["server"] = kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True)
    one_class = [example()["spec"]["gpuClasses"][0]]
    assert one_class[0]["arch"] == ARCH
    try:
        with operator(cluster):
            wait_until(lambda: _listening(port), what="the operator's webhook server")
            cluster.emulator.pod_webhook = f"http://127.0.0.1:{port}/inject"
            cluster.apply(example(gpuClasses=one_class))
            first = published(old, {"cute-dsl/old.o": b"\x7fELF old"})
            cluster.finish(cluster.run("demo", ARCH), message=result_message(ARCH, first))
            wait_until(lambda: cluster.status("demo").get("phase") == "Ready", what="Ready")

            cluster.kube.patch(kernelcache_path(NS, "demo"), {"spec": {"engine": {"image": new}}})
            job = wait_until(
                lambda: [
                    j
                    for j in cluster.jobs()
                    if j["spec"]["template"]["spec"]["containers"][0]["image"] == new
                ],
                what="the new image's Job",
            )[0]
            wait_until(lambda: degraded().get("status") == "True", what="Degraded")
            status = cluster.status("demo")
            assert (status["phase"], status["servingArches"]) == ("Degraded", "0/1")
            assert degraded()["reason"] == "ImageNotPublished"
            assert f"pods on {new} are refused" in degraded()["message"]
            assert f"pods on {old} load generation {first}" in degraded()["message"]
            warned = wait_until(
                lambda: [e for e in cluster.events("demo") if e["reason"] == "ImageNotPublished"],
                what="the Warning event",
            )
            assert warned[0]["type"] == "Warning" and new in warned[0]["message"]

            # The rollout: a pod on each image.
            init_old = admitted("llama-old-0", old)
            assert _verify_as_injected(init_old, store, tmp_path / "p0", ARCH) == (0, "")
            code, said = _verify_as_injected(
                admitted("llama-new-0", new), store, tmp_path / "p1", ARCH
            )
            assert code == 4 and new in said and "extra/engine_image" in said, said

            # 0.2.0's generation publishes; the pod on 0.1.0 admitted before still starts.
            second = published(new, {"cute-dsl/new.o": b"\x7fELF new"})
            cluster.finish(job, message=result_message(ARCH, second))
            wait_until(lambda: cluster.status("demo").get("phase") == "Ready", what="Ready again")
            assert cluster.status("demo")["servingArches"] == "1/1"
            code, said = _verify_as_injected(
                admitted("llama-new-1", new), store, tmp_path / "p2", ARCH
            )
            assert (code, said) == (0, "")
            assert _verify_as_injected(init_old, store, tmp_path / "p3", ARCH) == (0, "")
            report = json.loads(
                (tmp_path / "p3" / "emptydir" / "kernelcache-verify.json").read_text()
            )
            assert report["generation"] == first
            # A new pod on 0.1.0 now runs another image than the KernelCache caches for.
            with pytest.raises(kubernetes.client.ApiException) as refused:
                admitted("llama-old-1", old)
            assert refused.value.status == 403
    finally:
        _SERVER.clear()


def _webhook_tls(docs: list[dict[str, Any]]) -> tuple[str, str, str, str]:
    """(the Secret's ca.crt, tls.crt, the one caBundle of every webhook, the pods' checksum)
    of a rendered chart."""
    secret = next(d for d in docs if d["kind"] == "Secret" and d["type"] == "kubernetes.io/tls")
    configs = [d for d in docs if d["kind"].endswith("WebhookConfiguration")]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    checksum = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/webhook-tls"]
    (bundle,) = {w["clientConfig"]["caBundle"] for c in configs for w in c["webhooks"]}
    return secret["data"]["ca.crt"], secret["data"]["tls.crt"], bundle, checksum


def test_a_helm_upgrade_keeps_the_webhook_certificate_the_operator_serves(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Install, then upgrade: the upgrade renders (helm's server-side dry run reads the live
    Secret, as ``helm upgrade`` does) the certificate already installed, so the caBundle the
    API server trusts still matches what the running operator serves over TLS, and the
    operator's pods are not rolled for a new one. Without an installed Secret, each render
    makes a new certificate."""
    if not HELM.exists():
        pytest.skip("helm is not installed: run scripts/install-kube-tools.sh")
    namespace = "kernelcache-system"

    def rendered(*args: str) -> list[dict[str, Any]]:
        proc = subprocess.run(
            [str(HELM), "template", "kc", str(CHART), "--namespace", namespace, *args],
            capture_output=True,
            text=True,
            timeout=scaled(120),
        )
        assert proc.returncode == 0, proc.stderr
        return [d for d in yaml.safe_load_all(proc.stdout) if d]

    installed = rendered()
    assert _webhook_tls(installed)[1] != _webhook_tls(rendered())[1]  # no Secret: a new one
    assert _webhook_tls(installed)[0] == _webhook_tls(installed)[2]  # one CA, both places
    # What helm install leaves of the Secret (the chart's objects, owned by the release).
    secret = next(d for d in installed if d["kind"] == "Secret")
    owner = {"meta.helm.sh/release-name": "kc", "meta.helm.sh/release-namespace": namespace}
    secret["metadata"].setdefault("annotations", {}).update(owner)
    cluster.kube.create(path("v1", "secrets", namespace), secret)

    server = ("--dry-run=server", "--disable-openapi-validation")
    upgraded = rendered(*server, "--kubeconfig", str(tmp_path / "kubeconfig"))
    assert _webhook_tls(upgraded) == _webhook_tls(installed)

    # The operator serves the installed certificate (its Secret, mounted), and a client that
    # trusts the upgrade's caBundle, as the API server then does, completes the handshake.
    tls = tmp_path / "webhook-tls"
    tls.mkdir()
    for key in ("tls.crt", "tls.key"):
        (tls / key).write_bytes(base64.b64decode(secret["data"][key]))
    port = free_port()
    _SERVER["server"] = kopf.WebhookServer(
        addr="127.0.0.1", port=port, certfile=str(tls / "tls.crt"), pkeyfile=str(tls / "tls.key")
    )
    context = ssl.create_default_context(
        cadata=base64.b64decode(_webhook_tls(upgraded)[2]).decode()
    )
    service = f"kc-kernelcache-webhook.{namespace}.svc"
    try:
        with operator(cluster):
            wait_until(lambda: _listening(port), what="the operator's webhook server")
            raw = socket.create_connection(("127.0.0.1", port), timeout=scaled(10))
            with context.wrap_socket(raw, server_hostname=service) as conn:
                assert conn.version()
    finally:
        _SERVER.clear()
