"""What the operator chaos tests share: each Job's seeded outcome, and the end state it implies.

tests/test_operator_chaos.py SIGKILLs the operator mid-reconcile, tests/test_operator_chaos_load.py
ends hundreds of Jobs at random (two files, so that pytest-xdist runs them side by side).

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
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tests.operator_process import result_generation

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

SEED = int(os.environ.get("KERNELCACHE_CHAOS_SEED", "20261130"))
NS = "chaos"
ARCHES = ("sm_90a", "sm_120a")


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
            "CoverageComplete": "True",  # no warm here names a gap
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
