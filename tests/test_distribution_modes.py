"""Serving a generation beyond one volume: the API, the pod the webhook writes per mode, the
init-container's sources (the node's prefetched copy, a pull by digest) and the prefetch's
bounded local disk. The cluster-wide path (two clusters, a DaemonSet, image volumes) is in
tests/test_distribution_cluster.py."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelcache import prefetch
from kernelcache.contract import LABEL_ARCH, LABEL_DIGEST, LOCAL_DAMAGED, REPORT_FILE
from kernelcache.controller import modes, state
from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.manifests import compile_job, spec_digest
from kernelcache.controller.webhook import Denied, apply_ops, mutate_pod
from kernelcache.errors import ExitCode, SpecError, StorageError
from kernelcache.spec import parse_kernelcache
from kernelcache.store import Store
from kernelcache.store.prefetched import find, read_wanted, reading
from tests.conftest import kernelcache_doc, one_line_error, scaled, subprocess_env
from tests.helpers.generations import (
    ARCH,
    COMPILED,
    IMAGE,
    KEY,
    NAME,
    NS,
    PRODUCT,
    TUNING,
    publish,
)

DIGEST = "sha256:" + "5e" * 32
REF = f"registry.example.com/caches/demo@{DIGEST}"
CONFIG = OperatorConfig()


def consumer(**spec: Any) -> dict[str, Any]:
    """A KernelCache that serves generations built elsewhere, by digest."""
    doc = kernelcache_doc("served", "team", arches=("sm_90a",))
    doc["spec"].pop("warmers")
    doc["spec"]["source"] = {"oci": {"artifacts": {"sm_90a": REF}, "pullSecret": "regcred"}}
    doc["spec"].update(spec)
    doc["metadata"]["uid"] = "uid-1"
    return doc


def builder() -> dict[str, Any]:
    doc = kernelcache_doc("demo", "team", arches=("sm_90a", "sm_120a"))
    doc["spec"]["distribution"] = {
        "oci": {"repository": "registry.example.com/caches/demo", "pushSecret": "pusher"}
    }
    doc["metadata"]["uid"] = "uid-2"
    doc["status"] = {
        "arches": [
            {"arch": "sm_90a", "phase": "Ready", "generation": "g" * 32, "artifact": REF},
            {"arch": "sm_120a", "phase": "Ready", "generation": "h" * 32},
        ]
    }
    return doc


# --------------------------------------------------------------------------- the API


def test_a_consumed_kernelcache_needs_no_warmers_and_an_artifact_per_arch() -> None:
    kc = parse_kernelcache(consumer(), "kc")
    assert kc.spec.source is not None and kc.spec.warmers == []
    bad = {
        "a warmer with a source": (
            lambda d: d["spec"].update(warmers=kernelcache_doc("x")["spec"]["warmers"]),
            "kc: spec.warmers: not allowed with source: its generations are built elsewhere",
        ),
        "an arch without an artifact": (
            lambda d: d["spec"]["gpuClasses"].append({"name": "rtx", "arch": "sm_120a"}),
            "kc: spec.source.oci.artifacts.sm_120a: required: a GPU class is sm_120a",
        ),
        "an artifact of no class": (
            lambda d: d["spec"]["source"]["oci"]["artifacts"].update(sm_100a=REF),
            "kc: spec.source.oci.artifacts.sm_100a: no GPU class of this arch",
        ),
        "a tag, not a digest": (
            lambda d: d["spec"]["source"]["oci"]["artifacts"].update(
                sm_90a="registry.example.com/caches/demo:latest"
            ),
            "kc: spec.source.oci.artifacts.sm_90a: expected an artifact pinned by digest",
        ),
        "no warmers and no source": (
            lambda d: d["spec"].pop("source"),
            "kc: spec.warmers: needs at least 1 item(s), got 0",
        ),
    }
    for case, (change, expected) in bad.items():
        doc = consumer()
        change(doc)
        with pytest.raises(SpecError) as info:
            parse_kernelcache(doc, "kc")
        assert info.value.message.startswith(expected), (case, info.value.message)


def test_a_repository_with_a_tag_is_refused_naming_the_field() -> None:
    doc = builder()
    doc["spec"]["distribution"]["oci"]["repository"] = "registry.example.com/caches/demo:v1"
    with pytest.raises(SpecError, match=r"spec\.distribution\.oci\.repository: expected a repo"):
        parse_kernelcache(doc, "kc")


def test_the_spec_digest_of_a_spec_without_distribution_is_unchanged() -> None:
    """A spec written before distribution existed keeps its Job names across an upgrade:
    the digest is the one of its spec without the new sections."""
    doc = kernelcache_doc("demo", "team")
    doc["metadata"].update(uid="u", generation=1)
    kc = parse_kernelcache(doc, "kc")
    import hashlib

    spec = kc.spec.model_dump(mode="json", by_alias=True)
    old = {k: v for k, v in spec.items() if k not in ("distribution", "source")}
    identity = {"namespace": "team", "name": "demo", "uid": "u", "generation": 1, "spec": old}
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    assert spec_digest(kc) == hashlib.sha256(canonical.encode()).hexdigest()[:16]


def test_the_compile_job_pushes_with_the_push_secret_mounted_alone() -> None:
    kc = parse_kernelcache(builder(), "kc")
    config = OperatorConfig(registry_ca="registry-ca")
    owner = {"uid": "uid-2"}
    job = compile_job(kc, arch="sm_90a", digest="d" * 16, attempt=0, owner=owner, config=config)
    pod = job["spec"]["template"]["spec"]
    (warm,) = pod["containers"]
    command = warm["command"]
    at = command.index("--push")
    assert command[at : at + 6] == [
        "--push", "registry.example.com/caches/demo",
        "--authfile", "/etc/kernelcache/registry/.dockerconfigjson",
        "--ca-file", "/etc/kernelcache/registry-ca/ca.crt",
    ]  # fmt: skip
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kernelcache-registry"]["secret"] == {
        "secretName": "pusher",
        "items": [{"key": ".dockerconfigjson", "path": ".dockerconfigjson"}],
    }
    mounts = {m["name"]: m for m in warm["volumeMounts"]}
    assert mounts["kernelcache-registry"]["readOnly"] is True
    plain = parse_kernelcache(kernelcache_doc("demo", "team"), "kc")
    job = compile_job(plain, arch="sm_90a", digest="d" * 16, attempt=0, owner=owner, config=config)
    assert "--push" not in job["spec"]["template"]["spec"]["containers"][0]["command"]


def test_a_consumed_arch_is_ready_and_serving_without_a_job() -> None:
    plans = [state.consumed_arch("sm_90a", REF)]
    status = state.summarize(plans, 1, {}, state.parse_time("2026-12-01T00:00:00+00:00"))
    assert status["phase"] == "Ready" and status["servingArches"] == "1/1"
    (arch,) = status["arches"]
    assert arch["artifact"] == REF and "no compile Job" in arch["message"]
    assert plans[0].create_attempt is None


def test_the_warm_result_artifact_lands_in_status() -> None:
    fields = state.from_result({"status": "published", "generation": "g" * 32, "artifact": REF})
    assert state.arch_status(arch="sm_90a", phase="Ready", **fields)["artifact"] == REF


# --------------------------------------------------------------------------- the pod, per mode


def pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "serve",
            "namespace": "team",
            "labels": {"kernelcache.dev/cache": "x"},
        },
        "spec": {"containers": [{"name": "serve", "image": "ghcr.io/kernelcache/examples:0.1.0"}]},
    }


def injected(kc_doc: dict[str, Any], config: OperatorConfig) -> dict[str, Any]:
    the_pod = pod()
    the_pod["metadata"]["labels"]["kernelcache.dev/cache"] = kc_doc["metadata"]["name"]
    kc_doc["spec"]["engine"] = {"image": "ghcr.io/kernelcache/examples:0.1.0"}
    return apply_ops(the_pod, mutate_pod(the_pod, kc_doc, config))["spec"]


def init_of(spec: dict[str, Any]) -> dict[str, Any]:
    (init,) = spec["initContainers"]
    return init


def arg_values(init: dict[str, Any], flag: str) -> list[str]:
    args = init["args"]
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_image_mode_mounts_each_artifact_read_only_and_no_claim() -> None:
    spec = injected(builder(), OperatorConfig(distribution_mode="image"))
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kernelcache-artifact-sm-90a"] == {
        "name": "kernelcache-artifact-sm-90a",
        "image": {"reference": REF, "pullPolicy": "IfNotPresent"},
    }
    assert "kernelcache-artifact-sm-120a" not in volumes  # not pushed yet: nothing to mount
    assert not [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    init = init_of(spec)
    assert arg_values(init, "--artifact") == ["sm_90a=/var/lib/kernelcache-artifacts/sm_90a"]
    assert "--store" not in init["args"]
    mount = next(m for m in init["volumeMounts"] if m["name"] == "kernelcache-artifact-sm-90a")
    assert mount["readOnly"] is True
    assert spec["imagePullSecrets"] == [{"name": "pusher"}]  # no pullSecret: the push one


def test_pull_mode_pulls_by_digest_with_the_read_secret_only() -> None:
    doc = builder()
    doc["spec"]["distribution"]["oci"]["pullSecret"] = "reader"
    spec = injected(doc, OperatorConfig(distribution_mode="pull"))
    init = init_of(spec)
    assert arg_values(init, "--pull") == [f"sm_90a={REF}"]
    assert arg_values(init, "--authfile") == ["/etc/kernelcache/registry/.dockerconfigjson"]
    (secret,) = [v for v in spec["volumes"] if "secret" in v]
    assert secret["secret"]["secretName"] == "reader"
    assert "imagePullSecrets" not in spec


def test_a_consumed_kernelcache_in_volume_mode_is_pulled_it_has_no_claim() -> None:
    spec = injected(consumer(), CONFIG)
    init = init_of(spec)
    assert arg_values(init, "--pull") == [f"sm_90a={REF}"] and "--store" not in init["args"]
    assert not [v for v in spec["volumes"] if "persistentVolumeClaim" in v]


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "local-only"])
def test_prefetch_mounts_the_node_root_read_only_and_names_what_each_arch_serves(
    fallback: bool,
) -> None:
    config = OperatorConfig(prefetch_root="/var/lib/kc", prefetch_fallback=fallback)
    spec = injected(builder(), config)
    init = init_of(spec)
    # An arch with an artifact wants that artifact; one without, the generation in status.
    assert arg_values(init, "--want") == [f"sm_120a={'h' * 32}", f"sm_90a={REF}"]
    assert arg_values(init, "--local") == ["/var/lib/kernelcache-local"]
    assert arg_values(init, "--local-wait") == ["300"]
    host = next(v for v in spec["volumes"] if "hostPath" in v)
    assert host["hostPath"] == {"path": "/var/lib/kc", "type": "DirectoryOrCreate"}
    mount = next(m for m in init["volumeMounts"] if m["name"] == host["name"])
    assert mount["readOnly"] is True
    claims = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    # Local only: the claim is not even mounted, so nothing can read it.
    assert bool(claims) is fallback and ("--local-only" in init["args"]) is not fallback


def test_a_prefetch_daemonset_per_class_on_its_nodes_copying_from_the_store() -> None:
    doc = builder()
    doc["spec"]["gpuClasses"][0]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H200"}
    kc = parse_kernelcache(doc, "kc")
    config = OperatorConfig(prefetch_root="/var/lib/kc", prefetch_limit_bytes=1000)
    sets = modes.prefetch_daemonsets(kc, {"uid": "uid-2"}, config)
    assert len(sets) == 2
    by_arch = {d["metadata"]["labels"][LABEL_ARCH]: d for d in sets}
    h200 = by_arch["sm_90a"]["spec"]["template"]["spec"]
    assert h200["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    fetch = h200["initContainers"][1]
    assert fetch["command"][:8] == [
        "kernelcache", "prefetch", "--root", "/var/lib/kernelcache-local",
        "--key", "team/demo/sm_90a", "--want", REF,
    ]  # fmt: skip
    assert "--store" not in fetch["command"]  # an artifact: pulled
    rtx = by_arch["sm_120a"]["spec"]["template"]["spec"]["initContainers"][1]
    assert rtx["command"][rtx["command"].index("--store") + 1] == "/var/lib/kernelcache"
    assert rtx["command"][rtx["command"].index("--limit") + 1] == "1000"
    assert modes.prefetch_daemonsets(kc, {"uid": "uid-2"}, CONFIG) == []  # prefetch off


def test_node_states_read_from_the_daemonset_pods() -> None:
    def ds_pod(node: str, digest: str, **status: Any) -> dict[str, Any]:
        labels = {LABEL_ARCH: "sm_90a", LABEL_DIGEST: digest}
        return {"metadata": {"labels": labels}, "spec": {"nodeName": node}, "status": status}

    last = {"terminated": {"exitCode": 10, "message": "kernelcache: error: full\n"}}
    failed = {"name": "prefetch", "state": {"waiting": {}}, "lastState": last}
    pods = [
        ds_pod("a", "new", phase="Running"),
        ds_pod("b", "old", phase="Running"),  # of the previous generation: being replaced
        ds_pod("c", "new", phase="Pending", initContainerStatuses=[failed]),
    ]
    states = modes.node_states(pods, {"sm_90a": "new"})
    assert [(s["node"], s["phase"]) for s in states] == [
        ("a", "Ready"), ("b", "Pulling"), ("c", "Failed"),
    ]  # fmt: skip
    assert states[2]["message"] == "kernelcache: error: full"


# --------------------------------------------------------------------------- the init-container

# Counts every open, listing and stat of a path under the shared store by the init-container
# (Python's audit events: the same calls the kernel sees), then runs ``kernelcache verify``.
COUNTING = """
import os, sys
store = os.path.realpath(sys.argv[1]); reads = []
def hook(event, args):
    if event in ("open", "os.scandir", "os.listdir", "os.stat") and args and args[0] is not None:
        target = args[0]
        if isinstance(target, int):
            return
        if os.path.realpath(os.fsdecode(target)).startswith(store):
            reads.append(target)
