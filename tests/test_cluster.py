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

import base64
import json
import os
import re
import shutil
import signal
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

from kernelcache.spec import PUBLIC_KEY_FILE, SIGNING_KEY_FILE  # noqa: E402
from tests.cluster.images import Image, build_image  # noqa: E402
from tests.conftest import (  # noqa: E402
    REPO,
    SMALL_WORKLOAD,
    free_port,
    run_kernelcache,
    scaled,
    wait_until,
)

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
RESYNC = 2  # the operator's resync in seconds (operator.resyncSeconds)


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


def test_the_chart_installs_and_the_operator_runs_as_its_image_user(kc: harness.Cluster) -> None:
    """Values: one replica (pods share the harness's network), free ports, the images built."""
    webhook = free_port()
    values = {
        "replicaCount": 1,
        "operator": {
            "livenessPort": free_port(),
            "metricsPort": free_port(),
            "resyncSeconds": RESYNC,
        },
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
        return (pod.get("status") or {}).get("phase") == "Running" and harness.serves_tls(webhook)

    try:
        wait_until(serving, timeout=120, interval=0.5, what="the operator's webhook")
    except AssertionError:
        pod = operator_pod(kc)
        logs = kc.logs(pod, "operator") if pod else ""
        raise AssertionError(f"{pod.get('status')}\n{logs[-3000:]}\n{kc.errors[-1:]}") from None
    (kc.tmp / "webhook-port").write_text(str(webhook))
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


# --------------------------------------------------------------------------- the life cycle
#
# What the pods of a KernelCache see as it is created, breaks, is deleted, and as the operator
# dies: each test makes the state on the cluster and looks at what the pods got.

H200 = {"nvidia.com/gpu.product": "NVIDIA-H200"}
TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
SERVE = "import time; print('serving', flush=True); time.sleep(3600)"


def kernelcache(name: str, **spec: Any) -> dict[str, Any]:
    """The example KernelCache under ``name``: its H200 class only, the small workload."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["gpuClasses"] = doc["spec"]["gpuClasses"][:1]
    doc["spec"]["warmers"][0]["workload"] = SMALL_WORKLOAD
    doc["spec"].update(spec)
    return doc


def apply(kc: harness.Cluster, doc: dict[str, Any]) -> None:
    ok(kc.kubectl("apply", "--server-side", "--validate=false", "-f", "-", stdin=json.dumps(doc)))


def kc_status(kc: harness.Cluster, name: str) -> dict[str, Any]:
    found = kc.kubectl("get", "kc", name, "-n", "default", "-o", "json")
    return (json.loads(found.stdout).get("status") or {}) if found.returncode == 0 else {}


def wait_ready(kc: harness.Cluster, name: str) -> dict[str, Any]:
    return wait_until(
        lambda: (st := kc_status(kc, name)).get("phase") == "Ready" and st,
        timeout=scaled(300),
        interval=1,
        what=f"KernelCache {name}: Ready",
    )


def template(cache: str, command: str = SERVE) -> dict[str, Any]:
    """A serving pod's template, labelled for ``cache``, on the H200 node."""
    return {
        "metadata": {"labels": {"app": f"{cache}-serve", "kernelcache.dev/cache": cache}},
        "spec": {
            "automountServiceAccountToken": False,
            "nodeSelector": H200,
            "tolerations": TOLERATIONS,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532},
            "containers": [{
                "name": "serve",
                "image": "ghcr.io/kernelcache/examples:0.1.0",
                "command": ["python", "-c", command],
                "securityContext": {"readOnlyRootFilesystem": True},
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }  # fmt: skip


def create_pod(
    kc: harness.Cluster, name: str, cache: str, command: str = "print('served')"
) -> subprocess.CompletedProcess[str]:
    """A bare serving pod that runs to its end; what kubectl said (admission refuses here)."""
    pod = {"apiVersion": "v1", "kind": "Pod", **template(cache, command)}
    pod["metadata"]["name"] = name
    pod["spec"]["restartPolicy"] = "Never"
    return kc.kubectl("apply", "--validate=false", "-f", "-", stdin=json.dumps(pod))


def finished_pod(kc: harness.Cluster, name: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        got = kc.pod("default", name)
        return got if (got.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None

    return wait_until(done, timeout=120, interval=0.5, what=f"pod {name} to finish")


def init_said(pod: dict[str, Any]) -> str:
    """The verify init-container's last termination message ("" before it ended once)."""
    for init in (pod.get("status") or {}).get("initContainerStatuses") or []:
        state = init.get("state") or {}
        ended = state.get("terminated") or (init.get("lastState") or {}).get("terminated")
        return str((ended or {}).get("message") or "")
    return ""


def diagnosis(kc: harness.Cluster) -> str:
    """What the cluster refused and what the operator said last: for a failed wait."""
    pod = operator_pod(kc)
    logs = kc.logs(pod, "operator")[-4000:] if pod else "(no operator pod)"
    return f"refused: {kc.api.denied[-3:]}\nerrors: {kc.errors[-1:]}\noperator:\n{logs}"


def events_about(kc: harness.Cluster, name: str, reason: str) -> list[dict[str, Any]]:
    events = kc.kube.list("/api/v1/namespaces/default/events")
    return [e for e in events if e["involvedObject"].get("name") == name and e["reason"] == reason]


@pytest.mark.parametrize(
    ("name", "spec", "cause"),
    [
        (  # the case: a name typo in spec.verification.signing.secretName
            "typo",
            {"verification": {"policy": "strict",
                              "signing": {"enabled": True, "secretName": "kc-signing-typo"}}},
            'FailedMount: MountVolume.SetUp failed for volume "signing" : secret '
            '"kc-signing-typo" not found',
        ),
        (  # an engine image that does not pull
            "no-image",
            {"engine": {"image": "ghcr.io/kernelcache/not-built:0.1.0"}},
            "container warm: ErrImagePull: image ghcr.io/kernelcache/not-built:0.1.0 is not built",
        ),
        (  # a GPU class no node matches
            "no-node",
            {"gpuClasses": [{"name": "b300", "arch": "sm_100a",
                             "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B300"}}]},
            "Unschedulable: 0/2 nodes are available: 2 node(s) didn't match Pod's node "
            "affinity/selector.",
        ),
        (  # an existing claim that does not exist
            "no-claim",
            {"storage": {"existingClaim": "kernelcache-nope"}},
            'Unschedulable: 0/2 nodes are available: persistentvolumeclaim "kernelcache-nope" '
            "not found.",
        ),
    ],
    ids=["secret-typo", "image-pull", "unschedulable", "missing-claim"],
)  # fmt: skip
def test_a_compile_pod_that_cannot_start_degrades_the_kernelcache_naming_why(
    kc: harness.Cluster, name: str, spec: dict[str, Any], cause: str
) -> None:
    """Before: ``Compiling``, ``Job … is compiling`` and Degraded False, while the pod sat
    Pending; a real Job counts it active until its deadline (4,500 s here)."""
    apply(kc, kernelcache(name, **spec))

    def degraded() -> dict[str, Any] | None:
        st = kc_status(kc, name)
        found = {c["type"]: c for c in st.get("conditions") or []}.get("Degraded") or {}
        return st if found.get("reason") == "JobCannotStart" else None

    # Within a resync of the pod being refused (and its Job's start, which is an event). A
    # signing Secret that does not exist degrades it before (NoPublicKey: pods would refuse
    # what it publishes); the pod that cannot start is the more precise cause, and wins.
    st = wait_until(degraded, timeout=2 * RESYNC + 15, interval=0.5, what=f"{name}: Degraded")
    assert st["phase"] == "Degraded"
    condition = {c["type"]: c for c in st["conditions"]}["Degraded"]
    assert condition["reason"] == "JobCannotStart" and cause in condition["message"], condition
    (arch,) = st["arches"]
    assert arch["phase"] == "Pending" and " cannot start: pod kc-" in arch["message"], arch
    assert events_about(kc, name, "JobCannotStart"), kc.kube.list(
        "/api/v1/namespaces/default/events"
    )
    row = ok(kc.kubectl("get", "kc", name, "-n", "default")).splitlines()[1].split()
    assert row[4] == "Degraded", row
    if name != "typo":
        ok(kc.kubectl("delete", "kc", name, "-n", "default"))
        return
    # The Secret made under the name the spec gives: the pod starts, the build publishes.
    keys = kc.tmp / "signing-keys"
    proc = run_kernelcache("keygen", str(keys))
    assert proc.returncode == 0, proc.stderr
    data = {f: base64.b64encode((keys / f).read_bytes()).decode()
            for f in (SIGNING_KEY_FILE, PUBLIC_KEY_FILE)}  # fmt: skip
    secret = {"apiVersion": "v1", "kind": "Secret", "data": data,
              "metadata": {"name": "kc-signing-typo", "namespace": "default"}}  # fmt: skip
    apply(kc, secret)
    st = wait_ready(kc, name)
    condition = {c["type"]: c for c in st["conditions"]}["Degraded"]
    assert condition["status"] == "False", condition


def test_a_deleted_kernelcache_still_serves_its_scaled_deployment_until_its_data_goes(
    kc: harness.Cluster,
) -> None:
    """Before: once the KernelCache was deleted, the webhook refused every new pod (``does not
    exist``), so its Deployment could neither scale nor replace a crashed replica."""
    apply(kc, kernelcache("kept"))
    wait_ready(kc, "kept")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "kept-serve", "namespace": "default"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "kept-serve"}},
                 "template": template("kept")},
    }  # fmt: skip
    apply(kc, deployment)

    def running(count: int) -> list[dict[str, Any]] | None:
        pods = [p for p in kc.pods("default", "app=kept-serve")
                if (p.get("status") or {}).get("phase") == "Running"]  # fmt: skip
        return pods if len(pods) == count else None

    (first,) = wait_until(lambda: running(1), timeout=120, interval=0.5, what="one replica")
    ok(kc.kubectl("delete", "kc", "kept", "-n", "default"))
    assert kc.kubectl("get", "kc", "kept", "-n", "default").returncode != 0
    patch = json.dumps({"spec": {"replicas": 2}})
    ok(
        kc.kubectl(
            "patch", "deployment", "kept-serve", "-n", "default", "--type=merge", "-p", patch
        )
    )
    try:
        pods = wait_until(lambda: running(2), timeout=120, interval=0.5, what="the second replica")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{diagnosis(kc)}") from None
    (second,) = [p for p in pods if p["metadata"]["uid"] != first["metadata"]["uid"]]
    init_log = kc.logs(second, "kernelcache")
    assert "default/kept/sm_90a: generation" in init_log and "verified" in init_log, init_log
    (event,) = events_about(kc, "kc-kept-published", "DeletedKernelCache")
    assert event["type"] == "Warning" and "KernelCache default/kept was deleted" in event["message"]

    # The data deleted too: a replaced replica does not start, and says why in one line.
    shutil.rmtree(kc.claim_dir("default", "kernelcache-kept") / "default" / "kept")
    ok(kc.kubectl("delete", "pod", second["metadata"]["name"], "-n", "default", "--wait=false"))

    def refused() -> str | None:
        gone = (first["metadata"]["uid"], second["metadata"]["uid"])
        pods = kc.pods("default", "app=kept-serve")
        others = [p for p in pods if p["metadata"]["uid"] not in gone]
        return next((said for p in others if p.get("status") and (said := init_said(p))), None)

    line = wait_until(refused, timeout=120, interval=0.5, what="the replacement's init-container")
    assert "default/kept/sm_90a: no published generation" in line, line
    assert kc.pod("default", first["metadata"]["name"])["status"]["phase"] == "Running"
    ok(kc.kubectl("delete", "deployment", "kept-serve", "-n", "default"))


