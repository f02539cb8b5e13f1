"""The signing Secret through the real kopf operator (against the emulator): the re-point
attack, and the key rotation of ``docs/security.md`` with pods starting all along.

The test plays the kubelet for real: each compile Job the operator creates is run from its
exact container command (``kernelcache warm``), with its volumes laid out as the kubelet
would (the store claim, the spec ConfigMap, the signing Secret as files), and its
termination message is what that command wrote. Each serving pod is the webhook's
init-container (``webhook.init_container``) run the same way.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# First: it sets the operator's environment, which kernelcache.controller.main reads on import.
from tests.helpers.operator_cluster import (  # isort: split
    NS,
    Cluster,
    emulated_cluster,
    example,
    operator,
)

from kernelcache.controller import webhook
from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.kube import kernelcache_path, path
from kernelcache.controller.manifests import LABEL_ARCH, peering_crds
from kernelcache.crd import crd_manifest
from kernelcache.spec import PUBLIC_KEY_FILE, SIGNING_KEY_FILE, parse_kernelcache
from kernelcache.store import (
    Store,
    fingerprint,
    generate_keypair,
    load_private_key,
    load_public_key,
)
from tests.conftest import scaled, subprocess_env, wait_until
from tests.helpers.trust import KERNEL, forge, warmer

ARCH = "sm_90a"
SECRET = "kc-keys"
KEY = f"{NS}/demo/{ARCH}"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    with emulated_cluster(tmp_path, monkeypatch, [crd_manifest(), *peering_crds()]) as cluster:
        yield cluster


class Kubelet:
    """Runs the cluster's compile Jobs and serving pods' init-containers from their specs."""

    def __init__(self, cluster: Cluster, tmp: Path) -> None:
        self.cluster, self.tmp = cluster, tmp
        self.store, self.runs = tmp / "store", tmp / "runs"
        self.store.mkdir()
        self.done: set[str] = set()
        self.pods = 0

    def volume(self, volume: dict[str, Any], at: Path) -> Path:
        """A volume's files as the kubelet lays them out."""
        if "persistentVolumeClaim" in volume:
            return self.store
        at.mkdir(parents=True)
        if "configMap" in volume or "secret" in volume:
            kind, ref = (
                ("configmaps", volume["configMap"]["name"])
                if "configMap" in volume
                else (
                    "secrets",
                    volume["secret"]["secretName"],
                )
            )
            obj = self.cluster.kube.get(path("v1", kind, NS, ref))
            items = (volume.get("secret") or volume.get("configMap") or {}).get("items")
            data = obj.get("data") or {}
            for item in items or [{"key": k, "path": k} for k in data]:
                value = data[item["key"]]
                raw = base64.b64decode(value) if kind == "secrets" else value.encode()
                (at / item["path"]).write_bytes(raw)
        return at

    def run(self, container: dict[str, Any], volumes: list[dict[str, Any]]) -> tuple[int, str]:
        """The container's command with each mount path mapped to its volume; (exit code,
        termination message)."""
        where = self.tmp / f"run-{len(list(self.tmp.glob('run-*')))}"
        by_name = {v["name"]: v for v in volumes}
        mounts = {"/dev/termination-log": where / "termination-log"}
        for mount in container["volumeMounts"]:
            volume = by_name.get(mount["name"])
            local = where / mount["name"]
            mounts[mount["mountPath"]] = self.volume(volume, local) if volume else local
        args = []
        for arg in [*container["command"][1:], *container.get("args", [])]:
            for mount_path, local in sorted(mounts.items(), key=lambda m: -len(m[0])):
                if arg == mount_path or arg.startswith(mount_path + "/"):
                    arg = str(local) + arg[len(mount_path) :]
                    break
            args.append(arg)
        proc = subprocess.run(
            [sys.executable, "-m", "kernelcache", *args],
            env=subprocess_env(KC_TEST_RUNS=str(self.runs)),
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        log = mounts["/dev/termination-log"]
        message = log.read_text() if log.exists() else proc.stderr[-4000:]
        return proc.returncode, message

    def next_job(self) -> dict[str, Any]:
        """Run the operator's newest compile Job not run yet, and report its end."""

        def fresh() -> list[dict[str, Any]]:
            jobs = self.cluster.jobs(**{LABEL_ARCH: ARCH})
            return [j for j in jobs if j["metadata"]["name"] not in self.done]

        (job,) = wait_until(fresh, what="a new compile Job")
        self.done.add(job["metadata"]["name"])
        spec = job["spec"]["template"]["spec"]
        code, message = self.run(spec["containers"][0], spec["volumes"])
        assert code == 0, message
        self.cluster.finish(job, message=message)
        return job

    def pod(self) -> tuple[int, Path, str]:
        """A serving pod's init-container: (exit code, its materialize dir, its message)."""
        kc = parse_kernelcache(self.cluster.get("demo"), "demo")
        container = webhook.init_container(kc, OperatorConfig())
        container["args"] += ["--arch", ARCH]  # this node's arch (the node map's job)
        volumes = [
            {"name": webhook.STORE_VOLUME, "persistentVolumeClaim": {"claimName": "any"}},
            {"name": webhook.KEY_VOLUME, "secret": {"secretName": SECRET}},
        ]
        code, message = self.run(container, volumes)
        cache = self.tmp / f"run-{len(list(self.tmp.glob('run-*'))) - 1}" / webhook.CACHE_VOLUME
        self.pods += 1
        return code, cache, message

    def compiles(self) -> int:
        return len(self.runs.read_text().splitlines()) if self.runs.exists() else 0


def secret(kube: Any, key: Path, *public: Path, create: bool = False) -> None:
    data = {
        SIGNING_KEY_FILE: base64.b64encode(key.read_bytes()).decode(),
        PUBLIC_KEY_FILE: base64.b64encode(b"".join(p.read_bytes() for p in public)).decode(),
    }
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}, "data": data}
    if create:
        assert kube.create(path("v1", "secrets", NS), body)
    else:
        kube.patch(path("v1", "secrets", NS, SECRET), {"data": data})


