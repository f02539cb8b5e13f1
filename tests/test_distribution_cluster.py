"""Generations beyond one volume, through the cluster harness (``tests.cluster``), with a
real registry (Debian's docker-registry, TLS and basic auth) between two clusters:

1. cluster A builds: the example KernelCache with ``spec.distribution.oci``; its compile
   Jobs publish to A's claim and push; ``status.arches[].artifact`` names each by digest,
   which skopeo (an independent client) reads;
2. A runs node-local prefetch: a DaemonSet per GPU class pulls each arch onto its nodes
   (``status.nodes`` Ready), and a serving pod there starts warm with zero reads of the
   shared claim, counted by the kernel (inotify on every directory of it);
3. a node joins A later (an older generation's entry on its disk): its first pod waits for
   the node's copy (the node's fetch is held until the pod has looked), then reads it and
   nothing else; a node whose disk cannot hold a copy: each fetch fails with the disk's own
   error, ``status.nodes`` says so, and between retries the disk holds nothing;
4. cluster B, another API server and another kubelet (another store, no volume shared with
   A), consumes A's artifacts by digest in image-volume mode: no compile Job runs, the
   kubelet mounts each artifact read-only and noexec, and a pod starts warm from it, its
   CuTe-DSL kernels read in place there;
5. B moves to pull mode (one chart value): a pod's init-container, run from the exact spec
   the webhook wrote (the read secret and the registry's CA mounted into it alone), pulls
   its arch by digest and the pod starts warm; a blob damaged in the registry, a pull secret
   with wrong credentials or for another registry, and an unsigned artifact where signatures
   are required each stop the pod at its init-container with one line of its exit class; a
   pull secret that does not exist yet holds the pod, named, until it does.

The module shares the registry and both clusters; each test is a step on what the previous
left.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import shlex
import struct
import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelcache.contract import OCI_ANNOTATION_GENERATION, OCI_ANNOTATION_LAYER, REPORT_FILE
from kernelcache.controller.kube import kernelcache_path, path
from kernelcache.controller.manifests import REGISTRY_CA_DIR, REGISTRY_DIR
from kernelcache.errors import ExitCode
from kernelcache.spec import PUBLIC_KEY_FILE
from kernelcache.store.layout import LOCK_NAME
from tests import cluster as harness

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(harness.missing() is not None, reason=str(harness.missing())),
]

from tests.cluster.images import Image, build_image  # noqa: E402
from tests.conftest import REPO, scaled, wait_until  # noqa: E402
from tests.helpers.registry import authfile  # noqa: E402

NAMESPACE = "kernelcache-system"
IMAGES = {
    "ghcr.io/kernelcache/kernelcache-operator:0.1.0": "operator/Dockerfile",
    "ghcr.io/kernelcache/kernelcache-init:0.1.0": "initcontainer/Dockerfile",
    "ghcr.io/kernelcache/examples:0.1.0": "examples/Dockerfile",
}
H200 = ("NVIDIA-H200", 9, 0)
RTX = ("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", 12, 0)
EXAMPLE = REPO / "examples" / "kernelcache.yaml"
SERVING_POD = REPO / "examples" / "demo-serving-pod.yaml"
PREFETCH_ROOT = "/var/lib/kernelcache-prefetch"
REGISTRY_VOLUME = "kernelcache-registry"  # the read secret's volume in a pulling pod


@pytest.fixture(scope="module")
def images() -> dict[str, Image]:
    cache = REPO / ".tools" / "images"  # shared with tests/test_cluster.py: built once
    return {ref: build_image(REPO / df, REPO, cache) for ref, df in IMAGES.items()}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.helpers.registry import running_registry

    with running_registry(tmp_path_factory.mktemp("registry")) as running:
        yield running


@pytest.fixture(scope="module")
def a(
    images: dict[str, Image], registry: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[harness.Cluster]:
    nodes = [harness.gpu_node("a-h200-1", *H200), harness.gpu_node("a-rtx-1", *RTX)]
    with harness.cluster(tmp_path_factory.mktemp("a"), images, nodes, registry.cert_dir) as it:
        yield it


@pytest.fixture(scope="module")
def b(
    images: dict[str, Image], registry: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[harness.Cluster]:
    nodes = [harness.gpu_node("b-h200-1", *H200), harness.gpu_node("b-rtx-1", *RTX)]
    with harness.cluster(tmp_path_factory.mktemp("b"), images, nodes, registry.cert_dir) as it:
        yield it


def ok(done: Any) -> str:
    assert done.returncode == 0, done.stderr
    return str(done.stdout)


def apply(the: harness.Cluster, *docs: dict[str, Any]) -> None:
    for doc in docs:
        ok(the.kubectl("apply", "--server-side", "--validate=false", "-f", "-",
                       stdin=json.dumps(doc)))  # fmt: skip


def secret(
    name: str, files: dict[str, bytes], kind: str = "Opaque", namespace: str = "default"
) -> dict[str, Any]:
    data = {k: base64.b64encode(v).decode() for k, v in files.items()}
    meta = {"name": name, "namespace": namespace}
    return {"apiVersion": "v1", "kind": "Secret", "type": kind, "metadata": meta, "data": data}


def pull_secret(name: str, config: Path, namespace: str = "default") -> dict[str, Any]:
    """A Kubernetes pull secret holding the docker config ``config``."""
    files = {".dockerconfigjson": config.read_bytes()}
    return secret(name, files, "kubernetes.io/dockerconfigjson", namespace)


def registry_objects(registry: Any, namespace: str) -> list[dict[str, Any]]:
    """The registry's credentials as a pull secret, and its CA as a ConfigMap."""
    return [
        pull_secret("regcred", registry.authfile, namespace),
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": "registry-ca", "namespace": namespace},
         "data": {"ca.crt": registry.ca_file.read_text()}},
    ]  # fmt: skip