def test_tuning_built_off_the_gpu_serves_a_strict_pod_of_the_declared_product(
    kc: harness.Cluster,
) -> None:
    """A ``compileOn: cpu`` build that writes tuning (here: a Triton autotune choice, as an
    engine's own warm-up leaves it). Before: the stamp had no GPU product, and every strict
    pod refused it (``gpu_product: (no such factor) != NVIDIA-H200``)."""
    script = (
        "import os, pathlib; root = pathlib.Path(os.environ['TRITON_CACHE_DIR'], 'k1')\n"
        "root.mkdir(parents=True); (root / 'matmul.cubin').write_bytes(b'cubin')\n"
        "(root / 'matmul.autotune.json').write_text('{\"BLOCK_M\": 64}')"
    )
    doc = kernelcache("tuned", warmers=[{"type": "command", "command": ["python", "-c", script]}])
    doc["spec"]["gpuClasses"][0]["compileOn"] = "cpu"  # gpuProduct: NVIDIA H200, as declared
    apply(kc, doc)
    wait_ready(kc, "tuned")
    ok(create_pod(kc, "tuned-serve", "tuned"))
    pod = finished_pod(kc, "tuned-serve")
    assert pod["status"]["phase"] == "Succeeded", init_said(pod) or kc.logs(pod, "kernelcache")
    assert "verified" in kc.logs(pod, "kernelcache")
    assert kc.logs(pod, "serve").strip() == "served"