sys.addaudithook(hook)
from kernelcache.cli import main
code = main(sys.argv[2:])
print("shared-store-reads", len(reads), file=sys.stderr)
sys.exit(code)
"""


def verify(store: Path, *args: str | Path) -> tuple[subprocess.CompletedProcess[str], int]:
    done = subprocess.run(
        [sys.executable, "-c", COUNTING, str(store), "verify", "--store", str(store),
         "--namespace", NS, "--name", NAME, "--arch", ARCH, "--gpu-product", PRODUCT,
         "--expect-image", IMAGE, *map(str, args)],
        env=subprocess_env(), capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    counted = [line for line in done.stderr.splitlines() if line.startswith("shared-store-reads")]
    reads = int(counted[-1].split()[1])
    done.stderr = "\n".join(line for line in done.stderr.splitlines() if line not in counted)
    return done, reads


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    store = tmp_path / "shared"
    publish(store)
    return store


def test_a_prefetched_node_serves_with_zero_reads_of_the_shared_store(
    shared: Path, tmp_path: Path
) -> None:
    local, pod_dir = tmp_path / "node-disk", tmp_path / "pod"
    generation = Store(shared).current(KEY).name  # type: ignore[union-attr]
    synced = prefetch.sync(local, KEY, generation, limit_bytes=10**9, store=shared)
    assert synced.fetched
    done, reads = verify(shared, "--local", local, "--want", f"{ARCH}={generation}",
                         "--materialize", pod_dir)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert reads == 0
    assert "from this node's prefetched copy" in done.stdout
    report = json.loads((pod_dir / REPORT_FILE).read_text())
    assert report["source"] == "local" and report["generation"] == generation
    # The counter counts: the same pod without the node's copy reads the store.
    done, reads = verify(shared, "--materialize", tmp_path / "pod-2")
    assert done.returncode == 0 and reads > 0, done.stderr


def test_a_copy_of_another_generation_is_not_used_and_the_pod_falls_back_saying_so(
    shared: Path, tmp_path: Path
) -> None:
    local = tmp_path / "node-disk"
    generation = Store(shared).current(KEY).name  # type: ignore[union-attr]
    prefetch.sync(local, KEY, generation, limit_bytes=10**9, store=shared)
    newer = "f" * 32  # what the KernelCache serves now: not on this node yet
    done, reads = verify(shared, "--local", local, "--want", f"{ARCH}={newer}",
                         "--materialize", tmp_path / "pod")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert reads > 0
    assert f"no prefetched copy of {newer} on this node yet: reading it from its source" in (
        done.stderr
    )
    done, _ = verify(shared, "--local", local, "--want", f"{ARCH}={newer}", "--local-only",
                     "--materialize", tmp_path / "pod-2")  # fmt: skip
    assert done.returncode == ExitCode.MISSING_GENERATION, done.stderr
    assert one_line_error(done).endswith("on this node yet (local only)")


def test_a_pod_on_a_node_that_just_joined_waits_for_its_copy(shared: Path, tmp_path: Path) -> None:
    """The init-container waits (up to its bound) for the prefetch to land the copy, then
    reads it and nothing else."""
    local = tmp_path / "node-disk"
    generation = Store(shared).current(KEY).name  # type: ignore[union-attr]
    result: dict[str, Any] = {}

    def pod_starts() -> None:
        want = f"{ARCH}={generation}"
        result["done"] = verify(shared, "--local", local, "--want", want, "--local-wait", "600",
                                "--materialize", tmp_path / "pod")  # fmt: skip

    started = threading.Thread(target=pod_starts)
    started.start()
    prefetch.sync(local, KEY, generation, limit_bytes=10**9, store=shared)
    started.join(timeout=900)
    done, reads = result["done"]
    assert done.returncode == 0, done.stderr
    assert reads == 0 and "from this node's prefetched copy" in done.stdout


# --------------------------------------------------------------------------- the bounded disk


def another(store: Path, i: int, size: int = 12000) -> str:
    """Publish a new generation of KEY holding ``size`` bytes; its id. (The store keeps two
    besides the current one: a node copies each as it is published.)"""
    return publish(store, files={"cute-dsl/kernel.o": bytes([i]) * size}).name


def test_eviction_takes_the_oldest_copy_no_kernelcache_serves_and_none_being_read(
    tmp_path: Path,
) -> None:
    store, local = tmp_path / "shared", tmp_path / "node-disk"
    limit = 3 * 12000 + 100  # three copies
    g1, g2, g3 = [another(store, i) for i in range(1, 4)]
    for generation in (g1, g2, g3):
        prefetch.sync(local, KEY, generation, limit_bytes=limit, store=store)
    g4 = another(store, 4)  # the shared store drops g1 now; this node evicts it too
    synced = prefetch.sync(local, KEY, g4, limit_bytes=limit, store=store)
    assert synced.evicted == [f"{KEY}/{g1}"]  # the oldest; g2 and g3 kept for a rollback
    assert not (local / KEY / g1).exists() and (local / KEY / g2).is_dir()
    # A pod copying g2 out holds it: g5 evicts g3 instead, although g2 is the older.
    g5 = another(store, 5)
    with reading(local / KEY / g2) as there:
        assert there
        synced = prefetch.sync(local, KEY, g5, limit_bytes=limit, store=store)
    assert synced.evicted == [f"{KEY}/{g3}"]
    assert (local / KEY / g2).is_dir() and find(local, KEY, g5) is not None
    assert find(local, KEY, g4) is None and (local / KEY / g4).is_dir()  # kept, not served


def test_a_generation_that_cannot_fit_is_refused_in_one_line_and_the_copies_stay(
    tmp_path: Path,
) -> None:
    store, local = tmp_path / "shared", tmp_path / "node-disk"
    g1 = another(store, 1)
    prefetch.sync(local, KEY, g1, limit_bytes=13000, store=store)
    g2 = another(store, 2)
    with pytest.raises(StorageError) as info:  # g1 is what the KernelCache serves
        prefetch.sync(local, KEY, g2, limit_bytes=13000, store=store)
    assert "does not fit the prefetch limit" in info.value.message
    assert read_wanted(local, KEY).generation == g1  # type: ignore[union-attr]
    assert find(local, KEY, g1) is not None and not (local / KEY / g2).exists()


def test_a_full_node_disk_fails_the_fetch_and_the_copy_a_pod_uses_still_verifies(
    shared: Path, tmp_path: Path
) -> None:
    """A real full disk: the node's root on a tmpfs too small for a second generation (in a
    mount namespace of its own). The fetch fails with one line; the first copy serves on."""
    if os.geteuid() != 0:
        pytest.skip("a tmpfs mount needs root")
    local = tmp_path / "node-disk"
    local.mkdir()
    first = Store(shared).current(KEY).name  # type: ignore[union-attr]
    pages = sum(
        -(-p.stat().st_size // 4096) * 4096
        for p in (shared / KEY / first).rglob("*")
        if p.is_file()
    )
    second = another(shared, 2, size=512 * 1024)  # more than the room left
    script = (
        f"mount -t tmpfs -o size={pages + 128 * 1024} tmpfs {local} && "
        f"{sys.executable} -m kernelcache prefetch --root {local} --key {KEY} --want {first} "
        f"--store {shared} --limit 1000000000 && "
        f"{{ {sys.executable} -m kernelcache prefetch --root {local} --key {KEY} --want {second} "
        f"--store {shared} --limit 1000000000; echo exit=$?; }} && "
        f"{sys.executable} -m kernelcache verify --store {tmp_path / 'none'} --local {local} "
        f"--want {ARCH}={first} --local-only --namespace {NS} --name {NAME} --arch {ARCH} "
        f"--gpu-product '{PRODUCT}' --expect-image {IMAGE} --materialize {tmp_path / 'pod'}"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env=subprocess_env(), capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"exit={int(ExitCode.IO)}" in done.stdout, done.stdout
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("kernelcache: error:")]
    assert "No space left on device" in line or "does not fit" in line, line
    assert "from this node's prefetched copy" in done.stdout


# --------------------------------------------------------------------------- pull by digest


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.helpers.registry import running_registry

    with running_registry(tmp_path_factory.mktemp("registry")) as running:
        yield running


def test_a_pod_of_another_store_pulls_by_digest_and_starts_warm(
    registry: Any, shared: Path, tmp_path: Path
) -> None:
    from kernelcache.distribution import push

    pushed = push(shared, KEY, registry.repo("caches/demo"), auth=registry.authfile,
                  ca_file=registry.ca_file)  # fmt: skip
    # Another cluster: another namespace and name, no store at all.
    done = subprocess.run(
        [sys.executable, "-m", "kernelcache", "verify", "--pull", f"{ARCH}={pushed.ref_digest}",
         "--authfile", str(registry.authfile), "--ca-file", str(registry.ca_file),
         "--namespace", "elsewhere", "--name", "served", "--arch", ARCH,
         "--gpu-product", PRODUCT, "--expect-image", IMAGE,
         "--materialize", str(tmp_path / "pod")],
        env=subprocess_env(), capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"{KEY}: generation" in done.stdout and "pulled by digest" in done.stdout
    report = json.loads((tmp_path / "pod" / REPORT_FILE).read_text())
    assert report["source"] == "pull" and not (tmp_path / "pod" / ".pulled").exists()
    # An arch the pod was given no artifact for: one line, nothing to serve.
    done = subprocess.run(
        [sys.executable, "-m", "kernelcache", "verify", "--pull", f"sm_120a={pushed.ref_digest}",
         "--namespace", "elsewhere", "--name", "served", "--arch", ARCH,
         "--materialize", str(tmp_path / "pod-2")],
        env=subprocess_env(), capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert done.returncode == ExitCode.MISSING_GENERATION
    assert one_line_error(done).endswith("(arches with one: sm_120a)")


def test_a_prefetch_pulls_the_artifact_for_its_node(
    registry: Any, shared: Path, tmp_path: Path
) -> None:
    from kernelcache.distribution import push

    pushed = push(shared, KEY, registry.repo("caches/prefetch"), auth=registry.authfile,
                  ca_file=registry.ca_file)  # fmt: skip
    local = tmp_path / "node-disk"
    consumer_key = f"elsewhere/served/{ARCH}"
    synced = prefetch.sync(local, consumer_key, pushed.ref_digest, limit_bytes=10**9,
                           ref=pushed.ref_digest, auth=registry.authfile,
                           ca_file=registry.ca_file)  # fmt: skip
    assert synced.wanted.key == KEY  # the building cluster's key, bound by its manifest
    assert find(local, consumer_key, pushed.ref_digest) is not None
    assert not list(local.glob(".pull-*"))


# --------------------------------------------------------------------------- the chart


def test_the_chart_says_the_mode_and_configures_the_operator_with_it() -> None:
    from tests.helpers.chart import CHART, granted_rules, helm, render, render_text

    def operator_config(docs: list[dict[str, Any]]) -> OperatorConfig:
        (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
        env = {
            e["name"]: e["value"]
            for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
            if "value" in e  # not the fields read from the pod (POD_ID)
        }
        return OperatorConfig.from_env(
            {k: v for k, v in env.items() if k.startswith("KERNELCACHE_OPERATOR_")}
        )

    default = render("defaults")
    config = operator_config(default)
    assert config.distribution_mode == "volume" and config.prefetch_root == ""
    assert not [g for g in granted_rules(default) if g[1] == "daemonsets"]
    values = {"distribution": {"mode": "image"},
              "prefetch": {"enabled": True, "limitBytes": 10**11, "fallback": False}}  # fmt: skip
    docs = render("defaults", values)
    config = operator_config(docs)
    assert (config.distribution_mode, config.prefetch_root) == (
        "image",
        "/var/lib/kernelcache-prefetch",
    )
    assert config.prefetch_limit_bytes == 10**11 and config.prefetch_fallback is False
    # The operator creates and updates the DaemonSets only when prefetch is on.
    daemonsets = {("apps", "daemonsets", verb) for verb in ("list", "create", "patch", "delete")}
    assert daemonsets <= granted_rules(docs)
    sets = ["--set", "distribution.mode=image", "--set", "prefetch.enabled=true"]
    installed = helm("install", "kc", str(CHART), "--dry-run=client", *sets)
    assert installed.returncode == 0, installed.stderr
    assert (
        "Distribution mode: image (each arch's OCI artifact as an image volume); prefetch to "
        "node-local disk: on, at /var/lib/kernelcache-prefetch." in installed.stdout
    )
    bad = render_text("defaults", json.dumps({"distribution": {"mode": "nfs"}}))
    assert bad.returncode != 0 and "/distribution/mode" in bad.stderr, bad.stderr


# --------------------------------------------------------------------------- the reconcile


class FakeKube:
    """The calls a reconcile makes, answered from a dict of objects by path (labels match as
    the API server's selector does); what it changed is kept in ``calls``."""

    def __init__(self, kc: dict[str, Any]) -> None:
        from kernelcache.controller.kube import kernelcache_path

        self.objects: dict[str, dict[str, Any]] = {
            kernelcache_path("team", kc["metadata"]["name"]): kc
        }
        self.calls: list[tuple[str, str]] = []

    def get(self, where: str) -> dict[str, Any]:
        from kernelcache.controller.kube import ApiError

        if where not in self.objects:
            raise ApiError(404, "NotFound", where)
        return self.objects[where]

    def list(self, where: str, selector: str = "") -> list[dict[str, Any]]:
        terms = dict(t.split("=", 1) for t in selector.split(",") if t)
        return [
            o
            for p, o in self.objects.items()
            if p.rsplit("/", 1)[0] == where
            and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in terms.items())
        ]

    def create(self, where: str, body: dict[str, Any]) -> bool:
        self.calls.append(("create", f"{where}/{body['metadata']['name']}"))
        self.objects.setdefault(f"{where}/{body['metadata']['name']}", body)
        return True

    def patch(self, where: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("patch", where))
        if where.endswith("/status"):
            self.objects[where.removesuffix("/status")]["status"] = body["status"]
        elif where in self.objects:
            self.objects[where].update(body)
        return {}

    def delete(self, where: str) -> bool:
        self.calls.append(("delete", where))
        return self.objects.pop(where, None) is not None


