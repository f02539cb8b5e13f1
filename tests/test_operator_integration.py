"""The real kopf operator against a Kubernetes API test double (see ``k8s_emulator``).

Each test serves a fresh emulator, points the kubernetes client and kopf at it through a
temporary kubeconfig, runs ``kopf run -m kernelcache.controller.main`` in a thread
(``KopfRunner``), and plays the rest of the cluster: it creates KernelCaches and writes what
the Job controller and the kubelet would (Job conditions, the pod's termination message).
Assertions are on observable state: objects, status, Events.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

# First: it sets the operator's environment, which kernelcache.controller.main reads on import.
from tests.helpers.operator_cluster import (  # isort: split
    NS,
    Cluster,
    emulated_cluster,
    example,
    operator,
    result_message,
)

from kernelcache.controller import metrics
from kernelcache.controller.kube import kernelcache_path, path
from kernelcache.controller.manifests import (
    LABEL_ARCH,
    LABEL_ATTEMPT,
    LABEL_CACHE_UID,
    peering_crds,
)
from kernelcache.crd import crd_manifest
from kernelcache.errors import ExitCode
from tests.conftest import free_port, scaled, wait_until, warm_on_a_full_volume


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    with emulated_cluster(tmp_path, monkeypatch, [crd_manifest(), *peering_crds()]) as cluster:
        yield cluster


def test_create_makes_one_job_per_arch(cluster: Cluster) -> None:
    with operator(cluster):
        cluster.apply(example())
        wait_until(lambda: len(cluster.jobs()) == 2, what="two compile Jobs")
        status = wait_until(lambda: cluster.status("demo").get("readyArches"), what="status")
        assert status == "0/2"
        st = cluster.status("demo")
        assert st["phase"] == "Pending"
        assert st["observedGeneration"] == 1
        assert {a["arch"]: a["phase"] for a in st["arches"]} == {
            "sm_90a": "Pending",
            "sm_120a": "Pending",
        }
        job = cluster.jobs(**{LABEL_ARCH: "sm_90a"})[0]
        pod = job["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == "ghcr.io/kernelcache/examples:0.1.0"
        assert pod["containers"][0]["command"][:2] == ["kernelcache", "warm"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
        assert (
            job["metadata"]["ownerReferences"][0]["uid"] == cluster.get("demo")["metadata"]["uid"]
        )
        # What the Jobs mount exists: the claim from spec.storage.pvc and the spec ConfigMap.
        assert cluster.kube.get(path("v1", "persistentvolumeclaims", NS, "kernelcache-demo"))
        configmaps = cluster.kube.list(path("v1", "configmaps", NS))
        spec_doc = yaml.safe_load(configmaps[0]["data"]["kernelcache.yaml"])
        assert spec_doc["spec"]["model"] == "example/elementwise-and-tiled"
        wait_until(lambda: cluster.reasons("demo").count("JobCreated") == 2, what="events")
        time.sleep(1.5)  # a few resyncs later: still exactly one Job per arch
        assert len(cluster.jobs()) == 2


def test_job_success_makes_the_arch_ready(cluster: Cluster) -> None:
    with operator(cluster):
        cluster.apply(example())
        for arch in ("sm_90a", "sm_120a"):
            cluster.run("demo", arch)
        wait_until(lambda: cluster.status("demo").get("phase") == "Compiling", what="Compiling")
        wait_until(lambda: "Compiling" in cluster.reasons("demo"), what="a Compiling event")

        cluster.finish(
            cluster.jobs(**{LABEL_ARCH: "sm_90a"})[0], message=result_message("sm_90a", "g90")
        )
        ready = cluster.arch_when("demo", "sm_90a", lambda a: a["phase"] == "Ready")
        assert ready["generation"] == "g90"
        assert ready["artifacts"] == 12 and ready["bytes"] == 4096 * 12
        assert ready["compileSeconds"] == 41.5
        assert ready["stampDigest"].startswith("blake3:")
        assert cluster.status("demo")["phase"] == "Compiling"
        assert cluster.status("demo")["readyArches"] == "1/2"

        cluster.finish(
            cluster.jobs(**{LABEL_ARCH: "sm_120a"})[0], message=result_message("sm_120a", "g120")
        )
        wait_until(lambda: cluster.status("demo").get("phase") == "Ready", what="Ready")
        st = cluster.status("demo")
        assert st["readyArches"] == "2/2"
        conditions = {c["type"]: c for c in st["conditions"]}
        assert conditions["Ready"]["status"] == "True"
        assert conditions["Ready"]["observedGeneration"] == 1
        assert conditions["Progressing"]["status"] == "False"
        assert conditions["Degraded"]["status"] == "False"
        wait_until(lambda: {"Published", "Ready"} <= set(cluster.reasons("demo")), what="events")
        sample = metrics.REGISTRY.get_sample_value
        labels = {"arch": "sm_90a", "result": "succeeded"}
        count = sample("kernelcache_operator_compile_job_seconds_count", labels) or 0
        seconds = sample("kernelcache_operator_compile_job_seconds_sum", labels) or 0
        assert count >= 1 and seconds / count == pytest.approx(42, abs=2)  # start to Complete
        assert (sample("kernelcache_operator_kernelcaches", {"phase": "Ready"}) or 0) >= 1
        assert (sample("kernelcache_operator_reconciles_total", {"result": "ok"}) or 0) >= 1


def test_job_failure_fails_the_arch_then_retries(cluster: Cluster) -> None:
    with operator(cluster):
        cluster.apply(example())
        first = cluster.run("demo", "sm_90a")
        cluster.finish(
            first, failed=True, message="kernelcache: error: cute-dsl: demo_kernels:warm raised"
        )
        # Waited on as an event, not as the Failed status of the backoff: an operator that
        # sees the failure only when the retry is due (a busy machine) goes straight to the
        # retry, and still posts the failure.
        (failed,) = wait_until(
            lambda: [e for e in cluster.events("demo") if e["reason"] == "CompileFailed"],
            what="a CompileFailed event",
        )
        assert failed["type"] == "Warning"
        assert "BackoffLimitExceeded" in failed["message"]
        assert "demo_kernels:warm raised" in failed["message"]

        # After the backoff (2 s here) a new Job with the next attempt number runs.
        retry = wait_until(
            lambda: cluster.jobs(**{LABEL_ARCH: "sm_90a", LABEL_ATTEMPT: "1"}), what="the retry Job"
        )[0]
        assert retry["metadata"]["name"] == first["metadata"]["name"] + "-r1"
        wait_until(lambda: cluster.arch("demo", "sm_90a").get("phase") == "Pending")

        cluster.finish(retry, failed=True, message="kernelcache: error: still broken")
        final = cluster.arch_when("demo", "sm_90a", lambda a: "gave up" in a["message"])
        assert final["phase"] == "Failed"
        assert cluster.status("demo")["phase"] == "Degraded"  # sm_120a is still pending
        degraded = {c["type"]: c for c in cluster.status("demo")["conditions"]}["Degraded"]
        assert degraded["status"] == "True" and "still broken" in degraded["message"]
        time.sleep(1.5)
        assert len(cluster.jobs(**{LABEL_ARCH: "sm_90a"})) == 2  # max attempts reached


def test_a_failure_seen_only_after_its_backoff_is_still_told(cluster: Cluster) -> None:
    """The busy machine of the flaky run, made certain: the Job failed longer ago than the
    backoff, so the operator's first look finds the retry due. The failure is not lost: a
    Warning event says it, and the retry starts."""
    with operator(cluster):
        cluster.apply(example())
        first = cluster.run("demo", "sm_90a")
        cluster.finish(first, failed=True, message="kernelcache: error: boom", ago=10)
        wait_until(
            lambda: cluster.jobs(**{LABEL_ARCH: "sm_90a", LABEL_ATTEMPT: "1"}), what="the retry"
        )
        (failed,) = wait_until(
            lambda: [e for e in cluster.events("demo") if e["reason"] == "CompileFailed"],
            what="a CompileFailed event",
        )
        assert failed["type"] == "Warning" and "kernelcache: error: boom" in failed["message"]


def test_spec_change_starts_new_jobs_and_keeps_the_published_generation(cluster: Cluster) -> None:
    with operator(cluster):
        cluster.apply(example())
        for arch in ("sm_90a", "sm_120a"):
            cluster.finish(cluster.run("demo", arch), message=result_message(arch, f"old-{arch}"))
        wait_until(lambda: cluster.status("demo").get("phase") == "Ready", what="Ready")
        old_jobs = cluster.job_names()

        kc = cluster.get("demo")
        cluster.kube.patch(
            kernelcache_path(NS, "demo"),
            {"spec": {"engine": {"image": "ghcr.io/kernelcache/examples:0.2.0"}}},
        )
        assert cluster.get("demo")["metadata"]["generation"] == kc["metadata"]["generation"] + 1
        wait_until(lambda: len(cluster.jobs()) == 4, what="a new generation of Jobs")
        assert set(old_jobs) < set(cluster.job_names())  # the old generation is left alone
        new_job = next(
            j
            for j in cluster.jobs(**{LABEL_ARCH: "sm_90a"})
            if j["metadata"]["name"] not in old_jobs
        )
        assert new_job["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.2.0")

        wait_until(lambda: cluster.status("demo").get("observedGeneration") == 2, what="gen 2")
        pending = cluster.arch("demo", "sm_90a")
        assert pending["phase"] == "Pending"
        assert pending["generation"] == "old-sm_90a"  # still what serving pods load
        assert cluster.status("demo")["readyArches"] == "0/2"

        cluster.finish(new_job, message=result_message("sm_90a", "new-sm_90a"))
        wait_until(lambda: cluster.arch("demo", "sm_90a").get("generation") == "new-sm_90a")


NODE_MAP = path("v1", "configmaps", NS, "kernelcache-nodes")
GPU_LABELS = {"nvidia.com/gpu.compute.major": "9", "nvidia.com/gpu.compute.minor": "0"}


def _node_map(cluster: Cluster) -> dict[str, str] | None:
    """The namespace's node map as serving pods would mount it; None while it is missing."""
    found = [
        c
        for c in cluster.kube.list(path("v1", "configmaps", NS))
        if c["metadata"]["name"] == "kernelcache-nodes"
    ]
    return found[0].get("data") or {} if found else None