def test_an_operator_killed_and_replaced_reconciles_again_within_its_peering_lifetime(
    kc: harness.Cluster,
) -> None:
    """SIGKILL: no clean exit withdraws the replica's peering record. Before: the restarted
    container was a new peer (a random identity) and waited for that record to expire (60 s)
    unless it drew the higher priority: about 51 s with nobody reconciling."""
    peering = "/apis/kopf.dev/v1/clusterkopfpeerings/kernelcache"
    records = kc.kube.get(peering).get("status") or {}
    pod = operator_pod(kc)
    # Its record is under its pod's name: the container restarted in the pod is the same
    # peer, so it does not wait for its predecessor's record to expire.
    assert set(records) == {pod["metadata"]["name"]}, records
    assert all(r["lifetime"] == 10 for r in records.values()), records
    (pid,) = kc.runner(pod).pids().values()
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    apply(kc, kernelcache("after-kill"))
    wait_until(lambda: kc_status(kc, "after-kill").get("phase"), timeout=10 + 30, interval=0.2,
               what="a reconcile by the replacement")  # fmt: skip
    seconds = time.monotonic() - killed
    print(f"operator killed: reconciling again after {seconds:.1f} s")
    restarted = kc.pod(NAMESPACE, pod["metadata"]["name"])["status"]["containerStatuses"][0]
    assert restarted["restartCount"] == 1, restarted
    ok(kc.kubectl("delete", "kc", "after-kill", "-n", "default"))


