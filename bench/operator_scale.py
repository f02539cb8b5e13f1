"""The operator at scale: many KernelCaches against the Kubernetes API test double.

Serves the emulator of ``tests/k8s_emulator.py`` in this process, runs the real operator
(``kernelcache operator``) as a child process pointed at it, creates N KernelCaches of A
arches each, and measures, from a watching client's point of view:

- the time until every compile Job exists and until every status reports ``0/A``;
- after the bench finishes every Job (pod termination message, Job condition, as the kubelet
  and the Job controller would), the time until every KernelCache is Ready;
- reconcile p50/p99 from the operator's own histogram, reconciles by result, and the
  operator's resident memory (current and peak).

The emulator is in-memory and single-threaded, so absolute numbers are those of this
machine and this double, not of a real API server; they show how the operator scales.

    python bench/operator_scale.py [--caches 500] [--arches 3] [--workers 16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.k8s_emulator import KubernetesEmulator, serving  # noqa: E402

from kernelcache.controller.kube import Kube, jobs_path, kernelcache_path, path  # noqa: E402
from kernelcache.controller.manifests import peering_crds  # noqa: E402
from kernelcache.crd import crd_manifest  # noqa: E402

ARCHES = ["sm_90a", "sm_100a", "sm_120a", "sm_89", "sm_80", "sm_103a"]
NS = "bench"


def kernelcache(name: str, arches: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "kernelcache.dev/v1alpha1",
        "kind": "KernelCache",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": "bench/model",
            "engine": {"image": "ghcr.io/kernelcache/examples:0.1.0"},
            "gpuClasses": [{"name": a.replace("_", "-"), "arch": a} for a in arches],
            "warmers": [{"type": "cute-dsl", "entryPoints": ["demo_kernels:warm"]}],
        },
    }


class Watch(threading.Thread):
    """A client watch on one resource, keeping the latest version of every object."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.objects = url, {}
        self.changed = threading.Condition()

    def run(self) -> None:
        with urllib.request.urlopen(self.url + "?watch=true") as stream:
            for line in stream:
                event = json.loads(line)
                name = event["object"]["metadata"]["name"]
                with self.changed:
                    if event["type"] == "DELETED":
                        self.objects.pop(name, None)
                    else:
                        self.objects[name] = event["object"]
                    self.changed.notify_all()

    def wait(self, check: Callable[[dict[str, Any]], bool], timeout: float) -> float:
        """Block until ``check(objects)``; return when it became true (perf_counter)."""
        with self.changed:
            if not self.changed.wait_for(lambda: check(self.objects), timeout=timeout):
                raise TimeoutError(f"not reached in {timeout} s: {self.url}")
        return time.perf_counter()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """histogram_quantile: linear interpolation inside the bucket holding the q-th value."""
    total = buckets[-1][1]
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0)
        lower, below = bound, count
    return lower


def scrape(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
        text = response.read().decode()
    buckets, results = [], {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kernelcache_operator_reconcile_seconds_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
            if sample.name == "kernelcache_operator_reconciles_total":
                results[sample.labels["result"]] = int(sample.value)
    buckets.sort()
    return {"p50": quantile(buckets, 0.5), "p99": quantile(buckets, 0.99), "results": results}


def memory(pid: int) -> dict[str, float]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def write_kubeconfig(folder: Path, url: str) -> Path:
    """A kubeconfig for the emulator at ``url`` (the operator child reads it)."""
    kubeconfig = folder / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "bench",
        "clusters": [{"name": "bench", "cluster": {"server": url}}],
        "users": [{"name": "bench", "user": {"token": "bench"}}],
        "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}],
    }))  # fmt: skip
    return kubeconfig