def test_a_pruned_node_map_is_written_again_and_a_re_created_namespace_gets_one(
    cluster: Cluster,
) -> None:
    """A GitOps prune deletes the node map; a namespace is emptied and filled again with the
    same KernelCache. Either way the map is back, with the node in it, without a Node
    changing or the operator restarting (until then every new pod's init-container there
    fails: no node map)."""
    cluster.kube.create(
        path("v1", "nodes", None), {"metadata": {"name": "gpu-1", "labels": GPU_LABELS}}
    )
    with operator(cluster):
        cluster.apply(example())
        wait_until(lambda: "gpu-1" in (_node_map(cluster) or {}), what="the node map")

        cluster.kube.delete(NODE_MAP)  # pruned
        wait_until(lambda: "gpu-1" in (_node_map(cluster) or {}), what="the map written again")

        # The namespace emptied: its last KernelCache goes, then the map (a namespace
        # deletion); a node joining meanwhile writes no map where no KernelCache is.
        cluster.kube.delete(kernelcache_path(NS, "demo"))
        wait_until(lambda: not cluster.exists("demo"), what="the KernelCache to go")
        cluster.kube.delete(NODE_MAP)
        cluster.kube.create(
            path("v1", "nodes", None), {"metadata": {"name": "gpu-2", "labels": GPU_LABELS}}
        )
        time.sleep(scaled(1.5))
        assert _node_map(cluster) is None

        cluster.apply(example())  # re-applied under the same name
        wait_until(lambda: {"gpu-1", "gpu-2"} <= set(_node_map(cluster) or {}), what="a new map")