def test_the_reconcile_keeps_a_daemonset_per_class_on_what_each_arch_serves() -> None:
    from kernelcache.controller.handlers.handle_reconcile_kernelcache import reconcile_kernelcache

    doc = consumer()
    doc["spec"]["gpuClasses"].append({"name": "rtx", "arch": "sm_120a"})
    doc["spec"]["source"]["oci"]["artifacts"]["sm_120a"] = REF.replace("5e", "7f")
    doc["metadata"].update(resourceVersion="1", generation=1)
    kube = FakeKube(doc)
    config = OperatorConfig(prefetch_root="/var/lib/kc")
    collection = "/apis/apps/v1/namespaces/team/daemonsets"

    def reconcile() -> list[tuple[str, str]]:
        kube.calls.clear()
        body = kube.get("/apis/kernelcache.dev/v1alpha1/namespaces/team/kernelcaches/served")
        reconcile_kernelcache(kube, config, body, lambda uid: [])  # type: ignore[arg-type]
        return [c for c in kube.calls if c[1].startswith(collection)]

    created = reconcile()
    assert [verb for verb, _ in created] == ["create", "create"]
    assert reconcile() == []  # steady state: nothing written
    # The sm_120a artifact changes: its DaemonSet's template does, so each node fetches it.
    new = REF.replace("5e", "9a")
    kube.get("/apis/kernelcache.dev/v1alpha1/namespaces/team/kernelcaches/served")["spec"][
        "source"
    ]["oci"]["artifacts"]["sm_120a"] = new
    (changed,) = reconcile()
    assert changed[0] == "patch" and new in json.dumps(kube.objects[changed[1]]["spec"])
    # The class goes: its DaemonSet goes with it.
    spec = kube.get("/apis/kernelcache.dev/v1alpha1/namespaces/team/kernelcaches/served")["spec"]
    spec["gpuClasses"].pop()
    del spec["source"]["oci"]["artifacts"]["sm_120a"]
    (gone,) = reconcile()
    assert gone[0] == "delete" and gone[1] == changed[1]


