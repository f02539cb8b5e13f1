"""What a serving process compiled and what it took from the cache, as Prometheus metrics.

The toolchain hooks record into this module's own registry (never prometheus-client's global
one, so an engine's metrics and ours cannot collide or be exported twice), and the registry is
rendered only when it is scraped. Nothing listens unless ``serve_metrics`` is called: importing
this module, and every unit test, opens no port.

Series (``toolchain`` is one of ``TOOLCHAINS``):

- ``kernelcache_cold_compiles_total{toolchain,kernel}``: compiles the cache did not spare.
  Strict mode's refusals count too: the kernel was needed and was not in the cache.
- ``kernelcache_compile_seconds{toolchain}``: a histogram of the compiles that did run.
- ``kernelcache_cache_hits_total{toolchain}``: kernels (or graphs, or modules) the cache gave.
- ``kernelcache_generation_info{name,arch,generation,stamp}``: 1 for the generation in use.
- ``kernelcache_stamp_mismatch``: 1 when the generation was stamped for another environment.
- ``kernelcache_dropped_artifacts_total{toolchain,reason}``: artifacts of the generation that
  could not be used (a Mega-Cache this torch refuses, say).
- ``kernelcache_vllm_jit_events_total{backend,kernel}``: what vLLM's own JIT monitor saw after
  its warm-up: a kernel first loaded into the process while serving, compiled or not.
- ``kernelcache_verify_failures_total{reason}``: the generation failed its check at start
  (``reason``: the failure class, e.g. ``stamp_mismatch``, ``missing_generation``); the
  process then serves without it, or with it but missing where the stamp differs.

The per-toolchain hit and histogram series exist at zero from the start, so the first event
already shows up in ``rate()`` and ``increase()``. A per-kernel series is born with its first
compile; the alert rules account for that (``prometheus/kernelcache-rules.yaml``).

A label never holds a specialization (a token count, a hash): each compile's full key goes to
``runtime.learning``, served as JSON at ``learned.PATH`` by the same server, for the next build.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import (
    ThreadingWSGIServer,
    _get_best_family,
    _SilentHandler,
    make_wsgi_app,
)

from kernelcache import learned
from kernelcache.runtime import learning

log = logging.getLogger(__name__)

TOOLCHAINS = ("cute-dsl", "triton", "inductor", "flashinfer")
# A kernel label is a function or module name; anything longer is a bug upstream, not a name.
_MAX_KERNEL_LABEL = 200

REGISTRY = CollectorRegistry(auto_describe=True)

COLD_COMPILES = Counter(
    "kernelcache_cold_compiles",
    "Compiles in this process that the cache did not spare (refused ones in strict mode too).",
    ["toolchain", "kernel"],
    registry=REGISTRY,
)
COMPILE_SECONDS = Histogram(
    "kernelcache_compile_seconds",
    "Seconds spent in compiles that ran in this process.",
    ["toolchain"],
    # From a small cute.compile (~0.5 s) to a FlashInfer nvcc module or an autotuned graph.
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320),
    registry=REGISTRY,
)
CACHE_HITS = Counter(
    "kernelcache_cache_hits",
    "Kernels, graphs or modules this process took from the cache instead of compiling.",
    ["toolchain"],
    registry=REGISTRY,
)
GENERATION_INFO = Gauge(
    "kernelcache_generation_info",
    "The cache generation this process serves from (always 1).",
    ["name", "arch", "generation", "stamp"],
    registry=REGISTRY,
)
STAMP_MISMATCH = Gauge(
    "kernelcache_stamp_mismatch",
    "1 when the generation's stamp differs from this environment (the caches will mostly miss).",
    registry=REGISTRY,
)
DROPPED_ARTIFACTS = Counter(
    "kernelcache_dropped_artifacts",
    "Artifacts of the generation this process could not use.",
    ["toolchain", "reason"],
    registry=REGISTRY,
)

VLLM_JIT_EVENTS = Counter(
    "kernelcache_vllm_jit_events",
    "Kernels vLLM's JIT monitor saw loaded or compiled after its warm-up (a latency spike).",
    ["backend", "kernel"],
    registry=REGISTRY,
)
VERIFY_FAILURES = Counter(
    "kernelcache_verify_failures",
    "Times the generation failed its check at start in this process, by failure class.",
    ["reason"],
    registry=REGISTRY,
)

for _toolchain in TOOLCHAINS:
    CACHE_HITS.labels(_toolchain)
    COMPILE_SECONDS.labels(_toolchain)


def record_compile(
    toolchain: str, kernel: str, seconds: float | None, count: int = 1, key: str | None = None
) -> None:
    """A compile the cache did not spare; ``seconds`` is None when strict mode refused it;
    ``key``: its specialization (Triton's hash), kept for the next build, never a label."""
    kernel = kernel[:_MAX_KERNEL_LABEL]
    COLD_COMPILES.labels(toolchain, kernel).inc(count)
    learning.note(toolchain, kernel, key)
    if seconds is None:
        log.warning("kernelcache: %s kernel %s not in the cache: refused", toolchain, kernel)
        return
    COMPILE_SECONDS.labels(toolchain).observe(seconds)
    log.warning(
        "kernelcache: cold compile in serving: %s kernel %s (%.2f s)", toolchain, kernel, seconds
    )


def record_compile_elsewhere(toolchain: str, kernel: str) -> None:
    """A compile seen only by its output, made by another process sharing the cache."""
    kernel = kernel[:_MAX_KERNEL_LABEL]
    COLD_COMPILES.labels(toolchain, kernel).inc()
    learning.note(toolchain, kernel)
    log.warning(
        "kernelcache: cold compile in another process sharing the cache: %s kernel %s",
        toolchain,
        kernel,
    )


def record_hit(toolchain: str, count: int = 1) -> None:
    CACHE_HITS.labels(toolchain).inc(count)


def record_dropped(toolchain: str, reason: str) -> None:
    DROPPED_ARTIFACTS.labels(toolchain, reason).inc()


def record_verify_failure(reason: str) -> None:
    VERIFY_FAILURES.labels(reason).inc()


def set_generation(name: str, arch: str, generation: str, stamp: str, mismatch: bool) -> None:
    GENERATION_INFO.labels(name, arch, generation, stamp).set(1)
    learning.serving(name, arch, generation)
    STAMP_MISMATCH.set(1 if mismatch else 0)


def cold_compiles() -> dict[tuple[str, str], float]:
    """``kernelcache_cold_compiles_total`` of this process by (toolchain, kernel)."""
    return {
        (sample.labels["toolchain"], sample.labels["kernel"]): sample.value
        for family in REGISTRY.collect()
        if family.name == "kernelcache_cold_compiles"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def record_vllm_jit_event(backend: str, kernel: str, tokens: int | None = None) -> None:
    """A monitor event; ``tokens`` (the forward's) is kept for the next build, never a label."""
    VLLM_JIT_EVENTS.labels(backend, kernel[:_MAX_KERNEL_LABEL]).inc()
    learning.note("vllm", kernel, tokens=tokens)


def compile_seconds() -> dict[str, float]:
    """Seconds of the compiles that ran in this process, by toolchain."""
    return {
        sample.labels["toolchain"]: sample.value
        for family in REGISTRY.collect()
        if family.name == "kernelcache_compile_seconds"
        for sample in family.samples
        if sample.name.endswith("_sum")
    }


def render() -> bytes:
    """The text exposition of every series, as a scrape would read it."""
    return generate_latest(REGISTRY)


Respond = Callable[[str, list[tuple[str, str]]], Any]


def _app(metrics_app: Any) -> Callable[[dict[str, Any], Respond], Iterable[bytes]]:
    """``learned.PATH``: this process's learned record as JSON; any other path: the metrics."""

    def app(environ: dict[str, Any], respond: Respond) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != learned.PATH:
            return metrics_app(environ, respond)
        body = json.dumps(learning.record()).encode()
        respond(
            "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        )
        return [body]

    return app


def serve_metrics(port: int, address: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` and ``learned.PATH`` from a daemon thread; the bound port
    (``port=0``: any free one)."""

    class Server(ThreadingWSGIServer):
        """prometheus-client's own server, of the address's family (IPv6 too)."""

    Server.address_family, address = _get_best_family(address, port)
    app = _app(make_wsgi_app(REGISTRY))
    server = make_server(address, port, app, Server, handler_class=_SilentHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return int(server.server_port)