def kernelcache(the: harness.Cluster, namespace: str, name: str) -> dict[str, Any]:
    return the.kube.get(kernelcache_path(namespace, name))


def submit(the: harness.Cluster, namespace: str, cache: str, name: str, **spec: Any) -> None:
    """Create the example serving pod for ``cache``; this node has no GPU, so the DSL is told
    the arch a GPU would have shown it."""
    pod = yaml.safe_load(SERVING_POD.read_text())
    pod["metadata"].update(name=name, namespace=namespace, labels={"kernelcache.dev/cache": cache})
    pod["spec"]["containers"][0]["env"] = [{"name": "CUTE_DSL_ARCH", "value": "sm_90a"}]
    pod["spec"].update(spec)
    # Created, not applied server-side: the harness admits CREATE requests only.
    ok(the.kubectl("apply", "--validate=false", "-f", "-", stdin=json.dumps(pod)))


def finished(the: harness.Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    """The pod, once it has ended (Succeeded or Failed); else None."""
    got = the.pod(namespace, name)
    return got if (got.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None


def serve(the: harness.Cluster, namespace: str, cache: str, name: str, **spec: Any) -> dict:
    """The example serving pod for ``cache``, run to its end."""
    submit(the, namespace, cache, name, **spec)
    return wait_until(lambda: finished(the, namespace, name), timeout=600, interval=1,
                      what=f"pod {name} to finish")  # fmt: skip


def started_warm(the: harness.Cluster, pod: dict[str, Any]) -> str:
    """The init-container's log, once the pod has loaded every kernel with zero compiles."""
    init_log = the.logs(pod, "kernelcache")
    serve_log = the.logs(pod, "serve")
    inits = pod["status"].get("initContainerStatuses")
    assert pod["status"]["phase"] == "Succeeded", f"{inits}\n{init_log}{serve_log}"
    assert " 0 compiled, 0 uncacheable" in serve_log and "loaded from cache" in serve_log
    return init_log


class Reads:
    """Every open and read of a file or directory in a tree, counted by the kernel (inotify:
    events come from any process, any mount namespace, any bind mount of those inodes)."""

    IN_ACCESS, IN_OPEN = 0x1, 0x20

    def __init__(self, root: Path) -> None:
        self.libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.dirs = [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]
        for where in self.dirs:
            mask = self.IN_ACCESS | self.IN_OPEN
            assert self.libc.inotify_add_watch(self.fd, os.fsencode(where), mask) >= 0

    def count(self) -> int:
        found = 0
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return found
            at = 0
            while at < len(data):
                _, _, _, length = struct.unpack_from("iIII", data, at)
                at += 16 + length
                found += 1

    def close(self) -> None:
        os.close(self.fd)


# --------------------------------------------------------------------------- cluster A


def install_a(a: harness.Cluster, **prefetch: Any) -> None:
    """A's chart: volume mode, the registry's CA, prefetch on (``prefetch`` adds values);
    status (``status.nodes`` too) resynced every 5 s, not 30: the steps wait on it."""
    values = {"enabled": True, "root": PREFETCH_ROOT, "waitSeconds": 600, **prefetch}
    harness.install_chart(
        a,
        NAMESPACE,
        {
            "distribution": {"mode": "volume", "registryCA": "registry-ca"},
            "prefetch": values,
            "operator": {"resyncSeconds": 5},
        },
    )


def test_cluster_a_builds_and_pushes_each_arch_by_digest(a: harness.Cluster, registry: Any) -> None:
    install_a(a)
    apply(a, *registry_objects(registry, "default"))
    doc = yaml.safe_load(EXAMPLE.read_text())
    repository = registry.repo("caches/demo")
    doc["spec"]["distribution"] = {"oci": {"repository": repository, "pushSecret": "regcred"}}
    apply(a, doc)

    def pushed() -> list[dict[str, Any]] | None:
        status = kernelcache(a, "default", "demo").get("status") or {}
        arches = status.get("arches") or []
        ready = status.get("phase") == "Ready" and all(x.get("artifact") for x in arches)
        return arches if ready else None

    arches = wait_until(pushed, timeout=900, interval=2, what="demo Ready with its artifacts")
    assert [x["arch"] for x in arches] == ["sm_120a", "sm_90a"]
    for arch in arches:
        assert arch["artifact"].startswith(f"{repository}@sha256:"), arch
        inspected = registry.skopeo("inspect", "--raw", f"docker://{arch['artifact']}")
        assert inspected.returncode == 0, inspected.stderr
        manifest = json.loads(inspected.stdout)
        assert manifest["annotations"][OCI_ANNOTATION_GENERATION] == arch["generation"]
    assert a.api.denied == [] and a.errors == [], (a.api.denied, a.errors[-1:])


def node_rows(the: harness.Cluster) -> dict[tuple[str, str], dict[str, str]]:
    """``status.nodes`` of the demo KernelCache, by (node, arch)."""
    status = kernelcache(the, "default", "demo").get("status") or {}
    return {(n["node"], n["arch"]): n for n in status.get("nodes") or []}


def node_states(the: harness.Cluster) -> dict[tuple[str, str], str]:
    return {at: row["phase"] for at, row in node_rows(the).items()}


def test_a_pod_on_a_prefetched_node_reads_nothing_of_the_shared_claim(a: harness.Cluster) -> None:
    # The h200 class selects its nodes; the rtx class names no labels: every node.
    wait_until(
        lambda: node_states(a).get(("a-h200-1", "sm_90a")) == "Ready",
        timeout=600, interval=1, what="the h200 node prefetched",
    )  # fmt: skip
    disk = a.node_disk("a-h200-1") / PREFETCH_ROOT.lstrip("/")
    assert (disk / ".wanted" / "default" / "demo" / "sm_90a.json").is_file()
    claim = a.claim_dir("default", "kernelcache-demo")
    reads = Reads(claim)
    try:
        pod = serve(a, "default", "demo", "warm-from-local")
        init_log = started_warm(a, pod)
        assert "from this node's prefetched copy" in init_log, init_log
        assert reads.count() == 0
        # The count is live: one read of the claim is seen.
        next(p for p in claim.rglob("MANIFEST.json")).read_bytes()
        assert reads.count() > 0
    finally:
        reads.close()


def test_a_node_that_joins_later_is_prefetched_and_its_first_pod_waits_for_it(
    a: harness.Cluster, registry: Any
) -> None:
    """The node's DaemonSet pod is held (the registry's CA not there yet) until the serving
    pod's init-container has looked for the node's copy and found none for what it serves
    (only an older generation's entry): so the pod waits, then reads the copy and nothing
    of the claim, whatever the order in which the two pods would have run."""
    claim = a.claim_dir("default", "kernelcache-demo")
    root = a.node_disk("a-h200-2") / PREFETCH_ROOT.lstrip("/")
    entries = root / ".wanted" / "default" / "demo"
    entries.mkdir(parents=True)
    older = {"token": "0" * 32, "key": "default/demo/sm_90a", "generation": "0" * 32}
    (entries / "sm_90a.json").write_text(json.dumps(older))
    (daemonset, *_) = a.kube.list(path("apps/v1", "daemonsets", "default"))
    user = daemonset["spec"]["template"]["spec"]["securityContext"]
    for made in (root / ".wanted", root / ".wanted/default", entries, entries / "sm_90a.json"):
        os.chown(made, user["runAsUser"], user["runAsGroup"])  # as the prefetch left them
    a.kube.delete(path("v1", "configmaps", "default", "registry-ca"))
    reads, looks = Reads(claim), Reads(entries)
    try:
        a.kube.create("/api/v1/nodes", harness.gpu_node("a-h200-2", *H200))
        # OnFailure: its init-container is retried until the operator's node map names the
        # new node.
        selector = {"kubernetes.io/hostname": "a-h200-2"}
        submit(a, "default", "demo", "first-on-new-node", nodeSelector=selector,
               restartPolicy="OnFailure")  # fmt: skip
        wait_until(looks.count, timeout=300, interval=0.5, what="the pod to look for its copy")
        assert node_states(a).get(("a-h200-2", "sm_90a")) != "Ready"
        apply(a, registry_objects(registry, "default")[1])  # the CA back: the fetch runs
        pod = wait_until(lambda: finished(a, "default", "first-on-new-node"), timeout=600,
                         interval=1, what="the first pod on the new node to finish")  # fmt: skip
        init_log = started_warm(a, pod)
        assert pod["spec"]["nodeName"] == "a-h200-2"
        assert "from this node's prefetched copy (waited" in init_log, init_log
        assert "reading it from its source instead" not in init_log
        report = json.loads((a.runner(pod).dir / "volumes/kernelcache" / REPORT_FILE).read_text())
        assert report["source"] == "local" and report["waited_seconds"] > 0, report
        assert reads.count() == 0
    finally:
        reads.close()
        looks.close()
    wait_until(
        lambda: node_states(a).get(("a-h200-2", "sm_90a")) == "Ready",
        timeout=300, interval=1, what="the new node Ready in status.nodes",
    )  # fmt: skip


def test_a_node_whose_disk_cannot_hold_a_copy_says_so_per_node_and_keeps_nothing_of_it(
    a: harness.Cluster,
) -> None:
    """A real full disk: the node's prefetch root a tmpfs smaller than a generation. Each
    fetch fails with the disk's own error, ``status.nodes`` names it, and between the
    kubelet's retries the disk holds nothing: a failed fetch never leaves the disk full
    under the pods running there."""
    root = a.node_disk("a-h200-3") / PREFETCH_ROOT.lstrip("/")
    root.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "kc-full", str(root)],
                   check=True, timeout=scaled(30))  # fmt: skip
    try:
        a.kube.create("/api/v1/nodes", harness.gpu_node("a-h200-3", *H200))

        def failed() -> dict[str, str] | None:
            row = node_rows(a).get(("a-h200-3", "sm_90a")) or {}
            return row if row.get("phase") == "Failed" else None

        row = wait_until(failed, timeout=300, interval=1, what="the full node Failed")
        assert row["message"].startswith("kernelcache: error:"), row
        assert "No space left on device" in row["message"], row

        def between_tries() -> tuple[list[str], int] | None:
            """What the root holds, and its blocks in use, while no fetch runs on the node
            (seen so before and after)."""
            before = fetches(a, "a-h200-3")
            held = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
            disk = os.statvfs(root)
            idle = before is not None and before == fetches(a, "a-h200-3")
            return (held, disk.f_blocks - disk.f_bfree) if idle else None

        held = wait_until(between_tries, timeout=300, interval=0.2, what="no fetch running")
        # Nothing of the copy: the node's prefetch lock (an empty file's block at most) stays.
        paths, blocks = held
        assert [p for p in paths if p != LOCK_NAME] == [] and blocks <= 1, held
        assert node_states(a).get(("a-h200-1", "sm_90a")) == "Ready"  # other nodes: untouched
    finally:
        remove_node(a, "a-h200-3")
        subprocess.run(["umount", "--lazy", str(root)], check=True, timeout=scaled(30))