# --------------------------------------------------------------------------- image mode, in place

ARTIFACT_DIR = "/var/lib/kernelcache-artifacts/sm_90a"
# Each writable toolchain's files beside the CuTe-DSL kernels (which alone are read in place).
WRITABLE = {
    "triton/k3x/matmul.cubin": b"\x7fELF" + bytes(3000),
    "triton/k3x/__grp__matmul.json": b'{"child_paths": {}}',
    "inductor/fxgraph/ab/entry": b"graph",
    "flashinfer/aot/decode/decode.so": b"\x7fELF" + bytes(500),
    "vllm/torch_compile_cache/rank_0/model": b"artifact",
}


def test_image_mode_mounts_the_artifacts_in_serving_containers_where_verify_checked_them() -> None:
    spec = injected(builder(), OperatorConfig(distribution_mode="image"))
    (arch, where) = arg_values(init_of(spec), "--artifact")[0].split("=")
    (serve,) = spec["containers"]
    mounts = {m["mountPath"]: m for m in serve["volumeMounts"]}
    # The env file names the mount (KERNELCACHE_IN_PLACE_DIR): it must be the same path here.
    assert (arch, where) == ("sm_90a", ARTIFACT_DIR)
    assert mounts[where] == {"name": "kernelcache-artifact-sm-90a", "mountPath": where,
                             "readOnly": True}  # fmt: skip
    env = {e["name"]: e["value"] for e in serve["env"]}
    assert env["KERNELCACHE_ENV_FILE"] == "/kernelcache/kernelcache.env"
    # Volume and pull mode: the serving container mounts the emptyDir alone.
    for mode in ("volume", "pull"):
        (other,) = injected(builder(), OperatorConfig(distribution_mode=mode))["containers"]
        assert [m["mountPath"] for m in other["volumeMounts"]] == ["/kernelcache"], mode