def _configmaps(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in cluster.kube.list(path("v1", "configmaps", NS))}


def test_the_operators_configmaps_pruned_under_it_are_written_again(cluster: Cluster) -> None:
    """A GitOps prune deletes what the operator made and owns no manifest for: the spec
    ConfigMap a waiting compile Job mounts (its pod could never start), and the published
    record a re-created namesake and the webhook read. Each is back at the next resync,
    as it was."""
    with operator(cluster):
        cluster.apply(example(gpuClasses=[example()["spec"]["gpuClasses"][0]]))
        job = cluster.run("demo", "sm_90a")
        volumes = job["spec"]["template"]["spec"]["volumes"]
        (spec_map,) = [v["configMap"]["name"] for v in volumes if "configMap" in v]
        before = wait_until(lambda: _configmaps(cluster).get(spec_map), what="the spec map")
        cluster.kube.delete(path("v1", "configmaps", NS, spec_map))
        again = wait_until(lambda: _configmaps(cluster).get(spec_map), what="it written again")
        assert again["data"] == before["data"]

        cluster.finish(job, message=result_message("sm_90a", "g1"))
        record = "kc-demo-published"
        before = wait_until(lambda: _configmaps(cluster).get(record), what="the record")
        assert "g1" in before["data"]["published.json"]
        cluster.kube.delete(path("v1", "configmaps", NS, record))
        again = wait_until(lambda: _configmaps(cluster).get(record), what="it written again")
        assert again["data"] == before["data"]


