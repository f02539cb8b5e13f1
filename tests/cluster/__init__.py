"""A stand-in Kubernetes cluster: the emulated API server plus what a cluster adds to it.

No kube-apiserver, kind or container runtime can run where the tests run. This package plays
a one-machine cluster around the API server of ``tests.k8s_emulator`` (the unavoidable test
double), so that the chart, the operator image, the compile Jobs, the webhook and the
init-container meet as they do on a real cluster:

- ``api``: bearer tokens, RBAC answering 403 for what the stored (Cluster)Roles and bindings
  do not grant, the admission chain from the stored webhook configurations over TLS with
  their ``caBundle`` (``objectSelector``, ``failurePolicy``), and the API over HTTPS for
  in-cluster clients;
- ``controllers``: Deployment, ReplicaSet, Job, DaemonSet (a pod per matching node, nodes
  read on every pass so one can join later), garbage collector and a scheduler;
- ``kubelet``: image volumes (the image pulled by digest with skopeo and the pod's pull
  secrets, its layers unpacked, mounted read-only and noexec as KEP-4639 asks),
  ``hostPath`` (a disk per node), emptyDir, and Secret and ConfigMap volumes (one that does
  not exist holds the pod, with a ``FailedMount`` event naming it, until it does);
  every container from its pod spec as a host process, in a private mount
  namespace: exact command, args and env (downward API filled in), volumes at their mount
  paths in the kubelet's layout, the service-account token, runAsUser/runAsGroup/fsGroup,
  a read-only root, and the base image's own user database;
- ``images``: each image a virtual environment installed from a wheel built from exactly
  its Dockerfile's build context, with the extras its Dockerfile names.

It does NOT play: a container runtime's isolation beyond the mount and UTS namespaces (pods
share the host's network, PIDs and IPC: two pods must not listen on one port, so the tests
give the chart free ports and one operator replica); cluster DNS, NetworkPolicy and egress
rules (every pod reaches a registry on the host's loopback, by address); CPU, memory, GPU
devices (nodes have labels, no GPUs: a serving container is told its arch) and resource
limits; image layers (the host's system directories stand for the base image, read-only; a
writable root is a scratch tmpfs); probes (a pod is an endpoint once its containers run);
graceful deletion, ``ttlSecondsAfterFinished``, ``activeDeadlineSeconds``, rolling updates;
admission on anything but CREATE, ``namespaceSelector`` and ``matchPolicy``; PodSecurity,
quotas, schema validation (``kubectl --validate=false``); volume kinds other than emptyDir,
claims, ConfigMaps, Secrets, downward API, hostPath and image (a claim is a directory per
claim, provisioned on its first mount; a Secret's files lie on the kubelet's disk, not on a
tmpfs; ``imagePullSecrets`` serve image volumes only: containers' own images are never
pulled); the kubelet refreshing mounted ConfigMaps in a running pod; ``kubectl logs`` and
``exec`` (``Cluster.logs`` reads a container's log instead); events from the kubelet but a
volume's ``FailedMount``. It needs root (mount namespaces, chroot, setuid), as the tests
have on CI.
"""

from __future__ import annotations

import base64
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes import config as kube_config

from kernelcache.controller.kube import Kube, path
from tests.cluster.api import ADMIN, ClusterAPI, certificate_authority, label_selected, tls_front
from tests.cluster.controllers import Controllers
from tests.cluster.images import Image
from tests.cluster.kubelet import Kubelet, PodRunner
from tests.conftest import free_port, scaled
from tests.k8s_emulator import serving
from tests.operator_process import kubeconfig

REPO = Path(__file__).resolve().parents[2]
KUBECTL = REPO / ".tools" / "bin" / "kubectl"
HELM = REPO / ".tools" / "bin" / "helm"


def missing() -> str | None:
    """Why the harness cannot run here, or None."""
    if os.geteuid() != 0:
        return "the cluster harness needs root (mount namespaces, chroot, setuid)"
    for tool in ("unshare", "setpriv", "chroot", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not (os.access(KUBECTL, os.X_OK) and os.access(HELM, os.X_OK)):
        return "kubectl or helm is not installed: run scripts/install-kube-tools.sh"
    return None


def gpu_node(name: str, product: str, major: int, minor: int) -> dict[str, Any]:
    """A Node with GPU feature discovery's labels (and no GPU: the harness has none)."""
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.compute.major": str(major),
        "nvidia.com/gpu.compute.minor": str(minor),
    }
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


@dataclass
class Cluster:
    api: ClusterAPI
    kube: Kube  # the cluster admin's client
    kubeconfig: Path
    kubelet: Kubelet
    tmp: Path
    errors: list[str] = field(default_factory=list)  # what a controller pass or pod raised

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """The real kubectl as the cluster admin."""
        return subprocess.run(
            [
                str(KUBECTL),
                "--kubeconfig",
                str(self.kubeconfig),
                "--cache-dir",
                str(self.tmp / "kube-cache"),
                *args,
            ],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=scaled(120),
            check=False,
        )

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.kube.get(path("v1", "pods", namespace, name))

    def pods(self, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        return self.kube.list(path("v1", "pods", namespace), selector)

    def runner(self, pod: dict[str, Any]) -> PodRunner:
        return self.kubelet.pods[pod["metadata"]["uid"]]

    def logs(self, pod: dict[str, Any], container: str) -> str:
        """The container's output of its latest run."""
        logs = sorted(
            (self.kubelet.root / "pods" / pod["metadata"]["uid"] / "logs").glob(
                f"{container}-*.log"
            ),
            key=lambda p: int(p.stem.rsplit("-", 1)[1]),
        )
        return logs[-1].read_text(errors="replace") if logs else ""

    def claim_dir(self, namespace: str, claim: str) -> Path:
        return self.kubelet.claim_dir(namespace, claim)

    def node_disk(self, node: str) -> Path:
        """A node's local disk: where its hostPath volumes lie."""
        return self.kubelet.node_disk(node)


def serves_tls(port: int) -> bool:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=1) as raw,
            context.wrap_socket(raw),
        ):
            return True
    except OSError:
        return False