def test_a_serving_container_that_mounts_the_artifact_path_itself_is_refused() -> None:
    doc, the_pod = builder(), pod()
    the_pod["metadata"]["labels"]["kernelcache.dev/cache"] = doc["metadata"]["name"]
    the_pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "own", "mountPath": ARTIFACT_DIR}]
    with pytest.raises(Denied, match=f"container 'serve' mounts {ARTIFACT_DIR} already"):
        mutate_pod(the_pod, doc, OperatorConfig(distribution_mode="image"))


def the_world_is_unshareable() -> str | None:
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if os.geteuid() != 0:
        return "needs root: a read-only, noexec bind mount and another user"
    return None


# Run by sh in a private mount namespace: the artifact becomes what the kubelet mounts for an
# image volume (read-only, noexec, nosuid, nodev), then the command runs as the pod's user.
IMAGE_VOLUME = r"""
set -eu
artifact=$1
shift
mount --bind "$artifact" "$artifact"
mount -o remount,bind,ro,noexec,nosuid,nodev "$artifact"
exec "$@"
"""


@functools.cache
def pod_user() -> tuple[int, int]:
    """The pod's uid and gid when this very interpreter runs as them (it may lie where only
    root reads), else root's: the processes then run without any capability, which
    permission bits and the read-only mount bind like any user."""
    as_user = ["setpriv", "--reuid=65532", "--regid=65532", "--clear-groups"]
    probe = [sys.executable, "-c", "import sys; print(sys.version)"]
    done = subprocess.run([*as_user, *probe], capture_output=True, text=True, check=False)
    return (65532, 65532) if done.stdout.strip() == sys.version else (0, 0)


