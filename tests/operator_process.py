"""The real operator as a child process against the Kubernetes API test double.

No API server can run where the tests run, so the emulated one of ``k8s_emulator`` stands in
(the unavoidable test double); everything else is real: ``kernelcache operator`` runs in a
process of its own, exactly as its container starts it, and can be SIGKILLed like one.

- ``ObservedEmulator`` calls a hook before and after each request it serves, with the token
  the request carried: each operator start gets a kubeconfig with a token of its own, so the
  requests of one incarnation are told apart from the test's and from an earlier one's.
- ``ApiHarness`` serves it and writes the test client's kubeconfig; ``start_operator``
  starts the operator and returns once it watches KernelCaches and Jobs.
- ``kernelcache`` writes a KernelCache; ``finish_job`` plays the kubelet and the Job
  controller: the warm container's termination message, then the Job's final condition;
  ``result_generation`` is what a succeeded Job publishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import yaml
from kmock import Request
from kubernetes import client
from kubernetes import config as kube_config

from kernelcache.controller.kube import Kube, jobs_path, path
from kernelcache.controller.manifests import LABEL_ARCH, peering_crds
from kernelcache.crd import crd_manifest
from tests.conftest import scaled, subprocess_env, wait_until
from tests.k8s_emulator import KubernetesEmulator, serving

# Hooks get the request and the token it carried ("" for none).
BeforeHook = Callable[[Request, str], bool]  # False: the request is lost, never served
AfterHook = Callable[[Request, str], None]


def token_of(request: Request) -> str:
    header = next((v for k, v in request.headers.items() if k.lower() == "authorization"), "")
    return header.removeprefix("Bearer ").strip()


@attrs.define(kw_only=True)
class ObservedEmulator(KubernetesEmulator):
    """The emulator, with a hook before each request is served and one after."""

    before: BeforeHook | None = None
    after: AfterHook | None = None

    async def _handle(self, request: Request) -> aiohttp.web.StreamResponse:
        token = token_of(request)
        if self.before is not None and not self.before(request, token):
            if not self.keep_requests:
                self._requests.remove(request)
            return aiohttp.web.Response(status=503, text="lost")
        response = await super()._handle(request)
        if self.after is not None:
            self.after(request, token)
        return response


def kubeconfig(url: str, token: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": url}}],
            "users": [{"name": token, "user": {"token": token}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": token}}],
        }
    )


@dataclass
class ApiHarness:
    """The served emulator, the test's own client (token ``tester``) and a scratch dir."""

    emulator: ObservedEmulator
    url: str
    kube: Kube
    tmp: Path
    operators: dict[str, Operator] = field(default_factory=dict, init=False)  # by token

    def start_operator(self, **settings: str) -> Operator:
        """``kernelcache operator`` with ``KERNELCACHE_OPERATOR_*`` settings (names without
        the prefix, e.g. ``MAX_ATTEMPTS="2"``); returns once its watches are served, or
        once it exited (a hook may kill it that early)."""
        token = f"operator-{len(self.operators) + 1}"
        config = self.tmp / f"{token}.kubeconfig"
        config.write_text(kubeconfig(self.url, token))
        env = {k: v for k, v in subprocess_env().items() if not k.startswith("KERNELCACHE_")}
        env.update({f"KERNELCACHE_OPERATOR_{k}": v for k, v in settings.items()})
        env.update(KUBECONFIG=str(config), KERNELCACHE_OPERATOR_LIVENESS="")
        env.setdefault("KERNELCACHE_OPERATOR_METRICS_PORT", "0")
        log = self.tmp / f"{token}.log"
        watches = self.emulator.watches
        before = watches["kernelcaches"], watches["jobs"]
        with log.open("w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "kernelcache", "operator"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        operator = self.operators[token] = Operator(process, token, log)
        wait_until(
            lambda: (
                operator.exited()
                or (watches["kernelcaches"] > before[0] and watches["jobs"] > before[1])
            ),
            what="the operator's watches",
        )
        return operator


@dataclass
class Operator:
    process: subprocess.Popen[bytes]
    token: str
    log: Path

    def exited(self) -> bool:
        return self.process.poll() is not None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM, as Kubernetes stops a pod: it must exit cleanly, without a traceback."""
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=scaled(30)) == 0, self.tail()
        assert "Traceback" not in self.log.read_text(errors="replace"), self.tail()

    def kill(self) -> None:
        """SIGKILL, unless it exited already."""
        if not self.exited():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=scaled(30))


@contextmanager
def api_harness(tmp: Path) -> Iterator[ApiHarness]:
    """A fresh emulator serving the KernelCache and peering CRDs, and a client on it.

    Requests are forgotten once answered (long runs would otherwise slow kmock's routing);
    set the emulator's ``before`` and ``after`` hooks to watch them go by.
    """

    def factory() -> ObservedEmulator:
        return ObservedEmulator(keep_requests=False)

    with serving(factory) as (emulator, url):
        emulator.resources.load_bundled()
        for crd in [crd_manifest(), *peering_crds()]:
            emulator.declare(crd)
        config = tmp / "tester.kubeconfig"
        config.write_text(kubeconfig(url, "tester"))
        configuration = client.Configuration()
        configuration.connection_pool_maxsize = 8
        kube_config.load_kube_config(str(config), client_configuration=configuration)
        harness = ApiHarness(emulator, url, Kube(client.ApiClient(configuration)), tmp)
        try:
            yield harness
        finally:  # a failed test leaves no operator running
            for operator in harness.operators.values():
                operator.kill()


def result_generation(job_name: str) -> str:
    """The generation a succeeded compile Job publishes (what its status must then show)."""
    return f"gen-{job_name}"


def finish_job(kube: Kube, job: dict[str, Any], *, succeeded: bool) -> None:
    """Be the kubelet and the Job controller: the warm pod terminates, then its Job ends."""
    meta = job["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    if succeeded:
        result = {"arch": meta["labels"].get(LABEL_ARCH), "status": "published",
                  "generation": result_generation(name), "stamp": "blake3:" + "ab" * 32,
                  "files": 3, "bytes": 9000, "seconds": 1.5}  # fmt: skip
        terminated = {"exitCode": 0, "message": json.dumps(result)}
    else:
        terminated = {"exitCode": 11, "message": f"kernelcache: error: {name} failed to warm"}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-pod",
            "labels": job["spec"]["template"]["metadata"]["labels"],
        },
        "status": {"containerStatuses": [{"name": "warm", "state": {"terminated": terminated}}]},
    }
    kube.create(path("v1", "pods", namespace), pod)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    condition = {"type": "Complete", "status": "True", "lastTransitionTime": now}
    status: dict[str, Any] = {"startTime": now, "completionTime": now, "succeeded": 1}
    if not succeeded:
        condition.update(type="Failed", reason="BackoffLimitExceeded", message="reached the limit")
        status = {"startTime": now, "failed": 1}
    status["conditions"] = [condition]
    kube.patch(jobs_path(namespace, name) + "/status", {"status": status})
