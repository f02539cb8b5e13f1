"""The operator under kopf against the Kubernetes API emulator, shared by the operator, kubectl,
chart-apply and webhook integration tests: the cluster handle, the example KernelCache, what
a finished compile Job reports, and the operator run in-process."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

# The operator reads its config once, when kopf imports it (timer intervals are fixed at
# registration), so it is set before anything imports kernelcache.controller.main: resync and
# retry within seconds, two attempts, no metrics server.
os.environ.update(
    KERNELCACHE_OPERATOR_RESYNC_SECONDS="0.5",
    KERNELCACHE_OPERATOR_RETRY_BACKOFF_SECONDS="2",
    KERNELCACHE_OPERATOR_RETRY_BACKOFF_MAX_SECONDS="2",
    KERNELCACHE_OPERATOR_MAX_ATTEMPTS="2",
    KERNELCACHE_OPERATOR_CLEANUP_POLL_SECONDS="0.5",
    KERNELCACHE_OPERATOR_METRICS_PORT="0",
)

kopf_testing = pytest.importorskip("kopf.testing", reason="needs kernelcache[operator]")
kubernetes = pytest.importorskip("kubernetes", reason="needs kernelcache[operator]")
kmock = pytest.importorskip("kmock", reason="needs kmock (the Kubernetes API emulator)")

import kopf  # noqa: E402
import yaml  # noqa: E402
from tests.conftest import EXAMPLES, scaled, wait_until  # noqa: E402
from tests.k8s_emulator import KubernetesEmulator, serving  # noqa: E402

from kernelcache.controller.kube import Kube, jobs_path, kernelcache_path, path  # noqa: E402
from kernelcache.controller.manifests import (  # noqa: E402
    LABEL_ARCH,
    LABEL_ATTEMPT,
)

NS = "default"


EXAMPLE = EXAMPLES / "kernelcache.yaml"


T = TypeVar("T")


@dataclass
class Cluster:
    emulator: KubernetesEmulator
    kube: Kube

    def apply(self, kc: dict[str, Any]) -> dict[str, Any]:
        return self.kube.request("POST", kernelcache_path(NS), body=kc)

    def get(self, name: str) -> dict[str, Any]:
        return self.kube.get(kernelcache_path(NS, name))

    def status(self, name: str) -> dict[str, Any]:
        return self.get(name).get("status") or {}

    def arch(self, name: str, arch: str) -> dict[str, Any]:
        arches = self.status(name).get("arches") or []
        return next((a for a in arches if a["arch"] == arch), {})

    def arch_when(self, name: str, arch: str, check: Callable[[dict[str, Any]], bool]) -> Any:
        """Wait until the status entry of an arch passes ``check``; return it."""
        return wait_until(
            lambda: (entry := self.arch(name, arch)) and check(entry) and entry, what=arch
        )

    def jobs(self, **labels: str) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        return self.kube.list(jobs_path(NS), selector)

    def job_names(self) -> list[str]:
        return sorted(j["metadata"]["name"] for j in self.jobs())

    def events(self, name: str) -> list[dict[str, Any]]:
        events = self.kube.list(path("v1", "events", NS))
        return [e for e in events if e["involvedObject"].get("name") == name]

    def reasons(self, name: str) -> list[str]:
        return [e["reason"] for e in self.events(name)]

    def exists(self, name: str) -> bool:
        return any(o["metadata"]["name"] == name for o in self.kube.list(kernelcache_path(NS)))

    def finish(
        self, job: dict[str, Any], *, failed: bool = False, message: str = "", ago: float = 0
    ) -> None:
        """Be the kubelet and the Job controller: the pod ends, then its Job (``ago`` seconds
        ago: what an operator that was busy or down meanwhile sees)."""
        meta = job["metadata"]
        labels = job["spec"]["template"]["metadata"]["labels"]
        terminated = {"exitCode": 11 if failed else 0, "message": message}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{meta['name']}-x7k2p", "labels": labels},
            "status": {
                "containerStatuses": [{"name": "warm", "state": {"terminated": terminated}}]
            },
        }
        self.kube.create(path("v1", "pods", NS), pod)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - ago))
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - ago - 42))
        condition = {"type": "Complete", "status": "True", "lastTransitionTime": now}
        if failed:
            condition.update(
                type="Failed", reason="BackoffLimitExceeded", message="Job has reached the limit"
            )
        status = {"startTime": started, "conditions": [condition], "active": 0}
        status.update({"failed": 1} if failed else {"succeeded": 1, "completionTime": now})
        self.kube.patch(jobs_path(NS, meta["name"]) + "/status", {"status": status})

    def run(self, name: str, arch: str, attempt: int | None = None) -> dict[str, Any]:
        """Wait for the newest compile Job of an arch (or its ``attempt``) to exist; mark it
        running."""

        def attempts() -> list[dict[str, Any]]:
            jobs = self.jobs(**{LABEL_ARCH: arch})
            number = LABEL_ATTEMPT
            return [
                j
                for j in jobs
                if attempt is None or int(j["metadata"]["labels"][number]) == attempt
            ]

        jobs = wait_until(
            attempts,
            what=f"a Job for {arch}" + (f", attempt {attempt}" if attempt is not None else ""),
        )
        job = max(jobs, key=lambda j: int(j["metadata"]["labels"][LABEL_ATTEMPT]))
        self.kube.patch(
            jobs_path(NS, job["metadata"]["name"]) + "/status", {"status": {"active": 1}}
        )
        return job


def result_message(arch: str, generation: str, files: int = 12) -> str:
    """What ``kernelcache warm --result /dev/termination-log`` writes (an ArchResult)."""
    result = {
        "arch": arch,
        "status": "published",
        "generation": generation,
        "stamp": "blake3:" + "ab" * 32,
        "files": files,
        "bytes": 4096 * files,
        "compiled": files,
        "seconds": 41.5,
        "exit_code": 0,
        "message": "",
    }
    return json.dumps(result)


def example(name: str = "demo", **spec: Any) -> dict[str, Any]:
    kc = yaml.safe_load(EXAMPLE.read_text())
    kc["metadata"]["name"] = name
    kc["spec"].update(spec)
    return kc


@contextmanager
def emulated_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crds: list[dict[str, Any]]
) -> Iterator[Cluster]:
    """A fresh emulator serving ``crds``, the kubernetes client and ``$KUBECONFIG`` on it."""
    with serving() as (emulator, url):
        emulator.resources.load_bundled()
        for crd in crds:
            emulator.declare(crd)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "emulator",
                    "clusters": [{"name": "emulator", "cluster": {"server": url}}],
                    "users": [{"name": "tester", "user": {"token": "any"}}],
                    "contexts": [
                        {"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}
                    ],
                }
            )
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        # The kubernetes client reads KUBECONFIG once, at import.
        monkeypatch.setattr(
            kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig)
        )
        yield Cluster(emulator, Kube.from_environment())


@contextmanager
def operator(cluster: Cluster, *args: str, instance: str = "replica-a") -> Iterator[Any]:
    """Run the operator; return once it watches KernelCaches and Jobs (it is not paused)."""
    settings = kopf.OperatorSettings()
    settings.posting.reporting_instance = instance
    watches = cluster.emulator.watches
    before = watches["kernelcaches"], watches["jobs"]
    argv = ["run", "-A", "--verbose", "-m", "kernelcache.controller.main", *args]
    with kopf_testing.KopfRunner(argv, settings=settings, timeout=scaled(30)) as runner:
        wait_until(
            lambda: watches["kernelcaches"] > before[0] and watches["jobs"] > before[1],
            what="the operator's watches",
        )
        yield runner
    assert runner.exception is None, runner.output[-3000:]
    assert runner.exit_code == 0
    assert "Traceback" not in runner.output, runner.output[-3000:]  # no handler crashed