def test_the_charts_limit_bounds_each_nodes_copies_a_fetch_that_cannot_fit_says_so(
    a: harness.Cluster,
) -> None:
    """``prefetch.limitBytes`` lowered below one copy (the chart, the operator, the DaemonSet,
    ``kernelcache prefetch --limit``): the copies the nodes hold stay (each is what the
    KernelCache serves), and a node that joins then cannot keep one: its state names the
    limit."""
    install_a(a, limitBytes=1000)
    try:
        a.kube.create("/api/v1/nodes", harness.gpu_node("a-h200-4", *H200))

        def failed() -> dict[str, str] | None:
            row = node_rows(a).get(("a-h200-4", "sm_90a")) or {}
            return row if row.get("phase") == "Failed" else None

        row = wait_until(failed, timeout=300, interval=1, what="the new node Failed")
        assert "does not fit the prefetch limit of 1000 bytes" in row["message"], row
        wait_until(
            lambda: node_states(a).get(("a-h200-1", "sm_90a")) == "Ready",
            timeout=300, interval=1, what="the node holding its copy Ready again",
        )  # fmt: skip
    finally:
        remove_node(a, "a-h200-4")


def remove_node(the: harness.Cluster, node: str) -> None:
    """The node deleted, and its pods with it (a node controller would), stopped."""
    the.kube.delete(path("v1", "nodes", None, node))
    for pod in the.pods("default"):
        if pod["spec"].get("nodeName") == node:
            the.kube.delete(path("v1", "pods", "default", pod["metadata"]["name"]))
    wait_until(lambda: not any(r.pod["spec"].get("nodeName") == node and r.is_alive()
                               for r in the.kubelet.pods.values()),
               timeout=60, interval=0.2, what=f"the pods of {node} stopped")  # fmt: skip