@pytest.mark.parametrize(
    "command",
    [
        ["sh", "-c", "dd if=/dev/zero of=$TRITON_CACHE_DIR/k.bin bs=1k count=4096"],
        [
            sys.executable,
            "-c",
            "import os; open(os.environ['TRITON_CACHE_DIR'] + '/k', 'wb').write(bytes(4 << 20))",
        ],
    ],
    ids=["dd", "python"],
)
def test_a_warmer_that_fills_the_volume_is_named_a_full_volume_in_status(
    cluster: Cluster, tmp_path: Path, command: list[str]
) -> None:
    """A full volume, not "sh exited with 1": the warm classifies it (exit 10, the I/O
    class, its line saying no space is left) and the operator shows that line in the arch's
    status and the CompileFailed event."""
    code, message, _ = warm_on_a_full_volume(tmp_path, command)
    assert code == ExitCode.IO, message
    result = json.loads(message)
    assert result["exit_code"] == ExitCode.IO and result["status"] == "failed"
    assert "No space left on device" in result["message"], result
    assert result["message"].startswith(f"command warmer: {command[0]} exited with 1 for sm_90a")
    with operator(cluster):
        cluster.apply(example(gpuClasses=[example()["spec"]["gpuClasses"][0]]))
        for attempt in (0, 1):  # both attempts: the volume stays full
            job = cluster.run("demo", "sm_90a", attempt)
            cluster.finish(job, failed=True, message=message)
        failed = cluster.arch_when("demo", "sm_90a", lambda a: a["phase"] == "Failed")
        assert "No space left on device" in failed["message"], failed
        events = [e for e in cluster.events("demo") if e["reason"] == "CompileFailed"]
        assert events and "No space left on device" in events[-1]["message"]


def test_delete_removes_jobs_and_the_finalizer(cluster: Cluster) -> None:
    with operator(cluster):
        cluster.apply(example())
        wait_until(lambda: len(cluster.jobs()) == 2, what="Jobs")
        wait_until(lambda: cluster.get("demo")["metadata"].get("finalizers"), what="a finalizer")
        cluster.kube.delete(kernelcache_path(NS, "demo"))
        wait_until(lambda: not cluster.exists("demo"), what="the KernelCache to go")
        assert cluster.jobs() == []
        # Without retention.deleteDataOnDelete the claim (and the cache on it) stays.
        assert cluster.kube.get(path("v1", "persistentvolumeclaims", NS, "kernelcache-demo"))