def install_chart(the: Cluster, namespace: str, values: dict[str, Any]) -> dict[str, Any]:
    """``helm template`` the chart with ``values`` (plus one replica and free ports, merged
    into ``operator``: pods share the host's network) and apply it; returns the operator pod
    once its webhook serves."""
    webhook = free_port()
    ports = {"livenessPort": free_port(), "metricsPort": free_port()}
    operator = {**ports, **values.get("operator", {})}
    values = {"replicaCount": 1, "webhook": {"port": webhook}, **values, "operator": operator}
    file = the.tmp / "values.yaml"
    file.write_text(yaml.safe_dump(values))
    rendered = subprocess.run(
        [str(HELM), "template", "kc", str(REPO / "charts" / "kernelcache"),
         "--namespace", namespace, "-f", str(file)],
        capture_output=True, text=True, check=True, timeout=scaled(60),
    ).stdout  # fmt: skip
    applied = the.kubectl("apply", "--server-side", "--validate=false", "-f", "-", stdin=rendered)
    if applied.returncode != 0:
        raise AssertionError(applied.stderr)
    selector = "app.kubernetes.io/name=kernelcache"

    def serving() -> dict[str, Any] | None:
        pods = [p for p in the.pods(namespace, selector) if p["metadata"].get("ownerReferences")]
        running = len(pods) == 1 and (pods[0].get("status") or {}).get("phase") == "Running"
        return pods[0] if running and serves_tls(webhook) else None

    deadline = time.monotonic() + scaled(300)
    while (pod := serving()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"the operator's webhook did not serve: {the.errors[-1:]}")
        time.sleep(0.5)
    return pod


def _endpoints(api: ClusterAPI) -> Any:
    def resolve(namespace: str, name: str, port: int) -> int:
        service = next(
            (s for s in api.live("", "services", namespace) if s["metadata"]["name"] == name), None
        )
        if service is None:
            raise LookupError(f'service "{name}" not found')
        entry = next(p for p in service["spec"]["ports"] if p["port"] == port)
        target = entry.get("targetPort", port)
        selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
        for pod in api.live("", "pods", namespace):
            if (
                not label_selected(pod, selector)
                or (pod.get("status") or {}).get("phase") != "Running"
            ):
                continue
            for container in pod["spec"]["containers"]:
                for cport in container.get("ports") or []:
                    if target in (cport.get("name"), cport["containerPort"]):
                        return int(cport["containerPort"])
        raise LookupError(f'no endpoints available for service "{name}"')

    return resolve


@contextmanager
def cluster(
    tmp: Path,
    images: dict[str, Image],
    nodes: list[dict[str, Any]],
    registry_cert_dir: Path | None = None,
) -> Iterator[Cluster]:
    """A running cluster of ``nodes`` whose kubelet knows ``images`` (by reference) and
    pulls image volumes from registries trusted through ``registry_cert_dir`` (skopeo's)."""
    reason = missing()
    if reason is not None:
        raise RuntimeError(reason)
    tmp.mkdir(parents=True, exist_ok=True)
    os.chmod(tmp, 0o755)  # pods' users traverse it to their volumes
    ca, cert, key = certificate_authority("kubernetes.default.svc")

    def factory() -> ClusterAPI:
        return ClusterAPI(keep_requests=False)

    with (
        serving(factory) as (api, url),
        tls_front(int(url.rsplit(":", 1)[1]), cert, key, tmp) as tls_port,
    ):
        api.resources.load_bundled()
        api.endpoints = _endpoints(api)
        plain = tmp / "admin-plain.kubeconfig"  # the harness's own client, without TLS
        plain.write_text(kubeconfig(url, ADMIN))
        configuration = client.Configuration()
        kube_config.load_kube_config(str(plain), client_configuration=configuration)
        kube = Kube(client.ApiClient(configuration))
        config = tmp / "admin.kubeconfig"  # kubectl's: HTTPS, sending its token
        admin = yaml.safe_load(kubeconfig(f"https://127.0.0.1:{tls_port}", ADMIN))
        admin["clusters"][0]["cluster"]["certificate-authority-data"] = base64.b64encode(
            ca
        ).decode()
        config.write_text(yaml.safe_dump(admin))
        for node in nodes:
            kube.create("/api/v1/nodes", node)
        kubelet = Kubelet(kube, tmp / "kubelet", images, api, tls_port, ca)
        kubelet.registry_cert_dir = registry_cert_dir
        controllers = Controllers(kube, nodes)
        the = Cluster(api, kube, config, kubelet, tmp, kubelet.errors)
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                try:
                    controllers.step()
                    kubelet.sync(kube.list(path("v1", "pods", None)))
                except Exception:  # kept for the test to see; the loop goes on
                    the.errors.append(traceback.format_exc())
                stop.wait(0.3)

        thread = threading.Thread(target=loop, name="cluster-controllers", daemon=True)
        thread.start()
        try:
            yield the
        finally:
            stop.set()
            thread.join(timeout=scaled(10))
            kubelet.stop()
            time.sleep(0.1)