def fetches(the: harness.Cluster, node: str) -> tuple[tuple[str, int], ...] | None:
    """The node's prefetch containers, each as (pod uid, restarts), when none is running."""
    found = []
    for pod in the.pods("default", "app.kubernetes.io/component=prefetch"):
        if pod["spec"].get("nodeName") != node:
            continue
        inits = (pod.get("status") or {}).get("initContainerStatuses") or []
        fetch = next((c for c in inits if c["name"] == "prefetch"), None)
        if fetch is None or "terminated" not in fetch["state"]:
            return None
        found.append((pod["metadata"]["uid"], fetch["restartCount"]))
    return tuple(sorted(found)) or None


# --------------------------------------------------------------------------- cluster B


def built(a: harness.Cluster) -> dict[str, str]:
    """Per arch, the artifact cluster A pushed (``repo@sha256:…``, from its status)."""
    arches = kernelcache(a, "default", "demo")["status"]["arches"]
    return {x["arch"]: x["artifact"] for x in arches}


def consumer(name: str, artifacts: dict[str, str], pull_secret: str, **spec: Any) -> dict:
    """The example KernelCache as another cluster writes it to serve ``artifacts`` by digest:
    another name (another key), no warmers, no storage; ``spec`` adds fields."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": "default"}
    for dropped in ("warmers", "storage", "retention"):
        doc["spec"].pop(dropped, None)
    doc["spec"]["source"] = {"oci": {"artifacts": artifacts, "pullSecret": pull_secret}}
    doc["spec"].update(spec)
    return doc


def ready(the: harness.Cluster, name: str) -> list[str]:
    """``kubectl get kc NAME``'s row, once it says Ready."""

    def row() -> list[str] | None:
        rows = ok(the.kubectl("get", "kc", name, "-n", "default")).splitlines()
        found = rows[1].split() if len(rows) > 1 else []
        return found if found[4:5] == ["Ready"] else None

    return wait_until(row, timeout=300, interval=1, what=f"kubectl get kc {name}: Ready")