# --------------------------------------------------------------------------- the docs' table

NO_NODE = [{"name": "b300", "arch": "sm_100a",
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B300"}}]  # fmt: skip


def table_rows() -> dict[str, list[str]]:
    """docs/operations.md's table of states: each state's lines quoted as a new pod sees them."""
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("## What a serving pod sees in each state", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("**"):
            rows[cells[0].strip("*")] = re.findall(r"`([^`]+)`", cells[2])
    return rows


def seen_absent(kc: harness.Cluster) -> tuple[str, str]:
    return "never", create_pod(kc, "walk-absent", "never").stderr


def seen_deleted(kc: harness.Cluster) -> tuple[str, str]:
    apply(kc, kernelcache("walk-deleted"))
    wait_ready(kc, "walk-deleted")
    ok(kc.kubectl("delete", "kc", "walk-deleted", "-n", "default"))
    ok(create_pod(kc, "walk-deleted-1", "walk-deleted"))
    served = finished_pod(kc, "walk-deleted-1")
    assert served["status"]["phase"] == "Succeeded", init_said(served)
    events = events_about(kc, "kc-walk-deleted-published", "DeletedKernelCache")
    seen = [f"{e['reason']}: {e['message']}" for e in events]
    shutil.rmtree(kc.claim_dir("default", "kernelcache-walk-deleted") / "default" / "walk-deleted")
    ok(create_pod(kc, "walk-deleted-2", "walk-deleted"))
    refused = finished_pod(kc, "walk-deleted-2")
    assert refused["status"]["phase"] == "Failed"
    return "walk-deleted", "\n".join([*seen, init_said(refused)])


def seen_deleting(kc: harness.Cluster) -> tuple[str, str]:
    # Data kept, held in deletion by a finalizer of someone else's.
    held = kernelcache("walk-held", gpuClasses=NO_NODE)
    held["metadata"]["finalizers"] = ["example.com/hold"]
    apply(kc, held)
    wait_until(lambda: kc_status(kc, "walk-held").get("phase"), what="walk-held reconciled")
    ok(kc.kubectl("delete", "kc", "walk-held", "-n", "default", "--wait=false"))
    wait_until(
        lambda: kc.kube.get("/apis/kernelcache.dev/v1alpha1/namespaces/default/kernelcaches/"
                            "walk-held")["metadata"].get("finalizers") == ["example.com/hold"],
        what="the operator's finalizer done",
    )  # fmt: skip
    ok(create_pod(kc, "walk-held-1", "walk-held"))
    said = [e["message"] for e in events_about(kc, "walk-held", "DeletedKernelCache")]
    # Data deleted with it, from a claim of the user's: its cleanup Job's image is not there,
    # so the finalizer waits.
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "walk-going-data", "namespace": "default"},
             "spec": {"accessModes": ["ReadWriteMany"],
                      "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
    apply(kc, claim)
    going = kernelcache(
        "walk-going",
        gpuClasses=NO_NODE,
        storage={"existingClaim": claim["metadata"]["name"]},
        retention={"generations": 2, "deleteDataOnDelete": True},
    )
    apply(kc, going)
    wait_until(lambda: kc_status(kc, "walk-going").get("phase"), what="walk-going reconciled")
    ok(kc.kubectl("delete", "kc", "walk-going", "-n", "default", "--wait=false"))
    refused = create_pod(kc, "walk-going-1", "walk-going")
    assert refused.returncode != 0
    return "walk-going", "\n".join([*said, refused.stderr])


def seen_compiling(kc: harness.Cluster) -> tuple[str, str]:
    slow = [{"type": "command", "command": ["python", "-c", "import time; time.sleep(600)"]}]
    apply(kc, kernelcache("walk-compiling", warmers=slow))
    wait_until(lambda: kc_status(kc, "walk-compiling").get("phase") == "Compiling",
               timeout=60, interval=0.5, what="walk-compiling: Compiling")  # fmt: skip
    ok(create_pod(kc, "walk-compiling-1", "walk-compiling"))
    said = init_said(finished_pod(kc, "walk-compiling-1"))
    ok(kc.kubectl("delete", "kc", "walk-compiling", "-n", "default"))
    return "walk-compiling", said


def seen_degraded(kc: harness.Cluster) -> tuple[str, str]:
    apply(kc, kernelcache("walk-degraded", gpuClasses=NO_NODE))
    wait_until(lambda: kc_status(kc, "walk-degraded").get("phase") == "Degraded",
               timeout=2 * RESYNC + 15, interval=0.5, what="walk-degraded: Degraded")  # fmt: skip
    ok(create_pod(kc, "walk-degraded-1", "walk-degraded"))
    said = init_said(finished_pod(kc, "walk-degraded-1"))
    ok(kc.kubectl("delete", "kc", "walk-degraded", "-n", "default"))
    return "walk-degraded", said


def seen_operator_down(kc: harness.Cluster) -> tuple[str, str]:
    (deployment,) = ok(kc.kubectl("get", "deployment", "-n", NAMESPACE, "-o", "name")).split()

    def scale(replicas: int) -> None:
        patch = json.dumps({"spec": {"replicas": replicas}})
        ok(kc.kubectl("patch", deployment, "-n", NAMESPACE, "--type=merge", "-p", patch))

    scale(0)
    wait_until(lambda: not operator_pod(kc), timeout=60, interval=0.5, what="no operator")
    refused = create_pod(kc, "walk-down-1", "tuned")
    scale(1)
    port = int((kc.tmp / "webhook-port").read_text())
    wait_until(lambda: harness.serves_tls(port), timeout=120, interval=0.5, what="the webhook back")
    assert refused.returncode != 0
    return "tuned", refused.stderr


STATES = {
    "absent": seen_absent,
    "deleted": seen_deleted,
    "deleting": seen_deleting,
    "compiling": seen_compiling,
    "degraded": seen_degraded,
    "operator down": seen_operator_down,
}


def test_what_a_serving_pod_sees_in_each_state_is_what_the_operations_guide_says(
    kc: harness.Cluster,
) -> None:
    """Every row of the table in docs/operations.md, made on the cluster: each line the row
    quotes is in what a new pod got (the admission answer, Warning events, the
    init-container's message)."""
    rows = table_rows()
    assert set(rows) == set(STATES), rows
    for state, quoted in rows.items():
        assert quoted, f"row {state!r} quotes nothing"
        name, seen = STATES[state](kc)
        for line in quoted:
            line = line.replace("<namespace>/<name>", f"default/{name}")
            line = line.replace("kc-<name>-published", f"kc-{name}-published")
            assert line in seen, f"{state}: {line!r} not in what the pod saw:\n{seen}"