def signed_demo(version: str) -> dict[str, Any]:
    kc = example(
        name="demo",
        warmers=[warmer(version)],
        verification={"signing": {"enabled": True, "secretName": SECRET}},
    )
    kc["spec"]["gpuClasses"] = [c for c in kc["spec"]["gpuClasses"] if c["arch"] == ARCH]
    return kc


def condition(cluster: Cluster, kind: str) -> dict[str, Any]:
    conditions = cluster.status("demo").get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def test_the_re_point_attack_through_the_operator(cluster: Cluster, tmp_path: Path) -> None:
    """Spec v1 publishes, v2 publishes, the attacker edits v1's kept generation without
    signing it, the spec is reverted: the operator's Job compiles v1 again rather than
    signing the edit, and the next pod reads the kernel that was built."""
    kubelet = Kubelet(cluster, tmp_path)
    priv, pub = generate_keypair(tmp_path / "keys")
    secret(cluster.kube, priv, pub, create=True)
    with operator(cluster):
        cluster.apply(signed_demo("v1"))
        kubelet.next_job()
        first = cluster.arch_when("demo", ARCH, lambda a: a["phase"] == "Ready")
        assert first["signedBy"] == fingerprint(load_private_key(priv))
        for version in ("v2", "v1"):
            if version == "v1":
                forge(Store(kubelet.store).key_dir(KEY) / first["generation"], KERNEL, b"EVIL")
            spec = signed_demo(version)["spec"]
            cluster.kube.patch(kernelcache_path(NS, "demo"), {"spec": {"warmers": spec["warmers"]}})
            kubelet.next_job()
            cluster.arch_when("demo", ARCH, lambda a: a["phase"] == "Ready")
        reverted = cluster.arch("demo", ARCH)
        assert kubelet.compiles() == 3
        code, cache, message = kubelet.pod()
        assert code == 0, message
        assert (cache / reverted["generation"] / "files" / KERNEL).read_text() == "kernel v1"
        assert condition(cluster, "SignatureTrusted")["status"] == "True"


def test_key_rotation_through_the_operator_keeps_pods_starting_with_no_compile(
    cluster: Cluster, tmp_path: Path
) -> None:
    """docs/security.md's rotation, by editing the Secret: the operator sees each edit and
    its Job re-signs (no compile); a pod starts after every step. Then an abrupt rotation
    (new key and only its public key at once): status says pods would refuse the current
    generation, and Ready is False, until the Job has compiled and signed a new one."""
    kubelet = Kubelet(cluster, tmp_path)
    old, old_pub = generate_keypair(tmp_path / "old")
    new, new_pub = generate_keypair(tmp_path / "new")
    secret(cluster.kube, old, old_pub, create=True)
    with operator(cluster):
        cluster.apply(signed_demo("v1"))
        kubelet.next_job()
        cluster.arch_when("demo", ARCH, lambda a: a["phase"] == "Ready")
        for key, public, job in (
            (old, (old_pub, new_pub), False),  # 1. trust both: nothing to re-sign
            (new, (old_pub, new_pub), True),  # 2. sign with the new key: a Job re-signs
            (new, (new_pub,), False),  # 3. drop the old public key
        ):
            secret(cluster.kube, key, *public)
            trusted = ", ".join(fingerprint(load_public_key(p)) for p in public)
            wait_until(
                lambda t=trusted: (
                    condition(cluster, "SignatureTrusted").get("message") == f"pods trust {t}"
                ),
                what=f"pods trusting {trusted}",
            )
            if job:
                kubelet.next_job()
            fp = fingerprint(load_private_key(key))
            cluster.arch_when("demo", ARCH, lambda a, fp=fp: a.get("signedBy") == fp)
            wait_until(lambda: condition(cluster, "Ready").get("status") == "True", what="Ready")
            code, _, message = kubelet.pod()
            assert code == 0, message
        assert len(kubelet.done) == 2  # the first build and the re-sign
        assert kubelet.compiles() == 1

        abrupt, abrupt_pub = generate_keypair(tmp_path / "abrupt")
        secret(cluster.kube, abrupt, abrupt_pub)
        refused = wait_until(
            lambda: (c := condition(cluster, "SignatureTrusted")).get("status") == "False" and c,
            what="SignatureTrusted False",
        )
        assert (
            "would refuse" in refused["message"]
            and fingerprint(load_private_key(new)) in (refused["message"])
        )
        assert condition(cluster, "Ready")["status"] == "False"
        code, _, message = kubelet.pod()
        assert code != 0 and "MANIFEST.json.sig" in message  # fails closed meanwhile
        kubelet.next_job()
        wait_until(
            lambda: condition(cluster, "SignatureTrusted").get("status") == "True",
            what="SignatureTrusted True",
        )
        code, _, message = kubelet.pod()
        assert code == 0, message
        assert kubelet.compiles() == 2  # nothing it could vouch for: compiled anew
    shutil.rmtree(kubelet.store, ignore_errors=True)


