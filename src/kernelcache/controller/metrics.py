"""The operator's own Prometheus metrics, in a registry of their own.

Handlers record into this module (counters, histograms and a table of each KernelCache's
phase and published generation per arch); the phase and generation gauges are built from
that table when Prometheus scrapes, so a deleted KernelCache simply stops being counted.
The HTTP endpoint starts only when the operator does (never on import, so never under unit
tests).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PHASES = ("Pending", "Compiling", "Ready", "Failed", "Degraded")

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    "kernelcache_operator_reconciles",
    "KernelCache reconciles by result: ok, invalid (spec), gone, deleting, conflict, error.",
    ["result"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "kernelcache_operator_reconcile_seconds",
    "Time one reconcile of a KernelCache took, API calls included.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
COMPILE_JOB_SECONDS = Histogram(
    "kernelcache_operator_compile_job_seconds",
    "Run time of finished compile Jobs, from start to completion or failure.",
    ["arch", "result"],
    buckets=(30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400),
    registry=REGISTRY,
)

_phases: dict[str, str] = {}
_generations: dict[str, dict[str, str]] = {}  # namespace/name -> arch -> generation
_lock = threading.Lock()


def set_phase(key: str, phase: str | None) -> None:
    """Record the phase of the KernelCache ``namespace/name`` (None: not known yet)."""
    with _lock:
        if phase is None:
            _phases.pop(key, None)
        else:
            _phases[key] = phase


def set_generations(key: str, generations: dict[str, str]) -> None:
    """Record the generation each arch of ``namespace/name`` has published (its status)."""
    with _lock:
        _generations[key] = dict(generations)


def forget(key: str) -> None:
    set_phase(key, None)
    with _lock:
        _generations.pop(key, None)


class _PhaseCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        with _lock:
            phases = list(_phases.values())
            generations = {key: dict(arches) for key, arches in _generations.items()}
        family = GaugeMetricFamily(
            "kernelcache_operator_kernelcaches",
            "KernelCaches this operator reconciles, by phase.",
            labels=["phase"],
        )
        for phase in PHASES:
            family.add_metric([phase], phases.count(phase))
        yield family
        info = GaugeMetricFamily(
            "kernelcache_operator_generation_info",
            "The generation each arch of a KernelCache has published (always 1).",
            labels=["namespace", "name", "arch", "generation"],
        )
        for key, arches in sorted(generations.items()):
            namespace, _, name = key.partition("/")
            for arch, generation in sorted(arches.items()):
                info.add_metric([namespace, name, arch, generation], 1)
        yield info


REGISTRY.register(_PhaseCollector())


def reconciles_total() -> float:
    """All reconciles so far (the liveness probe reports it)."""
    return sum(
        s.value for m in RECONCILES.collect() for s in m.samples if s.name.endswith("_total")
    )


def serve(port: int) -> None:
    """Expose the registry at http://0.0.0.0:<port>/metrics from a daemon thread."""
    start_http_server(port, registry=REGISTRY)