def finish(kube: Kube, job: dict[str, Any]) -> None:
    """Play kubelet and Job controller: the warm container's result, then Complete."""
    name, arch = job["metadata"]["name"], job["metadata"]["labels"]["kernelcache.dev/arch"]
    result = {"arch": arch, "status": "published", "generation": f"g-{name}", "files": 3,
              "bytes": 9000, "seconds": 1.5, "stamp": "blake3:00"}  # fmt: skip
    terminated = {"terminated": {"exitCode": 0, "message": json.dumps(result)}}
    labels = job["spec"]["template"]["metadata"]["labels"]
    pod = {"metadata": {"name": f"{name}-p", "labels": labels},
           "status": {"containerStatuses": [{"name": "warm", "state": terminated}]}}  # fmt: skip
    kube.create(path("v1", "pods", NS), pod)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    condition = {"type": "Complete", "status": "True", "lastTransitionTime": now}
    status = {"startTime": now, "completionTime": now, "succeeded": 1, "conditions": [condition]}
    kube.patch(jobs_path(NS, name) + "/status", {"status": status})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", type=int, default=500)
    parser.add_argument("--arches", type=int, default=3, choices=range(1, len(ARCHES) + 1))
    parser.add_argument("--workers", type=int, default=16, help="operator handler threads")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    arches = ARCHES[: args.arches]
    jobs_wanted = args.caches * len(arches)

    with serving(lambda: KubernetesEmulator(keep_requests=False)) as (emulator, url):
        emulator.resources.load_bundled()
        for crd in [crd_manifest(), *peering_crds()]:
            emulator.declare(crd)
        tmp = Path(tempfile.mkdtemp(prefix="kernelcache-bench-"))
        os.environ["KUBECONFIG"] = str(write_kubeconfig(tmp, url))
        kube = Kube.from_environment()
        port = free_port()
        env = {**os.environ, "KERNELCACHE_OPERATOR_METRICS_PORT": str(port),
               "KERNELCACHE_OPERATOR_LIVENESS": "",
               "KERNELCACHE_OPERATOR_WORKERS": str(args.workers)}  # fmt: skip
        log = (tmp / "operator.log").open("w")
        child = subprocess.Popen(
            [sys.executable, "-m", "kernelcache", "operator"], env=env, stdout=log, stderr=log
        )
        try:
            deadline = time.monotonic() + 60
            while emulator.watches["kernelcaches"] < 1 or emulator.watches["jobs"] < 1:
                if child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the operator did not start; see {log.name}")
                time.sleep(0.05)
            jobs = Watch(url + jobs_path(NS))
            caches = Watch(url + kernelcache_path(NS))
            jobs.start()
            caches.start()

            start = time.perf_counter()
            for i in range(args.caches):
                kube.request("POST", kernelcache_path(NS), body=kernelcache(f"kc-{i:04d}", arches))
            created = time.perf_counter()
            all_jobs = jobs.wait(lambda o: len(o) >= jobs_wanted, args.timeout)

            def all_reporting(objects: dict[str, Any]) -> bool:
                want = f"0/{len(arches)}"
                reported = [o for o in objects.values() if o.get("status", {}).get("readyArches")]
                return len(reported) == args.caches and all(
                    o["status"]["readyArches"] == want for o in reported
                )

            all_status = caches.wait(all_reporting, args.timeout)
            before_finish = scrape(port)

            with jobs.changed:
                snapshot = list(jobs.objects.values())
            finishing = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda job: finish(kube, job), snapshot))
            finished = time.perf_counter()

            def all_ready(objects: dict[str, Any]) -> bool:
                phases = [o.get("status", {}).get("phase") for o in objects.values()]
                return len(phases) == args.caches and all(p == "Ready" for p in phases)

            all_ready_at = caches.wait(all_ready, args.timeout)
            after = scrape(port)
            rss = memory(child.pid)
        finally:
            child.send_signal(signal.SIGTERM)
            child.wait(timeout=30)

    print(f"{args.caches} KernelCaches x {len(arches)} arches = {jobs_wanted} compile Jobs, "
          f"{args.workers} handler threads")  # fmt: skip
    rows = [
        ("create all KernelCaches (client)", created - start),
        ("until every Job exists", all_jobs - start),
        ("until every status reports 0/A", all_status - start),
        ("finish every Job (client)", finished - finishing),
        ("until every KernelCache is Ready", all_ready_at - finishing),
    ]
    for label, seconds in rows:
        print(f"  {label:<36} {seconds:8.2f} s")
    print(f"  reconcile p50 / p99 (create phase)   {before_finish['p50'] * 1e3:8.1f} / "
          f"{before_finish['p99'] * 1e3:.1f} ms")  # fmt: skip
    print(f"  reconcile p50 / p99 (whole run)      {after['p50'] * 1e3:8.1f} / "
          f"{after['p99'] * 1e3:.1f} ms")  # fmt: skip
    print(f"  reconciles by result                 {after['results']}")
    print(f"  operator RSS now / peak              {rss['VmRSS']:8.1f} / {rss['VmHWM']:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
