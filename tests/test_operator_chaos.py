"""The operator under faults: SIGKILLed mid-reconcile, and hundreds of Jobs failing at random.

The real operator (``kernelcache operator``, a child process) runs against the emulated
Kubernetes API server of ``k8s_emulator`` (a test double: no API server can run here). The
test plays the Job controller and the kubelet: every compile Job it sees succeeds or fails
as a seeded coin decides from the Job's name, so the expected end state of every
KernelCache is known in advance:

- per arch, attempts 0, 1, ... run until one succeeds or ``max_attempts`` failed; the arch
  is then Ready (with the generation the succeeded Job published) or Failed ("gave up");
- the KernelCache is Ready when every arch is, Failed when every arch failed, else Degraded;
- exactly the Jobs of those attempts exist, one per (KernelCache, arch, spec digest,
  attempt), named as ``manifests.job_name`` names them: no restart made a second one.

``KERNELCACHE_CHAOS_SEED`` replaces the seed; every failure message names it.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kopf", reason="needs kernelcache[operator]")
pytest.importorskip("kmock", reason="needs kmock (the Kubernetes API emulator)")

from kmock import Request, action

from kernelcache.controller import state
from kernelcache.controller.kube import Kube, jobs_path, kernelcache_path
from kernelcache.controller.manifests import (
    LABEL_ARCH,
    LABEL_ATTEMPT,
    LABEL_CACHE_UID,
    LABEL_DIGEST,
    job_name,
    spec_digest,
)
from kernelcache.spec import parse_kernelcache
from tests.conftest import kernelcache_doc, scaled, wait_until
from tests.operator_process import ApiHarness, api_harness, finish_job, result_generation

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("KERNELCACHE_CHAOS_SEED", "20261130"))
NS = "chaos"
ARCHES = ("sm_90a", "sm_120a")
# Fast clocks: a reconcile at least every second, a failed attempt retried at once.
FAST = {"RESYNC_SECONDS": "1", "RETRY_BACKOFF_SECONDS": "0", "RETRY_BACKOFF_MAX_SECONDS": "0"}
# What a reconcile writes (kopf's own peering keep-alives and Events are not counted).
RECONCILED = {"jobs", "kernelcaches", "persistentvolumeclaims", "configmaps"}


def succeeds(seed: int, job: str) -> bool:
    """The seeded outcome of one compile Job, by name: the same in every run of a seed."""
    return random.Random(f"{seed}/{job}").random() < 0.45


def finished(job: dict[str, Any]) -> bool:
    return state.job_state(job) in ("Succeeded", "Failed")


@dataclass(frozen=True)
class Expected:
    """What one KernelCache must end as: its Jobs' names and each arch's phase."""

    jobs: frozenset[str]
    arches: dict[str, str]  # arch -> Ready | Failed
    generations: dict[str, str]  # arch -> the generation its succeeded Job published
    attempts: dict[str, int]  # arch -> how many Jobs it runs

    @property
    def phase(self) -> str:
        phases = set(self.arches.values())
        return phases.pop() if len(phases) == 1 else "Degraded"


def expected(seed: int, body: dict[str, Any], max_attempts: int) -> Expected:
    kc = parse_kernelcache(body, "expected")
    digest, name = spec_digest(kc), kc.metadata.name
    jobs, arches, generations, attempts = set(), {}, {}, {}
    for arch in kc.spec.arches():
        arches[arch] = "Failed"
        for attempt in range(max_attempts):
            job = job_name(name, arch, digest, attempt)
            jobs.add(job)
            attempts[arch] = attempt + 1
            if succeeds(seed, job):
                arches[arch], generations[arch] = "Ready", result_generation(job)
                break
    return Expected(frozenset(jobs), arches, generations, attempts)


def caches_by_name(kube: Kube) -> dict[str, dict[str, Any]]:
    return {kc["metadata"]["name"]: kc for kc in kube.list(kernelcache_path(NS))}


def settled(kc: dict[str, Any]) -> bool:
    """The status is of the current spec, every arch is final and nothing is in progress."""
    status = kc.get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    return (
        status.get("observedGeneration") == kc["metadata"]["generation"]
        and conditions.get("Progressing") == "False"
        and all(a["phase"] in ("Ready", "Failed") for a in status.get("arches") or [])
    )


def all_settled(kube: Kube, count: int) -> bool:
    caches = caches_by_name(kube).values()
    return len(caches) == count and all(settled(kc) for kc in caches)


def assert_converged(
    kube: Kube, caches: dict[str, Expected], max_attempts: int, seed: int
) -> Counter[str]:
    """Every KernelCache's status and Jobs are what the seed says; returns the phase counts."""
    where = f"(seed {seed})"
    jobs = kube.list(jobs_path(NS))
    identities = Counter(
        tuple(
            j["metadata"]["labels"][k]
            for k in (LABEL_CACHE_UID, LABEL_ARCH, LABEL_DIGEST, LABEL_ATTEMPT)
        )
        for j in jobs
    )
    duplicated = {k: n for k, n in identities.items() if n > 1}
    assert not duplicated, (
        f"more than one Job per (cache, arch, digest, attempt) {where}: {duplicated}"
    )
    by_cache: dict[str, set[str]] = {}
    for job in jobs:
        assert finished(job), f"{job['metadata']['name']} never finished {where}"
        cache = job["metadata"]["annotations"]["kernelcache.dev/cache"]
        by_cache.setdefault(cache, set()).add(job["metadata"]["name"])
    phases: Counter[str] = Counter()
    for name, kc in caches_by_name(kube).items():
        want = caches[name]
        status = kc.get("status") or {}
        assert by_cache.get(name, set()) == want.jobs, f"{name}: Jobs {where}"
        assert status.get("phase") == want.phase, f"{name}: {status} {where}"
        assert status.get("observedGeneration") == kc["metadata"]["generation"], name
        ready = sum(p == "Ready" for p in want.arches.values())
        assert status.get("readyArches") == f"{ready}/{len(want.arches)}", f"{name} {where}"
        conditions = {c["type"]: c["status"] for c in status["conditions"]}
        assert conditions == {
            "Ready": str(want.phase == "Ready"),
            "Progressing": "False",
            "Degraded": str(want.phase != "Ready"),
        }, f"{name}: {status['conditions']} {where}"
        for entry in status["arches"]:
            arch = entry["arch"]
            if want.arches[arch] == "Ready":
                assert entry.get("generation") == want.generations[arch], f"{name} {arch} {where}"
            else:
                assert "generation" not in entry, f"{name} {arch} {where}"
                assert f"gave up after {max_attempts} attempt(s)" in entry["message"], entry
        phases[want.phase] += 1
    assert sum(phases.values()) == len(caches), where
    return phases