def as_pod_user() -> list[str]:
    uid, gid = pod_user()
    drop = ["setpriv", "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    return [*drop, f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]


# The serving process: the runtime as the webhook's env sets it up, then a Triton lookup of a
# kernel the generation lacks (its cache manager makes the kernel's directory: a read-only
# tree would raise), then the demo's kernels through the CuTe-DSL disk layer.
SERVE = """
import json, sys
from kernelcache import runtime
from kernelcache.toolchains import toolchains
r = runtime.install()
print("ENV " + json.dumps({v: r.env.get(v) for t in toolchains() for v in t.cache_env}))
import os
from triton.runtime.cache import FileCacheManager
FileCacheManager("kernel-the-generation-lacks").put(b"x", "k.bin")
pointed, os.environ["TRITON_CACHE_DIR"] = os.environ["TRITON_CACHE_DIR"], sys.argv[2]
try:  # why Triton is copied: on a read-only tree, a lookup of what it lacks raises
    FileCacheManager("kernel-the-generation-lacks")
except OSError as exc:
    print("TRITON-ON-THE-MOUNT", exc.errno)
os.environ["TRITON_CACHE_DIR"] = pointed
import demo_serve
sys.exit(demo_serve.main(["--workload", sys.argv[1]]))
"""


@pytest.fixture
def pod_dir() -> Iterator[Path]:
    """A directory the pod's user reaches (pytest's own are private to root)."""
    with tempfile.TemporaryDirectory(prefix="kernelcache-image-") as tmp:
        os.chmod(tmp, 0o755)
        yield Path(tmp)


def artifact_of(gen: Path, mount: Path) -> Path:
    """The generation as the kubelet unpacks an image volume: its files, nobody's to write."""
    shutil.copytree(gen, mount)
    for path in [mount, *mount.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    return mount


def test_image_mode_copies_only_what_toolchains_write_and_serves_cute_dsl_in_place(
    demo_build: Any, pod_dir: Path
) -> None:
    """The demo's real CuTe-DSL kernels with every writable toolchain's files, mounted as an
    image volume is (read-only, noexec); init-container and serving process as the pod's user."""
    if (reason := the_world_is_unshareable()) is not None:
        pytest.skip(reason)
    from kernelcache.store import Manifest
    from tests.conftest import SMALL_WORKLOAD, publish_files

    demo = demo_build.generation
    built = Manifest.parse((demo / "MANIFEST.json").read_bytes(), "demo")
    kernels = {e.path: (demo / "files" / e.path).read_bytes() for e in built.files}
    assert kernels and all(p.startswith(("cute-dsl/", "cute-dsl-jit/")) for p in kernels)
    store = Store(pod_dir / "built")
    publish_files(store, demo_build.key, {**kernels, **WRITABLE}, built.stamp, built.report)
    mount = artifact_of(store.current(demo_build.key) or Path(), pod_dir / "artifact")
    emptydir, tmp = pod_dir / "kernelcache", pod_dir / "tmp"
    for made in (emptydir, tmp):
        made.mkdir()
        os.chown(made, *pod_user())
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("KERNELCACHE_")}
    env.update(HOME=str(tmp), TMPDIR=str(tmp), CUTE_DSL_ARCH="sm_90a")

    def in_pod(*argv: str) -> subprocess.CompletedProcess[str]:
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", IMAGE_VOLUME,
                   "image-volume", str(mount), *as_pod_user(), sys.executable, *argv]  # fmt: skip
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(300))

    init = in_pod("-m", "kernelcache", "verify", "--artifact", f"sm_90a={mount}",
                  "--namespace", "default", "--name", "demo", "--arch", "sm_90a",
                  "--materialize", str(emptydir))  # fmt: skip
    assert init.returncode == 0, init.stderr
    report = json.loads((emptydir / REPORT_FILE).read_text())
    assert (report["files_copied"], report["files_in_place"]) == (len(WRITABLE), len(kernels))
    assert report["in_place_dir"] == str(mount) and "from its image volume" in init.stdout
    copy = Path(report["dir"])
    assert f"checked, {len(WRITABLE)} copied to {copy} and {len(kernels)} read in place " in (
        init.stdout
    )
    copied = sorted(p.relative_to(copy / "files").as_posix() for p in (copy / "files").rglob("*")
                    if p.is_file())  # fmt: skip
    assert copied == sorted(WRITABLE)  # every writable toolchain's tree, no kernel
    assert f"KERNELCACHE_IN_PLACE_DIR={mount}" in (emptydir / "kernelcache.env").read_text()

    env.update(KERNELCACHE_ENV_FILE=str(emptydir / "kernelcache.env"), KERNELCACHE_STRICT="1")
    served = in_pod("-c", SERVE, json.dumps(SMALL_WORKLOAD), f"{mount}/files/cute-dsl")
    assert served.returncode == 0, served.stdout + served.stderr
    pointed = json.loads(served.stdout.split("ENV ", 1)[1].splitlines()[0])
    assert pointed["KERNELCACHE_CUTE_DSL_DIR"] == f"{mount}/files/cute-dsl"
    assert pointed["CUTE_DSL_CACHE_DIR"] == f"{mount}/files/cute-dsl-jit"
    for variable in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"):
        assert pointed[variable].startswith(f"{copy}/files/"), (variable, pointed)
    assert (copy / "files" / "triton" / "kernel-the-generation-lacks" / "k.bin").is_file()
    refused = [line for line in served.stdout.splitlines() if line.startswith("TRITON-ON")]
    assert refused in (["TRITON-ON-THE-MOUNT 30"], ["TRITON-ON-THE-MOUNT 13"]), refused
    line = served.stdout.strip().splitlines()[-1]
    ready = re.fullmatch(
        rf"(\d+) kernels ready in \S+ s from {mount}/files/cute-dsl: (\d+) loaded from cache, "
        r"0 compiled, 0 uncacheable",
        line,
    )
    assert ready is not None and ready[1] == ready[2] != "0", line