def test_delete_with_delete_data_runs_a_cleanup_job(cluster: Cluster) -> None:
    kc = example(storage={"existingClaim": "shared-cache"}, retention={"deleteDataOnDelete": True})
    with operator(cluster):
        cluster.apply(kc)
        wait_until(lambda: len(cluster.jobs()) == 2, what="Jobs")
        wait_until(lambda: cluster.get("demo")["metadata"].get("finalizers"), what="a finalizer")
        cluster.kube.delete(kernelcache_path(NS, "demo"))
        cleanup = wait_until(lambda: cluster.jobs(**{"app.kubernetes.io/component": "cleanup"}))[0]
        command = cleanup["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command == ["rm", "-rf", "--", "/var/lib/kernelcache/default/demo"]
        volume = cleanup["spec"]["template"]["spec"]["volumes"][0]
        assert volume["persistentVolumeClaim"]["claimName"] == "shared-cache"
        time.sleep(1)
        assert cluster.exists("demo")  # held by the finalizer until the data is gone
        cluster.finish(cleanup)
        wait_until(lambda: not cluster.exists("demo"), what="the KernelCache to go")
        assert "Deleted" in cluster.reasons("demo")


def test_restart_mid_reconcile_converges_without_duplicates(cluster: Cluster) -> None:
    with operator(cluster):
        cluster.apply(example())
        wait_until(lambda: len(cluster.jobs()) == 2, what="Jobs")
    # While no operator runs: one Job finishes, and the status is lost as if the operator
    # died between creating Jobs and recording them.
    cluster.finish(
        cluster.jobs(**{LABEL_ARCH: "sm_90a"})[0], message=result_message("sm_90a", "g90")
    )
    cluster.kube.patch(kernelcache_path(NS, "demo") + "/status", {"status": None})
    assert cluster.status("demo") == {}
    names = cluster.job_names()
    with operator(cluster, instance="replica-restarted"):
        ready = cluster.arch_when("demo", "sm_90a", lambda a: a["phase"] == "Ready")
        assert ready["generation"] == "g90"
        assert cluster.arch("demo", "sm_120a")["phase"] == "Pending"
        time.sleep(1.5)
        assert cluster.job_names() == names


def test_invalid_object_gets_a_clear_status_and_others_proceed(cluster: Cluster) -> None:
    bad = example("bad")
    bad["spec"]["gpuClasses"][1]["name"] = bad["spec"]["gpuClasses"][0]["name"]
    with operator(cluster):
        cluster.apply(bad)
        cluster.apply(example("good"))
        wait_until(lambda: cluster.status("bad").get("phase") == "Failed", what="Failed")
        ready = {c["type"]: c for c in cluster.status("bad")["conditions"]}["Ready"]
        assert ready["reason"] == "InvalidSpec"
        assert "spec.gpuClasses[1].name: duplicate of gpuClasses[0].name" in ready["message"]
        wait_until(lambda: "InvalidSpec" in cluster.reasons("bad"), what="a Warning event")
        invalid = {"result": "invalid"}
        assert (
            metrics.REGISTRY.get_sample_value("kernelcache_operator_reconciles_total", invalid) or 0
        ) >= 1
        wait_until(lambda: cluster.status("good").get("readyArches") == "0/2", what="good status")
        assert all(
            j["metadata"]["annotations"]["kernelcache.dev/cache"] == "good" for j in cluster.jobs()
        )

        # Fixed, it is reconciled like any other.
        cluster.kube.patch(
            kernelcache_path(NS, "bad"), {"spec": {"gpuClasses": example()["spec"]["gpuClasses"]}}
        )
        wait_until(lambda: cluster.status("bad").get("readyArches") == "0/2", what="fixed status")
        assert len(cluster.jobs()) == 4


def test_two_replicas_only_one_reconciles(cluster: Cluster) -> None:
    with operator(cluster, "--priority", "100", instance="replica-a"):
        with operator(cluster, "--priority", "200", instance="replica-b"):
            peering = path("kopf.dev/v1", "clusterkopfpeerings", None, "kernelcache")
            wait_until(
                lambda: len(cluster.kube.get(peering).get("status") or {}) == 2, what="peers"
            )
            time.sleep(1)  # replica-a sees replica-b and pauses
            cluster.apply(example("one"))
            wait_until(lambda: cluster.status("one").get("readyArches") == "0/2", what="status")
            time.sleep(1)
            instances = {e["reportingInstance"] for e in cluster.events("one")}
            assert instances == {"replica-b"}
            assert len(cluster.jobs()) == 2
        # replica-b is gone: replica-a takes over.
        cluster.apply(example("two"))
        wait_until(lambda: cluster.status("two").get("readyArches") == "0/2", what="status")
        wait_until(lambda: cluster.events("two"), what="events")
        assert {e["reportingInstance"] for e in cluster.events("two")} == {"replica-a"}


def test_kernelcache_operator_command_serves_liveness_and_metrics(cluster: Cluster) -> None:
    """The shipped entry point, as a process configured by environment alone."""
    liveness, metrics_port = free_port(), free_port()
    env = {
        **os.environ,
        "KERNELCACHE_OPERATOR_LIVENESS": f"http://127.0.0.1:{liveness}/healthz",
        "KERNELCACHE_OPERATOR_METRICS_PORT": str(metrics_port),
    }
    command = [sys.executable, "-m", "kernelcache", "operator"]
    child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: cluster.emulator.watches["kernelcaches"], what="the operator's watch")
        cluster.apply(example())
        wait_until(lambda: cluster.status("demo").get("readyArches") == "0/2", what="status")
        assert "reconciles" in json.loads(
            wait_until(lambda: _get(f"http://127.0.0.1:{liveness}/healthz"))
        )
        scraped = wait_until(lambda: _get(f"http://127.0.0.1:{metrics_port}/metrics"))
        assert 'kernelcache_operator_kernelcaches{phase="Pending"} 1.0' in scraped
        assert 'kernelcache_operator_reconciles_total{result="ok"}' in scraped
    finally:
        child.send_signal(signal.SIGTERM)
        _, stderr = child.communicate(timeout=scaled(30))
    assert child.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return str(response.read().decode())
    except OSError:
        return None