def test_signing_status_is_pure_and_keeps_its_transition_times(tmp_path: Path) -> None:
    """``SignatureTrusted`` from the Secret's data and the arches' ``signedBy``: no public
    key, an unusable one, a foreign signer; an unchanged status keeps its times."""
    from datetime import datetime, timezone

    from kernelcache.controller import signing, state

    kc = parse_kernelcache(signed_demo("v1"), "demo")
    priv, pub = generate_keypair(tmp_path / "k")
    fp = fingerprint(load_private_key(priv))
    data = {
        SIGNING_KEY_FILE: base64.b64encode(priv.read_bytes()).decode(),
        PUBLIC_KEY_FILE: base64.b64encode(pub.read_bytes()).decode(),
    }
    arch = {"arch": ARCH, "phase": "Ready", "generation": "g1", "signedBy": fp, "message": "ok"}
    now = datetime(2026, 12, 1, tzinfo=timezone.utc)

    def summarized(
        kc: Any, arch: dict[str, Any], data: Any, previous: dict[str, Any]
    ) -> dict[str, Any]:
        trust = signing.trust_condition(kc, [arch], data)
        checks = [trust] if trust is not None else []
        return state.summarize([state.ArchPlan(arch)], 1, previous, now, checks=checks)

    def kinds(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {c["type"]: c for c in status["conditions"]}

    held = summarized(kc, arch, data, {})
    trusted = kinds(held)[signing.CONDITION]
    assert trusted["status"] == "True" and trusted["message"] == f"pods trust {fp}"
    assert held["phase"] == "Ready"
    assert summarized(kc, arch, data, held) == held  # nothing changed: nothing to write

    foreign = {**arch, "signedBy": "ed25519:" + "0" * 16}
    refused = summarized(kc, foreign, data, held)
    found = kinds(refused)
    assert found[signing.CONDITION]["reason"] == "SignedByAnotherKey"
    assert "would refuse" in found[signing.CONDITION]["message"]
    assert found["Ready"]["status"] == "False" and found["Degraded"]["status"] == "True"
    assert refused["phase"] == "Degraded"  # not Ready while pods would refuse it
    assert signing.stale(foreign, data)
    assert not signing.stale(arch, data)
    assert f"until its compile Job re-signs it with {fp}" in found[signing.CONDITION]["message"]

    # The Secret's two keys are not a pair: re-signing cannot help, and the line says why.
    other_priv, _ = generate_keypair(tmp_path / "other")
    mismatched = {**data, SIGNING_KEY_FILE: base64.b64encode(other_priv.read_bytes()).decode()}
    c = kinds(summarized(kc, arch, mismatched, held))[signing.CONDITION]
    other = fingerprint(load_private_key(other_priv))
    assert (c["status"], c["reason"]) == ("False", "KeysNotAPair")
    assert c["message"].startswith(
        f"the signing Secret's {SIGNING_KEY_FILE} ({other}) and {PUBLIC_KEY_FILE} ({fp}) are "
        "not a pair"
    )
    assert "re-signed" not in c["message"]

    for broken in ({}, {PUBLIC_KEY_FILE: "bm90IGEga2V5"}):  # the Secret gone; a bad key
        status = summarized(kc, arch, broken, {})
        c = kinds(status)[signing.CONDITION]
        assert (c["status"], c["reason"]) == ("False", "NoPublicKey")
        assert kinds(status)["Ready"]["reason"] == "NoPublicKey"
        assert status["phase"] == "Degraded"
    unsigned = parse_kernelcache(example(name="plain"), "plain")
    assert signing.trust_condition(unsigned, [arch], None) is None
    assert signing.job_identity(data) != signing.job_identity({**data, "x": "y"})