def arch_outcomes(caches: dict[str, Expected]) -> Counter[str]:
    """How the arches ended (for the summary line): ready at once, ready after failed
    attempts, or failed every attempt."""
    outcomes: Counter[str] = Counter()
    for want in caches.values():
        for arch, phase in want.arches.items():
            if phase == "Failed":
                outcomes["failed"] += 1
            else:
                outcomes["ready" if want.attempts[arch] == 1 else "ready after a retry"] += 1
    return outcomes


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


KILLS = 50
MAX_ATTEMPTS = 3


def test_operator_killed_mid_reconcile_converges_without_duplicate_jobs(tmp_path: Path) -> None:
    """50 SIGKILLs at seeded points of reconciling (a new KernelCache each round, Jobs ending
    while the operator is down and while it runs); one more start then settles everything."""
    rng = random.Random(SEED)
    settings = {**FAST, "MAX_ATTEMPTS": str(MAX_ATTEMPTS)}
    caches: dict[str, Expected] = {}
    with api_harness(tmp_path) as api:
        switch = KillSwitch(api)
        api.emulator.before, api.emulator.after = switch.before, switch.after
        for round_ in range(KILLS):
            body = kernelcache_doc(f"kc-{round_:02d}", NS, ARCHES)
            body = api.kube.request("POST", kernelcache_path(NS), body=body)  # with its uid
            caches[body["metadata"]["name"]] = expected(SEED, body, MAX_ATTEMPTS)
            finish_some(api.kube, rng, SEED, share=0.3)
            # A new KernelCache alone makes 7 such writes: finalizer, claim, ConfigMap, two
            # Jobs, status, kopf's progress annotation.
            write, after_applying = rng.randint(1, 7), rng.random() < 0.5
            switch.arm(write, after_applying)
            # Each start outranks the dead replicas still listed in the peering object.
            operator = api.start_operator(**settings, PRIORITY=str(round_ + 1))
            finish_some(api.kube, rng, SEED, share=0.3)
            returncode = operator.process.wait(timeout=scaled(60))
            assert returncode == -signal.SIGKILL and len(switch.killed) == round_ + 1, (
                f"round {round_}: the operator was not killed at write {write} "
                f"(seed {SEED}): {operator.tail()}"
            )

        operator = api.start_operator(**settings, PRIORITY=str(KILLS + 1))
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


CACHES = 500
SCALE_ATTEMPTS = 2


def test_500_kernelcaches_with_random_job_outcomes_end_in_the_right_phase(tmp_path: Path) -> None:
    """500 KernelCaches of one or two arches (seeded); every Job succeeds or fails by the seed
    as soon as it exists, a failed attempt is retried once; every object must end exactly as
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
            for i in range(CACHES):
                body = kernelcache_doc(f"kc-{i:03d}", NS, ARCHES[: rng.randint(1, len(ARCHES))])
                body = api.kube.request("POST", kernelcache_path(NS), body=body)
                caches[body["metadata"]["name"]] = expected(SEED, body, SCALE_ATTEMPTS)
            wait_until(
                lambda: controller.errors or all_settled(api.kube, CACHES),
                timeout=scaled(240),
                what=f"every KernelCache to settle (seed {SEED})",
                interval=1.0,  # a list of 500 KernelCaches is no small request
            )
            assert not controller.errors, controller.errors[0]
        operator.stop()
        phases = assert_converged(api.kube, caches, SCALE_ATTEMPTS, SEED)
    assert set(phases) == {"Ready", "Degraded", "Failed"}, phases
    print(
        f"seed {SEED}: {CACHES} KernelCaches {dict(phases)}; arches "
        f"{dict(arch_outcomes(caches))}; Jobs {dict(controller.outcomes)}; "
        f"{time.monotonic() - started:.0f} s"
    )
