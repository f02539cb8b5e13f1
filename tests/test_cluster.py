"""From a blank cluster to a warm serving pod, through the cluster harness (``tests.cluster``).

The steps of ``docs/cluster-quickstart.md``, with the real helm and kubectl, the images
built from their Dockerfiles (``operator/``, ``initcontainer/``, ``examples/``) and every
container run from its pod spec as its own user, RBAC enforced and admission over TLS:

1. the chart is rendered and applied; the operator runs as its image's user (65532, no
   passwd entry) and serves its webhooks;
2. ``kubectl apply -f examples/kernelcache.yaml``: the compile Jobs warm for real and
   ``kubectl get kc`` shows Ready;
3. ``kubectl apply -f examples/demo-serving-pod.yaml``: the injected init-container verifies
   and materializes the node's generation (its arch from the operator's node map, with no
   API access), and the serving container loads every kernel with zero compiles through the
   start-up hook installed by the wheel;
4. an artifact is corrupted: the next pod's init-container exits non-zero with one line.

The module shares one cluster: each test is a step, in order, on what the previous left.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import cluster as harness

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(harness.missing() is not None, reason=str(harness.missing())),
]

from tests.cluster.images import Image, build_image  # noqa: E402
from tests.conftest import REPO, scaled, wait_until  # noqa: E402

NAMESPACE = "kernelcache-system"
RELEASE = "kc"
IMAGES = {  # what the quickstart builds and pushes, by the Dockerfile that builds it
    "ghcr.io/kernelcache/kernelcache-operator:0.1.0": "operator/Dockerfile",
    "ghcr.io/kernelcache/kernelcache-init:0.1.0": "initcontainer/Dockerfile",
    "ghcr.io/kernelcache/examples:0.1.0": "examples/Dockerfile",
}
NODES = [
    harness.gpu_node("gpu-h200-1", "NVIDIA-H200", 9, 0),
    harness.gpu_node("gpu-rtx-1", "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", 12, 0),
]
EXAMPLE = REPO / "examples" / "kernelcache.yaml"
SERVING_POD = REPO / "examples" / "demo-serving-pod.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def images() -> dict[str, Image]:
    """Every image of the quickstart, each built once per content (kept in .tools/images)."""
    cache = REPO / ".tools" / "images"
    return {ref: build_image(REPO / df, REPO, cache) for ref, df in IMAGES.items()}


@pytest.fixture(scope="module")
def kc(images: dict[str, Image], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with harness.cluster(tmp_path_factory.mktemp("cluster"), images, NODES) as running:
        yield running


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def operator_pod(kc: harness.Cluster) -> dict[str, Any]:
    selector = "app.kubernetes.io/name=kernelcache"
    pods = [p for p in kc.pods(NAMESPACE, selector) if p["metadata"].get("ownerReferences")]
    return pods[0] if len(pods) == 1 else {}


def webhook_serves(port: int) -> bool:
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


def test_the_chart_installs_and_the_operator_runs_as_its_image_user(kc: harness.Cluster) -> None:
    """Values: one replica (pods share the harness's network), free ports, the images built."""
    webhook = free_port()
    values = {
        "replicaCount": 1,
        "operator": {"livenessPort": free_port(), "metricsPort": free_port()},
        "webhook": {"port": webhook},
    }
    (kc.tmp / "values.yaml").write_text(yaml.safe_dump(values))
    rendered = subprocess.run(
        [
            str(harness.HELM),
            "template",
            RELEASE,
            str(REPO / "charts" / "kernelcache"),
            "--namespace",
            NAMESPACE,
            "-f",
            str(kc.tmp / "values.yaml"),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=scaled(60),
    ).stdout
    ok(kc.kubectl("apply", "--server-side", "--validate=false", "-f", "-", stdin=rendered))

    def serving() -> bool:
        pod = operator_pod(kc)
        return (pod.get("status") or {}).get("phase") == "Running" and webhook_serves(webhook)

    try:
        wait_until(serving, timeout=120, interval=0.5, what="the operator's webhook")
    except AssertionError:
        pod = operator_pod(kc)
        logs = kc.logs(pod, "operator") if pod else ""
        raise AssertionError(f"{pod.get('status')}\n{logs[-3000:]}\n{kc.errors[-1:]}") from None
    pod = operator_pod(kc)
    time.sleep(3)  # a crash at start (kopf's peering identity) comes within this
    pod = kc.pod(NAMESPACE, pod["metadata"]["name"])
    (status,) = pod["status"]["containerStatuses"]
    assert status["restartCount"] == 0 and "running" in status["state"], kc.logs(pod, "operator")
    (pid,) = kc.runner(pod).pids().values()
    uids = [line for line in Path(f"/proc/{pid}").joinpath("status").read_text().splitlines()]
    # The setup chain execs into the command: the container's process runs as the image's user.
    assert any(line.split()[:2] == ["Uid:", "65532"] for line in uids), uids
    assert "Traceback" not in kc.logs(pod, "operator")


def test_the_example_kernelcache_compiles_and_becomes_ready(kc: harness.Cluster) -> None:
    ok(kc.kubectl("apply", "--server-side", "--validate=false", "-f", str(EXAMPLE)))

    def ready() -> list[str] | None:
        rows = ok(kc.kubectl("get", "kc", "demo", "-n", "default")).splitlines()
        assert rows[0].split() == ["NAME", "MODEL", "SERVING", "READY", "PHASE", "AGE"], rows
        row = rows[1].split() if len(rows) > 1 else []
        return row if row[4:5] == ["Ready"] else None

    row = wait_until(ready, timeout=600, interval=2, what="kubectl get kc demo: Ready")
    assert row[2:4] == ["2/2", "2/2"], row  # serving, ready
    # Both compile Jobs ran their pods as the operator's compile user, and completed.
    jobs = kc.kube.list("/apis/batch/v1/namespaces/default/jobs")
    assert len(jobs) == 2
    for job in jobs:
        assert job["status"]["succeeded"] == 1, job["status"]
    assert kc.api.denied == [], kc.api.denied
    assert kc.errors == [], kc.errors[-1]


def serving_pod(kc: harness.Cluster, name: str) -> dict[str, Any]:
    """The example serving pod under ``name``; this node has no GPU, so the DSL is told the
    arch a GPU would have shown it."""
    pod = yaml.safe_load(SERVING_POD.read_text())
    pod["metadata"]["name"] = name
    pod["spec"]["containers"][0]["env"] = [{"name": "CUTE_DSL_ARCH", "value": "sm_90a"}]
    ok(kc.kubectl("apply", "--validate=false", "-f", "-", stdin=json.dumps(pod)))

    def finished() -> dict[str, Any] | None:
        got = kc.pod("default", name)
        return got if (got.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None

    return wait_until(finished, timeout=300, interval=1, what=f"pod {name} to finish")


def test_a_serving_pod_loads_every_kernel_from_the_cache_with_zero_compiles(
    kc: harness.Cluster,
) -> None:
    pod = serving_pod(kc, "demo-serve")
    (init,) = pod["status"]["initContainerStatuses"]
    init_log = kc.logs(pod, "kernelcache")
    assert init["state"]["terminated"]["exitCode"] == 0, init_log
    assert "default/demo/sm_90a: generation" in init_log and "verified" in init_log
    serve_log = kc.logs(pod, "serve")
    assert pod["status"]["phase"] == "Succeeded", serve_log
    assert " 0 compiled, 0 uncacheable" in serve_log, serve_log
    assert "loaded from cache" in serve_log
    assert pod["spec"]["automountServiceAccountToken"] is False
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["KERNELCACHE_RUNTIME"] == "1" and env["KERNELCACHE_ENV_FILE"]
    assert env["KERNELCACHE_STRICT"] == "1"  # the example's policy, on the container itself


def test_a_corrupted_artifact_stops_the_next_pod_with_one_line(kc: harness.Cluster) -> None:
    key = kc.claim_dir("default", "kernelcache-demo") / "default" / "demo" / "sm_90a"
    generation = key / (key / "CURRENT").read_text().strip()
    artifact = next(p for p in sorted((generation / "files").rglob("*")) if p.is_file())
    artifact.write_bytes(b"\0" + artifact.read_bytes()[1:])
    pod = serving_pod(kc, "demo-serve-2")
    assert pod["status"]["phase"] == "Failed"
    (init,) = pod["status"]["initContainerStatuses"]
    terminated = init["state"]["terminated"]
    assert terminated["exitCode"] == 5, kc.logs(pod, "kernelcache")
    (line,) = terminated["message"].strip().splitlines()
    assert line.startswith("kernelcache: error:") and artifact.name in line, line
    assert "waiting" in pod["status"]["containerStatuses"][0]["state"]


# --------------------------------------------------------------------------- the start-up hook


def test_the_built_wheel_installs_the_start_up_hook(images: dict[str, Image]) -> None:
    """The examples image installed kernelcache from its wheel, not editable: the hook lands in
    its site-packages and KERNELCACHE_RUNTIME=1 installs the runtime at interpreter start."""
    image = images["ghcr.io/kernelcache/examples:0.1.0"]
    hook = image.site_packages / "zz_kernelcache_runtime.pth"
    assert hook.read_text() == (REPO / "src" / "zz_kernelcache_runtime.pth").read_text()
    record = next(image.site_packages.glob("kernelcache-*.dist-info")) / "RECORD"
    assert "zz_kernelcache_runtime.pth," in record.read_text()
    assert not list(image.site_packages.glob("__editable__*kernelcache*"))
    # site runs .pth files in name order; the hook must see what the others add to sys.path.
    assert sorted(image.site_packages.glob("*.pth"))[-1] == hook
    probe = "import sys; print('kernelcache.runtime' in sys.modules)"
    python = str(image.venv / "bin" / "python")
    env = {"PATH": "/usr/bin:/bin", "KERNELCACHE_RUNTIME": "1"}
    done = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr
    env.pop("KERNELCACHE_RUNTIME")
    done = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "permissive"])
def test_the_hook_without_a_writable_tmp_refuses_in_one_line(
    kc: harness.Cluster, strict: bool
) -> None:
    """A serving image with FlashInfer (a stand-in package from a ConfigMap), a read-only root
    and no emptyDir at /tmp: strict refuses with one line, permissive warns and serves."""
    name = f"no-tmp-{'strict' if strict else 'permissive'}"
    stand_in = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "flashinfer-stand-in", "namespace": "default"},
                "data": {"init": "__version__ = '0.7.4'\n"}}  # fmt: skip
    ok(kc.kubectl("apply", "--server-side", "--validate=false", "-f", "-",
                  stdin=json.dumps(stand_in)))  # fmt: skip
    env = {"KERNELCACHE_RUNTIME": "1", "PYTHONPATH": "/opt/stand-in"}
    if strict:
        env["KERNELCACHE_STRICT"] = "1"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [{
                "name": "serve",
                "image": "ghcr.io/kernelcache/examples:0.1.0",
                "command": ["python", "-c", "print('served')"],
                "env": [{"name": k, "value": v} for k, v in env.items()],
                "securityContext": {"readOnlyRootFilesystem": True},
                "volumeMounts": [{"name": "stand-in", "mountPath": "/opt/stand-in"}],
            }],
            "volumes": [{"name": "stand-in", "configMap": {
                "name": "flashinfer-stand-in",
                "items": [{"key": "init", "path": "flashinfer/__init__.py"}]}}],
        },
    }  # fmt: skip
    ok(kc.kubectl("apply", "--validate=false", "-f", "-", stdin=json.dumps(pod)))

    def finished() -> dict[str, Any] | None:
        got = kc.pod("default", name)
        return got if (got.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None

    done = wait_until(finished, timeout=120, interval=0.5, what=f"pod {name}")
    lines = kc.logs(done, "serve").strip().splitlines()
    (state,) = done["status"]["containerStatuses"]
    if strict:
        assert state["state"]["terminated"]["exitCode"] == 10, lines
        assert lines == [
            "kernelcache: no writable temp directory for FlashInfer's build log: mount an "
            "emptyDir at /tmp or set FLASHINFER_JIT_BUILD_LOG to a writable file"
        ]
    else:
        assert state["state"]["terminated"]["exitCode"] == 0, lines
        assert lines[-1] == "served" and "Traceback" not in "\n".join(lines), lines
