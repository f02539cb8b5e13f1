"""Hundreds of KernelCaches, every compile Job succeeding or failing at random as soon as it
exists: each ends in the phase its seed predicts.

``make test`` runs 100 of them: every phase and every retry path is met many times over (the
assertions are about correctness, each object checked whole); the 500 of the scale case are
marked ``large`` (``make test-all``, CI's nightly run).

The real operator (``kernelcache operator``, a child process) runs against the emulated
Kubernetes API server of ``k8s_emulator``; the test plays the Job controller and the kubelet
(``tests/helpers/chaos.py``: the seeded outcomes and the end state they imply).
``KERNELCACHE_CHAOS_SEED`` replaces the seed; every failure message names it.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kopf", reason="needs kernelcache[operator]")
pytest.importorskip("kmock", reason="needs kmock (the Kubernetes API emulator)")

from kmock import Request, action

from kernelcache.controller.kube import Kube, kernelcache_path
from tests.conftest import kernelcache_doc, scaled, wait_until
from tests.helpers.chaos import (
    ARCHES,
    NS,
    SEED,
    Expected,
    all_settled,
    arch_outcomes,
    assert_converged,
    expected,
    succeeds,
)
from tests.operator_process import api_harness, finish_job

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- 500 at random


class JobController:
    """Ends every compile Job as soon as it is created, as the seed decides (threads)."""

    def __init__(self, kube: Kube, seed: int, threads: int = 4) -> None:
        self.kube, self.seed = kube, seed
        self.created: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: set[str] = set()
        self.outcomes: Counter[str] = Counter()
        self.errors: list[Exception] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def after(self, request: Request, token: str) -> None:
        """The emulator's hook: a Job the operator created (or tried to create again)."""
        resource = request.resource
        if request.action == action.CREATE and resource is not None and resource.plural == "jobs":
            self.created.put(request.data)

    def _run(self) -> None:
        while (job := self.created.get()) is not None:
            name = job["metadata"]["name"]
            with self._lock:
                if name in self.seen:
                    continue
                self.seen.add(name)
            ok = succeeds(self.seed, name)
            try:
                finish_job(self.kube, job, succeeded=ok)
            except Exception as exc:  # reported by the test, not lost in a thread
                self.errors.append(exc)
            with self._lock:
                self.outcomes["succeeded" if ok else "failed"] += 1

    @contextmanager
    def running(self) -> Iterator[None]:
        for thread in self._threads:
            thread.start()
        try:
            yield
        finally:
            for _ in self._threads:
                self.created.put(None)
            for thread in self._threads:
                thread.join(timeout=scaled(30))


SCALE_ATTEMPTS = 2


@pytest.mark.parametrize("count", [100, pytest.param(500, marks=pytest.mark.large)])
def test_kernelcaches_with_random_job_outcomes_end_in_the_right_phase(
    tmp_path: Path, count: int
) -> None:
    """KernelCaches of one or two arches (seeded); every Job succeeds or fails by the seed as
    soon as it exists, a failed attempt is retried once; every object must end exactly as
    predicted."""
    settings = {"RESYNC_SECONDS": "60", "RETRY_BACKOFF_SECONDS": "0",
                "RETRY_BACKOFF_MAX_SECONDS": "0", "MAX_ATTEMPTS": str(SCALE_ATTEMPTS)}  # fmt: skip
    caches: dict[str, Expected] = {}
    started = time.monotonic()
    with api_harness(tmp_path) as api:
        controller = JobController(api.kube, SEED)
        api.emulator.after = controller.after
        operator = api.start_operator(**settings)
        with controller.running():
            rng = random.Random(SEED)
            for i in range(count):
                body = kernelcache_doc(f"kc-{i:03d}", NS, ARCHES[: rng.randint(1, len(ARCHES))])
                body = api.kube.request("POST", kernelcache_path(NS), body=body)
                caches[body["metadata"]["name"]] = expected(SEED, body, SCALE_ATTEMPTS)
            wait_until(
                lambda: controller.errors or all_settled(api.kube, count),
                timeout=scaled(240),
                what=f"every KernelCache to settle (seed {SEED})",
                interval=1.0,  # a list of hundreds of KernelCaches is no small request
            )
            assert not controller.errors, controller.errors[0]
        operator.stop()
        phases = assert_converged(api.kube, caches, SCALE_ATTEMPTS, SEED)
    assert set(phases) == {"Ready", "Degraded", "Failed"}, phases
    print(
        f"seed {SEED}: {count} KernelCaches {dict(phases)}; arches "
        f"{dict(arch_outcomes(caches))}; Jobs {dict(controller.outcomes)}; "
        f"{time.monotonic() - started:.0f} s"
    )
