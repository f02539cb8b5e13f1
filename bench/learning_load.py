"""Learning from hostile serving pods at scale: admission and reconcile latency under load.

Serves the emulator of ``tests/k8s_emulator.py`` in this process and runs the real operator
(``kernelcache operator``) as a child process pointed at it, with its admission webhook on
HTTPS (a certificate made here with openssl) and a short resync. It creates N KernelCaches,
each with one ready serving pod whose metrics port is a server of this process: 90% answer a
learned record, 10% are hostile in turn:

- slow: headers, then one byte every 0.5 s (a minute of body);
- huge: a 2 MiB record;
- redirecting: a 302 to an internal URL.

While the operator resyncs them all, a client sends labelled-pod admission reviews to the
webhook, a few at a time, and records each answer's latency. Reported: admission p50 / p99 /
max (client side), the operator's reconcile p50 / p99 (its own histogram), how long until
every KernelCache had a status and every honest one its learned keys, and that no hostile
key reached a status.

    python bench/learning_load.py [--caches 200] [--hostile 0.1] [--reviews 400]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.operator_scale import Watch, free_port, kernelcache, scrape, write_kubeconfig  # noqa: E402
from tests.k8s_emulator import KubernetesEmulator, admission_review, serving  # noqa: E402

from kernelcache import learned  # noqa: E402
from kernelcache.contract import LABEL_CACHE, PORT_METRICS  # noqa: E402
from kernelcache.controller.kube import Kube, kernelcache_path, path  # noqa: E402
from kernelcache.controller.manifests import peering_crds  # noqa: E402
from kernelcache.crd import crd_manifest  # noqa: E402
from kernelcache.spec import LearnedKey  # noqa: E402

NS = "bench"
HONEST = json.dumps(
    learned.document([LearnedKey(toolchain="vllm", kernel="fused_moe_kernel", tokens=41)], 0)
).encode()
KINDS = ("slow", "huge", "redirecting")


class Pods(BaseHTTPRequestHandler):
    """Every pod's metrics port: the path's first segment says which kind it plays."""

    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        kind = self.server.kind  # type: ignore[attr-defined]
        try:
            if kind == "slow":
                self._head(60)
                for _ in range(60):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.5)
            elif kind == "huge":
                body = b'{"keys": [' + b" " * (2 << 20) + b"]}"
                self._head(len(body))
                self.wfile.write(body)
            elif kind == "redirecting":
                self.send_response(302)
                self.send_header("Location", "http://10.0.0.1/api/v1/secrets")
                self.end_headers()
            else:
                self._head(len(HONEST))
                self.wfile.write(HONEST)
        except OSError:
            pass  # the operator hung up on it: what it should do

    def _head(self, length: int) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


def pod_server(kind: str) -> int:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Pods)
    server.daemon_threads = True
    server.kind = kind  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return int(server.server_address[1])


def serving_pod(name: str, cache: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {LABEL_CACHE: cache}},
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "image": "ghcr.io/kernelcache/examples:0.1.0",
                    "ports": [{"name": PORT_METRICS, "containerPort": port}],
                }
            ]
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def certificate(folder: Path) -> None:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(folder / "tls.key"), "-out", str(folder / "tls.crt")],
        check=True, capture_output=True,
    )  # fmt: skip


def review(port: int, context: ssl.SSLContext, i: int, cache: str) -> float | None:
    """One labelled pod's admission review: its latency (s), None when it was refused or
    not answered within the API server's 10 s webhook timeout."""
    pod = serving_pod(f"new-{i}", cache, 9400)
    del pod["status"]
    body = admission_review(
        pod,
        {"group": "", "version": "v1", "kind": "Pod"},
        {"group": "", "version": "v1", "resource": "pods"},
        NS,
        ("kubernetes-admin", ["system:masters"]),
    )
    request = urllib.request.Request(
        f"https://127.0.0.1:{port}/inject",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as answer:
            response = json.load(answer)["response"]
    except OSError:  # the API server's default webhook timeout is 10 s: the pod is refused
        return None
    took = time.perf_counter() - started
    return took if response.get("allowed") else None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", type=int, default=200)
    parser.add_argument("--hostile", type=float, default=0.1, help="share of hostile pods")
    parser.add_argument("--reviews", type=int, default=400, help="admission reviews sent")
    parser.add_argument("--concurrency", type=int, default=4, help="reviews in flight")
    parser.add_argument("--workers", type=int, default=16, help="operator handler threads")
    parser.add_argument("--resync", type=float, default=5.0, help="operator resync seconds")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help="the hostile kinds, taken in turn (slow,huge,...)"
    )
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    kinds_used = tuple(k for k in args.kinds.split(",") if k)
    if not kinds_used or set(kinds_used) - set(KINDS):
        parser.error(f"--kinds: a comma-separated list of {', '.join(KINDS)}")
    hostile = round(args.caches * args.hostile)
    ports = {kind: pod_server(kind) for kind in ("honest", *KINDS)}

    with serving(lambda: KubernetesEmulator(keep_requests=False)) as (emulator, url):
        emulator.resources.load_bundled()
        for crd in [crd_manifest(), *peering_crds()]:
            emulator.declare(crd)
        tmp = Path(tempfile.mkdtemp(prefix="kernelcache-bench-"))
        certificate(tmp)
        os.environ["KUBECONFIG"] = str(write_kubeconfig(tmp, url))
        kube = Kube.from_environment()
        names = [f"kc-{i:04d}" for i in range(args.caches)]
        kinds = {
            name: kinds_used[i % len(kinds_used)] if i < hostile else "honest"
            for i, name in enumerate(names)
        }
        for name in names:
            kube.create(path("v1", "pods", NS), serving_pod(f"{name}-0", name, ports[kinds[name]]))
        metrics_port, webhook_port = free_port(), free_port()
        env = {**os.environ, "KERNELCACHE_OPERATOR_METRICS_PORT": str(metrics_port),
               "KERNELCACHE_OPERATOR_LIVENESS": "",
               "KERNELCACHE_OPERATOR_WORKERS": str(args.workers),
               "KERNELCACHE_OPERATOR_RESYNC_SECONDS": str(args.resync),
               "KERNELCACHE_OPERATOR_WEBHOOK_PORT": str(webhook_port),
               "KERNELCACHE_OPERATOR_WEBHOOK_TLS_DIR": str(tmp)}  # fmt: skip
        log = (tmp / "operator.log").open("w")
        child = subprocess.Popen(
            [sys.executable, "-m", "kernelcache", "operator"], env=env, stdout=log, stderr=log
        )
        context = ssl.create_default_context(cafile=str(tmp / "tls.crt"))
        try:
            deadline = time.monotonic() + 60
            while emulator.watches["kernelcaches"] < 1:
                if child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the operator did not start; see {log.name}")
                time.sleep(0.05)
            caches = Watch(url + kernelcache_path(NS))
            caches.start()
            start = time.perf_counter()
            for name in names:
                kube.request("POST", kernelcache_path(NS), body=kernelcache(name, ["sm_90a"]))

            def statused(objects: dict[str, Any]) -> bool:
                return sum(
                    bool(o.get("status", {}).get("arches")) for o in objects.values()
                ) == len(names)

            all_status = caches.wait(statused, args.timeout)

            def learned_all(objects: dict[str, Any]) -> bool:
                honest = [o for n, o in objects.items() if kinds[n] == "honest"]
                return len(honest) == len(names) - hostile and all(
                    (o.get("status", {}).get("learned") or {}).get("keys") for o in honest
                )

            all_learned = caches.wait(learned_all, args.timeout)
            # Admission while resyncs keep reading the hostile pods (each resync meets them).
            with ThreadPoolExecutor(args.concurrency) as pool:
                answers = list(
                    pool.map(
                        lambda i: review(webhook_port, context, i, names[i % len(names)]),
                        range(args.reviews),
                    )
                )
            latencies = [a for a in answers if a is not None]
            time.sleep(2 * args.resync)  # let more resyncs run with the hostile pods
            metrics = scrape(metrics_port)
            with caches.changed:
                statuses = {n: o.get("status", {}) for n, o in caches.objects.items()}
        finally:
            child.send_signal(signal.SIGTERM)
            try:
                stopped: str = f"{child.wait(timeout=30)}"
            except subprocess.TimeoutExpired:  # a worker still held by a pod
                child.kill()
                stopped = "not within 30 s of SIGTERM: killed"
    leaked = [
        n for n, s in statuses.items()
        if kinds[n] != "honest" and (s.get("learned") or {}).get("keys")
    ]  # fmt: skip
    print(f"{args.caches} KernelCaches, {hostile} hostile pods ({', '.join(kinds_used)}), "
          f"{args.workers} handler threads, resync {args.resync:g} s")  # fmt: skip
    rows = [
        ("until every KernelCache has a status", f"{all_status - start:8.2f} s"),
        ("until every honest pod's keys are in", f"{all_learned - start:8.2f} s"),
        ("admission p50 / p99 / max",
         f"{percentile(latencies, 0.5) * 1e3:8.1f} / {percentile(latencies, 0.99) * 1e3:.1f} / "
         f"{max(latencies) * 1e3:.1f} ms ({len(answers)} reviews, {args.concurrency} at once)"
         if latencies else "none answered"),
        ("admission refused or timed out", f"{len(answers) - len(latencies)}"),
        ("reconcile p50 / p99",
         f"{metrics['p50'] * 1e3:8.1f} / {metrics['p99'] * 1e3:.1f} ms"),
        ("reconciles by result", str(metrics["results"])),
        ("hostile keys in any status", str(len(leaked))),
        ("operator exit after SIGTERM", stopped),
    ]  # fmt: skip
    for label, value in rows:
        print(f"  {label:<38} {value}")
    return 0 if not leaked and len(latencies) == len(answers) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Handler threads of the hostile pods' servers may still be writing into sockets the
    # operator closed: the measurements are printed, so do not wait for them.
    os._exit(code)