def test_cluster_b_consumes_a_by_digest_in_image_mode_and_a_pod_starts_warm(
    a: harness.Cluster, b: harness.Cluster, registry: Any
) -> None:
    harness.install_chart(b, NAMESPACE, {"distribution": {"mode": "image"}})
    apply(b, *registry_objects(registry, "default"), consumer("served", built(a), "regcred"))
    row = ready(b, "served")
    assert row[2:4] == ["2/2", "2/2"], row
    assert b.kube.list("/apis/batch/v1/jobs") == []  # built elsewhere: no compile Job here
    pod = serve(b, "default", "served", "warm-from-image-volume")
    init_log = started_warm(b, pod)
    assert "default/demo/sm_90a: generation" in init_log  # the building cluster's key
    # Only CuTe-DSL kernels: none copied, every one loaded where the kubelet mounted it
    # (read-only and noexec), in the serving container too.
    assert " 0 copied to /kernelcache/" in init_log, init_log
    assert " read in place from its image volume" in init_log, init_log
    mount = "/var/lib/kernelcache-artifacts/sm_90a"
    assert f" from {mount}/files/cute-dsl: " in b.logs(pod, "serve")
    (serving,) = pod["spec"]["containers"]
    assert {"name": "kernelcache-artifact-sm-90a", "mountPath": mount, "readOnly": True} in (
        serving["volumeMounts"]
    )
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["kernelcache-artifact-sm-90a"]["image"]["reference"] == built(a)["sm_90a"]
    assert not [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert not (b.kubelet.root / "claims").exists()  # B has no store at all
    assert b.api.denied == [] and b.errors == [], (b.api.denied, b.errors[-1:])


# --------------------------------------------------------------------------- B in pull mode


def mount_targets(the: harness.Cluster, pod: dict[str, Any], container: str) -> set[str]:
    """Where the kubelet mounted something into ``container``: its mount table's targets."""
    table = the.runner(pod).dir / "roots" / f"{container}.mounts"
    return {shlex.split(row)[2] for row in table.read_text().splitlines()}


def test_cluster_b_moved_to_pull_mode_pulls_by_digest_and_a_pod_starts_warm(
    a: harness.Cluster, b: harness.Cluster
) -> None:
    """image → pull is one chart value (docs/distribution.md, "Moving between modes"); the
    init-container then pulls this node's arch by digest, as its uid, under a read-only
    root, with the read secret and the registry's CA mounted into it alone."""
    harness.install_chart(
        b, NAMESPACE, {"distribution": {"mode": "pull", "registryCA": "registry-ca"}}
    )
    pod = serve(b, "default", "served", "warm-by-pull")
    init_log = started_warm(b, pod)
    assert "default/demo/sm_90a: generation" in init_log, init_log
    assert "pulled by digest" in init_log, init_log
    (init,) = pod["spec"]["initContainers"]
    args = init["args"]
    pulls = [args[i + 1] for i, arg in enumerate(args) if arg == "--pull"]
    assert pulls == [f"{arch}={ref}" for arch, ref in sorted(built(a).items())]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[REGISTRY_VOLUME]["secret"]["secretName"] == "regcred"
    assert not [v for v in volumes.values() if "image" in v or "persistentVolumeClaim" in v]
    assert "imagePullSecrets" not in pod["spec"]  # the kubelet pulls nothing of it
    assert {REGISTRY_DIR, REGISTRY_CA_DIR} <= mount_targets(b, pod, "kernelcache")
    assert not {REGISTRY_DIR, REGISTRY_CA_DIR} & mount_targets(b, pod, "serve")
    cache = b.runner(pod).dir / "volumes" / "kernelcache"
    assert (cache / "kernelcache.env").is_file() and not (cache / ".pulled").exists()
    assert b.kube.list("/apis/batch/v1/jobs") == []
    assert b.api.denied == [] and b.errors == [], (b.api.denied, b.errors[-1:])


@contextmanager
def no_damage(registry: Any, ref: str) -> Iterator[list[str]]:
    yield []


@contextmanager
def flipped_blob(registry: Any, ref: str) -> Iterator[list[str]]:
    """One byte of the artifact's files layer flipped where the registry keeps the blob
    (restored afterwards: later steps pull it too); yields the layer's digest, as the line
    names it."""
    raw = registry.skopeo("inspect", "--raw", f"docker://{ref}")
    assert raw.returncode == 0, raw.stderr
    layers = json.loads(raw.stdout)["layers"]
    layer = next(x for x in layers if x["annotations"][OCI_ANNOTATION_LAYER] == "files/cute-dsl")
    blob = registry.blob_file(layer["digest"])
    original = blob.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x01
    blob.write_bytes(bytes(damaged))
    try:
        yield [layer["digest"][:19], "digest mismatch"]
    finally:
        blob.write_bytes(original)


@dataclass(frozen=True)
class Fault:
    cache: str  # the KernelCache its pod is of (``fault_caches``)
    code: ExitCode
    says: tuple[str, ...]  # what the one line names: {ref} sm_90a's artifact, {host} the registry
    damage: Callable[[Any, str], AbstractContextManager[list[str]]] = no_damage


FAULTS = {
    # The issue's: a blob damaged in the registry; a pull secret whose credentials are wrong.
    "flipped-blob": Fault("served", ExitCode.INTEGRITY, ("{ref}",), flipped_blob),
    "wrong-password": Fault(
        "served-wrong-password", ExitCode.IO, ("{host}", "refused the credentials (HTTP 401)")
    ),
    # Of the same classes: a pull secret for another registry only; an artifact without the
    # signature its KernelCache requires (A signs nothing).
    "other-registry": Fault(
        "served-other-registry",
        ExitCode.IO,
        ("asks for credentials and none were given", "no entry for {host} in /"),
    ),
    "unsigned": Fault(
        "served-signed-only", ExitCode.SIGNATURE, ("{ref}", "unsigned: no signature under tag")
    ),
}


@pytest.fixture(scope="module")
def fault_caches(
    a: harness.Cluster, b: harness.Cluster, registry: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The KernelCaches (and their Secrets) the faults' pods are of, Ready in B."""
    from kernelcache.store import generate_keypair

    tmp = tmp_path_factory.mktemp("faults")
    _, public = generate_keypair(tmp)
    signing = {"enabled": True, "secretName": "trusted-key"}
    artifacts = built(a)
    apply(
        b,
        pull_secret("regcred-wrong", authfile(tmp / "wrong.json", registry.host, password="x")),
        pull_secret("regcred-other", authfile(tmp / "other.json", "registry.example:5000")),
        secret("trusted-key", {PUBLIC_KEY_FILE: public.read_bytes()}),
        consumer("served-wrong-password", artifacts, "regcred-wrong"),
        consumer("served-other-registry", artifacts, "regcred-other"),
        consumer("served-signed-only", artifacts, "regcred",
                 verification={"policy": "strict", "signing": signing}),
    )  # fmt: skip
    for name in ("served-wrong-password", "served-other-registry", "served-signed-only"):
        ready(b, name)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_in_pull_mode_a_pod_fails_closed_at_its_init_container_in_one_line(
    a: harness.Cluster,
    b: harness.Cluster,
    registry: Any,
    fault_caches: None,
    fault: str,
) -> None:
    case = FAULTS[fault]
    ref = built(a)["sm_90a"]
    says = [s.format(ref=ref, host=registry.host) for s in case.says]
    with case.damage(registry, ref) as more:
        pod = serve(b, "default", case.cache, f"refused-{fault}")
    assert pod["status"]["phase"] == "Failed"
    (init,) = pod["status"]["initContainerStatuses"]
    terminated = init["state"]["terminated"]
    assert terminated["exitCode"] == case.code, b.logs(pod, "kernelcache")
    (line,) = terminated["message"].strip().splitlines()  # what `kubectl describe pod` shows
    assert line.startswith("kernelcache: error:"), line
    assert [s for s in [*says, *more] if s not in line] == [], line
    assert "Traceback" not in b.logs(pod, "kernelcache")
    assert "waiting" in pod["status"]["containerStatuses"][0]["state"]  # never started
    assert b.logs(pod, "serve") == ""


def test_in_pull_mode_a_pod_whose_pull_secret_is_missing_waits_naming_it_then_starts(
    a: harness.Cluster, b: harness.Cluster, registry: Any
) -> None:
    """The secret volume is not optional: the kubelet holds the pod before any container,
    saying which Secret (its FailedMount event), and starts it once the Secret exists."""
    apply(b, consumer("served-late-secret", built(a), "regcred-late"))
    ready(b, "served-late-secret")
    submit(b, "default", "served-late-secret", "waits-for-its-secret")

    def failed_mount() -> dict[str, Any] | None:
        events = b.kube.list(path("v1", "events", "default"))
        return next(
            (e for e in events
             if e["involvedObject"]["name"] == "waits-for-its-secret"
             and e["reason"] == "FailedMount"),
            None,
        )  # fmt: skip

    event = wait_until(failed_mount, timeout=120, interval=0.5, what="a FailedMount event")
    assert event["message"] == (
        f'MountVolume.SetUp failed for volume "{REGISTRY_VOLUME}" : secret "regcred-late" not found'
    )
    pod = b.pod("default", "waits-for-its-secret")
    # No phase yet is Pending too: the kubelet posts the event before the pod's status.
    phase = (pod.get("status") or {}).get("phase", "Pending")
    assert phase == "Pending" and b.logs(pod, "kernelcache") == ""
    apply(b, pull_secret("regcred-late", registry.authfile))

    pod = wait_until(lambda: finished(b, "default", "waits-for-its-secret"), timeout=600,
                     interval=1, what="the pod to finish")  # fmt: skip
    assert "pulled by digest" in started_warm(b, pod)