def _new_job(cluster: Cluster, arch: str, seen: set[str]) -> dict[str, Any]:
    """Wait for a compile Job of ``arch`` whose name is not in ``seen``; add it there."""
    fresh = wait_until(
        lambda: [
            j for j in cluster.jobs(**{LABEL_ARCH: arch}) if j["metadata"]["name"] not in seen
        ],
        what=f"a new Job for {arch}",
    )
    (job,) = fresh
    seen.add(job["metadata"]["name"])
    return job


def test_a_reverted_spec_runs_a_job_that_makes_its_generation_current_again(
    cluster: Cluster,
) -> None:
    """Spec A publishes, B publishes, back to A: A's finished Jobs (kept for their TTL) do not
    stand for the revert, because the store's CURRENT names B's generation by then."""
    image_a, image_b = "ghcr.io/kernelcache/examples:0.1.0", "ghcr.io/kernelcache/examples:0.2.0"
    seen: set[str] = set()
    with operator(cluster):
        cluster.apply(example(name="demo", gpuClasses=[example()["spec"]["gpuClasses"][0]]))
        arch = cluster.get("demo")["spec"]["gpuClasses"][0]["arch"]
        cluster.finish(_new_job(cluster, arch, seen), message=result_message(arch, "gen-a"))
        wait_until(lambda: cluster.arch("demo", arch).get("generation") == "gen-a", what="A")
        for image, published in ((image_b, "gen-b"), (image_a, None)):
            cluster.kube.patch(kernelcache_path(NS, "demo"), {"spec": {"engine": {"image": image}}})
            job = _new_job(cluster, arch, seen)
            assert job["spec"]["template"]["spec"]["containers"][0]["image"] == image
            if published:
                cluster.finish(job, message=result_message(arch, published))
                wait_until(lambda: cluster.status("demo").get("phase") == "Ready", what="B")
        # Reverted to A: until the new Job runs, B's generation is what serves, and status says so.
        wait_until(lambda: cluster.status("demo").get("observedGeneration") == 3, what="gen 3")
        time.sleep(1.5)  # a few resyncs: A's old result is not read back
        reverted = cluster.arch("demo", arch)
        assert (reverted["phase"], reverted["generation"]) == ("Pending", "gen-b"), reverted
        # Published for A is nothing status knows of until the revert's Job re-points it (a
        # pod on A may still load A's generation, which the store keeps: verify looks).
        assert cluster.status("demo")["servingArches"] == "0/1"
        degraded = next(c for c in cluster.status("demo")["conditions"] if c["type"] == "Degraded")
        assert degraded["reason"] == "ImageNotPublished" and image_a in degraded["message"]
    # An operator restart before the revert's Job ends creates it no second time.
    with operator(cluster, instance="replica-restarted"):
        time.sleep(1.5)
        assert len(cluster.jobs()) == 3
        cluster.finish(job, message=result_message(arch, "gen-a"))
        ready = cluster.arch_when("demo", arch, lambda a: a["phase"] == "Ready")
        assert ready["generation"] == "gen-a"