def test_in_place_files_are_digested_on_the_mount(tmp_path: Path) -> None:
    """Not copied, so not hashed as they are copied: verify reads them where they are used."""
    mount = tmp_path / "artifact"
    shutil.copytree(publish(tmp_path / "built"), mount)
    victim = mount / "files" / "cute-dsl" / "gemm_128x256.o"
    data = bytearray(victim.read_bytes())
    data[100] ^= 1
    victim.write_bytes(bytes(data))
    done = verify_artifact(mount, tmp_path / "pod", "--gpu-product", PRODUCT)
    assert done.returncode == ExitCode.INTEGRITY, done.stderr
    assert one_line_error(done).endswith(f"{victim}: digest mismatch")


def verify_artifact(mount: Path, target: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kernelcache", "verify", "--artifact", f"{ARCH}={mount}",
         "--namespace", NS, "--name", NAME, "--arch", ARCH, "--materialize", str(target),
         *args],
        env=subprocess_env(), capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip


def test_a_tuning_file_dropped_under_an_in_place_tree_makes_the_pod_copy_all(
    tmp_path: Path,
) -> None:
    """The mount cannot leave out a file: where permissive drops another GPU's tuning that
    lies in a tree read in place, that tree is copied too (and the rest), nothing in place."""
    tuned = {**TUNING, "cute-dsl/gemm_128x256.best_config": b'{"num_warps": 4}'}
    mount = tmp_path / "artifact"
    shutil.copytree(publish(tmp_path / "built", files={**COMPILED, **tuned}), mount)
    target = tmp_path / "pod"
    done = verify_artifact(mount, target, "--gpu-product", "NVIDIA RTX 6000", "--policy",
                           "permissive")  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((target / REPORT_FILE).read_text())
    assert report["files_in_place"] == 0 and report["in_place_dir"] is None
    copy = Path(report["dir"])
    assert sorted(p.relative_to(copy / "files").as_posix() for p in (copy / "files").rglob("*")
                  if p.is_file()) == sorted(COMPILED)  # fmt: skip
    assert "KERNELCACHE_IN_PLACE_DIR" not in (target / "kernelcache.env").read_text()


