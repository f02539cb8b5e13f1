"""The operator SIGKILLed mid-reconcile: it converges without a duplicate Job.

``make test`` kills it 14 times, once at each point a kill can land (each of a new
KernelCache's 7 writes, before or after it is applied), in a seeded order; the 50 seeded
kills of the scale case are marked ``large`` (``make test-all``, CI's nightly run).

The real operator (``kernelcache operator``, a child process) runs against the emulated
Kubernetes API server of ``k8s_emulator``; the test plays the Job controller and the kubelet,
each Job ending as the seed decides, so every KernelCache's end state is known in advance
(``tests/helpers/chaos.py``). ``KERNELCACHE_CHAOS_SEED`` replaces the seed; every failure
message names it.
"""

from __future__ import annotations

import os
import random
import signal
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("kopf", reason="needs kernelcache[operator]")
pytest.importorskip("kmock", reason="needs kmock (the Kubernetes API emulator)")

from kmock import Request, action

from kernelcache.controller.kube import Kube, jobs_path, kernelcache_path
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
    finished,
    succeeds,
)
from tests.operator_process import ApiHarness, api_harness, finish_job

pytestmark = pytest.mark.slow

# Fast clocks: a reconcile at least every second, a failed attempt retried at once.
FAST = {"RESYNC_SECONDS": "1", "RETRY_BACKOFF_SECONDS": "0", "RETRY_BACKOFF_MAX_SECONDS": "0"}
# What a reconcile writes (kopf's own peering keep-alives and Events are not counted).
RECONCILED = {"jobs", "kernelcaches", "persistentvolumeclaims", "configmaps"}


# --------------------------------------------------------------------------- killed mid-reconcile


@dataclass
class KillSwitch:
    """SIGKILLs the running operator at its n-th write of what it reconciles.

    Before the write is served (the request is lost, as when a process dies mid-send) or
    after it is applied but before the answer reaches the operator (it never learns that
    its Job, claim or status write happened).
    """

    api: ApiHarness
    countdown: int = 0
    after_applying: bool = False
    killed: list[str] = field(default_factory=list)  # what each kill interrupted
    _dead: set[str] = field(default_factory=set)

    def arm(self, countdown: int, after_applying: bool) -> None:
        self.countdown, self.after_applying = countdown, after_applying

    def _due(self, request: Request, token: str) -> bool:
        resource = request.resource
        if (
            self.countdown <= 0
            or token not in self.api.operators
            or token in self._dead
            or request.action not in (action.CREATE, action.UPDATE, action.DELETE)
            or resource is None
            or resource.plural not in RECONCILED
        ):
            return False
        self.countdown -= 1
        if self.countdown:
            return False
        self._dead.add(token)
        when = "after" if self.after_applying else "before"
        sub = f"/{request.subresource}" if request.subresource else ""
        self.killed.append(f"{when} {request.method.value} {resource.plural}{sub}")  # first:
        os.kill(self.api.operators[token].process.pid, signal.SIGKILL)  # the test wakes now
        return True

    def before(self, request: Request, token: str) -> bool:
        return self.after_applying or not self._due(request, token)

    def after(self, request: Request, token: str) -> None:
        if self.after_applying:
            self._due(request, token)


def finish_some(kube: Kube, rng: random.Random, seed: int, share: float) -> int:
    """Finish each unfinished Job with probability ``share``; its outcome is the seed's."""
    done = 0
    for job in kube.list(jobs_path(NS)):
        if not finished(job) and rng.random() < share:
            finish_job(kube, job, succeeded=succeeds(seed, job["metadata"]["name"]))
            done += 1
    return done


# A new KernelCache alone makes 7 such writes: finalizer, claim, ConfigMap, two Jobs, status,
# kopf's progress annotation. A kill lands before one is served or after it is applied.
KILL_POINTS = [(write, after) for write in range(1, 8) for after in (False, True)]
MAX_ATTEMPTS = 3


def kill_points(rng: random.Random, kills: int) -> list[tuple[int, bool]]:
    """Where each round's kill lands: every point of ``KILL_POINTS`` once, in a seeded order,
    then seeded points at random."""
    points = rng.sample(KILL_POINTS, len(KILL_POINTS))
    extra = [(rng.randint(1, 7), rng.random() < 0.5) for _ in range(kills - len(points))]
    return [*points, *extra][:kills]


@pytest.mark.parametrize("kills", [len(KILL_POINTS), pytest.param(50, marks=pytest.mark.large)])
def test_operator_killed_mid_reconcile_converges_without_duplicate_jobs(
    tmp_path: Path, kills: int
) -> None:
    """SIGKILLs at seeded points of reconciling (a new KernelCache each round, Jobs ending while
    the operator is down and while it runs); one more start then settles everything."""
    rng = random.Random(SEED)
    settings = {**FAST, "MAX_ATTEMPTS": str(MAX_ATTEMPTS)}
    caches: dict[str, Expected] = {}
    with api_harness(tmp_path) as api:
        switch = KillSwitch(api)
        api.emulator.before, api.emulator.after = switch.before, switch.after
        for round_, (write, after_applying) in enumerate(kill_points(rng, kills)):
            body = kernelcache_doc(f"kc-{round_:02d}", NS, ARCHES)
            body = api.kube.request("POST", kernelcache_path(NS), body=body)  # with its uid
            caches[body["metadata"]["name"]] = expected(SEED, body, MAX_ATTEMPTS)
            finish_some(api.kube, rng, SEED, share=0.3)
            switch.arm(write, after_applying)
            # Each start outranks the dead replicas still listed in the peering object.
            operator = api.start_operator(**settings, PRIORITY=str(round_ + 1))
            finish_some(api.kube, rng, SEED, share=0.3)
            returncode = operator.process.wait(timeout=scaled(60))
            assert returncode == -signal.SIGKILL and len(switch.killed) == round_ + 1, (
                f"round {round_}: the operator was not killed at write {write} "
                f"(seed {SEED}): {operator.tail()}"
            )

        operator = api.start_operator(**settings, PRIORITY=str(kills + 1))
        wait_until(
            lambda: (
                finish_some(api.kube, rng, SEED, share=1.0) == 0
                and all_settled(api.kube, len(caches))
            ),
            timeout=scaled(90),
            what=f"every KernelCache to settle (seed {SEED})",
        )
        operator.stop()
        phases = assert_converged(api.kube, caches, MAX_ATTEMPTS, SEED)
    print(
        f"seed {SEED}: {len(switch.killed)} kills {dict(Counter(switch.killed))}; "
        f"{len(caches)} KernelCaches {dict(phases)}; arches {dict(arch_outcomes(caches))}"
    )