def test_a_re_created_kernelcache_mounts_a_spec_configmap_of_its_own(cluster: Cluster) -> None:
    """Deleted and re-created under the same name before garbage collection: the namesake's
    children (owned by the deleted object, about to be collected) are not reused."""
    with operator(cluster):
        cluster.apply(example())
        wait_until(lambda: len(cluster.jobs()) == 2, what="Jobs")
        old_uid = cluster.get("demo")["metadata"]["uid"]
        cluster.kube.delete(kernelcache_path(NS, "demo"))
        wait_until(lambda: not cluster.exists("demo"), what="the KernelCache to go")
        # No garbage collector runs here: the old ConfigMap is still there, as it is on a
        # cluster until the collector gets to it.
        assert cluster.kube.list(path("v1", "configmaps", NS))
        cluster.apply(example())
        uid = cluster.get("demo")["metadata"]["uid"]
        assert uid != old_uid
        jobs = wait_until(
            lambda: len(found := cluster.jobs(**{LABEL_CACHE_UID: uid})) == 2 and found,
            what="the new KernelCache's Jobs",
        )
        for job in jobs:
            assert job["metadata"]["ownerReferences"][0]["uid"] == uid
            volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
            mounted = cluster.kube.get(
                path("v1", "configmaps", NS, volumes["spec"]["configMap"]["name"])
            )
            assert [o["uid"] for o in mounted["metadata"]["ownerReferences"]] == [uid]


def test_a_re_created_kernelcache_shows_what_its_store_still_serves(cluster: Cluster) -> None:
    """Deleted without deleteDataOnDelete, the store keeps its generations and serving pods
    keep loading them: the namesake created next shows them before its own Jobs have run."""
    with operator(cluster):
        cluster.apply(example())
        for arch in ("sm_90a", "sm_120a"):
            cluster.finish(cluster.run("demo", arch), message=result_message(arch, f"g-{arch}"))
        wait_until(lambda: cluster.status("demo").get("phase") == "Ready", what="Ready")
        cluster.kube.delete(kernelcache_path(NS, "demo"))
        wait_until(lambda: not cluster.exists("demo"), what="the KernelCache to go")

        cluster.apply(example(retention={"deleteDataOnDelete": True}))
        status = wait_until(lambda: cluster.status("demo").get("arches"), what="a status")
        assert {a["arch"]: (a["phase"], a.get("generation")) for a in status} == {
            "sm_90a": ("Pending", "g-sm_90a"),
            "sm_120a": ("Pending", "g-sm_120a"),
        }
        assert cluster.status("demo")["servingArches"] == "2/2"
        assert cluster.status("demo")["readyArches"] == "0/2"

        # Deleted with its data, the record goes too: the next namesake shows nothing served.
        wait_until(lambda: len(cluster.jobs()) == 2, what="its Jobs")
        cluster.kube.delete(kernelcache_path(NS, "demo"))
        wait_until(lambda: not cluster.exists("demo"), what="the KernelCache to go")
        cluster.apply(example())
        status = wait_until(lambda: cluster.status("demo").get("arches"), what="a status")
        assert [a.get("generation") for a in status] == [None, None]
        assert cluster.status("demo")["servingArches"] == "0/2"


def test_a_kernelcache_deleted_during_a_resync_is_not_held_a_minute_by_the_timer() -> None:
    """kopf removes the finalizer only once the object's resync timer has exited, and looks
    again after ``background.cancellation_polling`` seconds (60 by default): a delete that
    met a running resync hung for a minute (this suite's delete tests timed out under load)."""
    import kopf

    from kernelcache.controller.main import _configure

    settings = kopf.OperatorSettings()
    assert settings.background.cancellation_polling == 60  # kopf's default, which held it
    _configure(settings)
    assert settings.background.cancellation_polling <= 1