def test_only_an_image_volume_is_read_in_place(shared: Path, tmp_path: Path) -> None:
    """The shared store (volume mode) is copied whole, as before: in-place reads are for a
    mount the kubelet keeps read-only and unchanged for the pod's life."""
    done, _ = verify(shared, "--materialize", tmp_path / "pod")
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "pod" / REPORT_FILE).read_text())
    assert report["files_in_place"] == 0 and report["files_copied"] == len(COMPILED) + len(TUNING)


def test_a_serving_container_without_the_image_volume_refuses_to_start_in_one_line(
    tmp_path: Path,
) -> None:
    """Its toolchains reading in place would find nothing: strict refuses at start-up, not
    at the first kernel (a pod whose container does not mount the artifact where verify
    checked it)."""
    gen = publish(tmp_path / "built")
    env = subprocess_env(KERNELCACHE_DIR=str(gen), KERNELCACHE_STRICT="1",
                         KERNELCACHE_IN_PLACE_DIR=ARTIFACT_DIR)  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", "from kernelcache.runtime import autoinstall; autoinstall()"],
        env=env, capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
    assert done.returncode == ExitCode.IO, done.stderr
    assert done.stderr.strip() == (
        f"kernelcache: KERNELCACHE_IN_PLACE_DIR={ARTIFACT_DIR}: does not hold the generation at "
        f"{gen} (mount its image volume in this container at that path)"
    )


def test_a_node_copy_a_serving_pod_found_damaged_is_failed_in_status_nodes() -> None:
    """The prefetch pod says Ready; a serving pod on that node then passed over the copy
    (it did not verify) and started from the store: the node's entry says so, until the
    node's prefetch runs again after it."""

    def prefetcher(node: str, finished: str) -> dict[str, Any]:
        done = {"exitCode": 0, "finishedAt": finished}
        return {
            "metadata": {"labels": {LABEL_ARCH: "sm_90a", LABEL_DIGEST: "d1"}},
            "spec": {"nodeName": node},
            "status": {
                "phase": "Running",
                "initContainerStatuses": [{"name": "prefetch", "state": {"terminated": done}}],
            },
        }

    line = f"default/demo/sm_90a: {LOCAL_DAMAGED} (files/x: digest mismatch): read from its source"
    server = {
        "metadata": {"labels": {}},
        "spec": {"nodeName": "n1"},
        "status": {
            "initContainerStatuses": [
                {
                    "name": "kernelcache",
                    "state": {
                        "terminated": {
                            "exitCode": 0,
                            "message": line,
                            "finishedAt": "2026-12-03T10:05:00Z",
                        }
                    },
                }
            ]
        },
    }
    pods = [prefetcher("n1", "2026-12-03T10:00:00Z"), prefetcher("n2", "2026-12-03T10:00:00Z")]
    states = {s["node"]: s for s in modes.node_states(pods, {"sm_90a": "d1"}, [server])}
    assert states["n1"]["phase"] == "Failed" and states["n1"]["message"] == line
    assert states["n2"]["phase"] == "Ready"
    fetched_again = [prefetcher("n1", "2026-12-03T10:09:00Z")]
    [again] = modes.node_states(fetched_again, {"sm_90a": "d1"}, [server])
    assert again["phase"] == "Ready"
