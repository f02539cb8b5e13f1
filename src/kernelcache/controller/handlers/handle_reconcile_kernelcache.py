"""Reconcile one KernelCache: claim, spec ConfigMap, a compile Job per arch, then status.

Level-triggered and idempotent: every call looks at the Jobs as last seen and creates only
what is missing (deterministic names; 409 means it exists), so the create, update and resume
handlers, Job events and the resync timer can all call it, concurrently or after a restart.
The status is written with the resourceVersion it was computed from: if anything wrote the
object in between (another reconcile of it), the write gets 409 and the reconcile starts
over from a fresh read. So a stale view never overwrites a newer one, and only the
reconcile whose write lands posts the events of the transitions it made.

What is published is also kept in a record ConfigMap named after the KernelCache (not its
uid), like its data on the store: a KernelCache re-created under the name starts its status
from it, showing the generations its pods load before its own Jobs have run.

A spec that fails validation (a cross-field rule the CRD schema cannot express) is not an
error of the operator: the KernelCache gets phase Failed and a condition naming the field,
and nothing is created for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kernelcache.contract import LABEL_ARCH, LABEL_CACHE
from kernelcache.controller import learning, manifests, metrics, modes, signing, state
from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.kube import ApiError, Kube, jobs_path, kernelcache_path, path
from kernelcache.errors import SpecError
from kernelcache.spec import KernelCache, parse_kernelcache

CONFLICT_RETRIES = 5

JobsOf = Callable[[str], list[dict[str, Any]]]


class ConflictError(Exception):
    """The status kept changing under every attempt to write it."""


@dataclass
class Reconciled:
    body: dict[str, Any]  # the KernelCache as last read: what the events are about
    result: str  # ok | invalid | gone | deleting
    events: list[state.Event] = field(default_factory=list)


def reconcile_kernelcache(
    kube: Kube,
    config: OperatorConfig,
    body: dict[str, Any],
    jobs_of: JobsOf,
) -> Reconciled:
    """Reconcile from ``body``, re-reading the object after each conflicting status write.

    ``jobs_of(uid)`` returns the compile Jobs of the KernelCache with that uid as last seen
    (the operator keeps them indexed from its watch, so a reconcile lists nothing). A Job
    created a moment ago may be missing; creating it again is answered 409, harmlessly.
    """
    started = time.perf_counter()
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    events: list[state.Event] = []  # Jobs created survive a retry; so do their events
    result = "error"
    try:
        for _ in range(CONFLICT_RETRIES):
            try:
                now = datetime.now(timezone.utc)
                reconciled = _reconcile_once(kube, config, body, jobs_of, now, events)
                result = reconciled.result
                return reconciled
            except ApiError as exc:
                if exc.status != 409:
                    raise
            try:
                body = kube.get(kernelcache_path(namespace, name))
            except ApiError as exc:
                if exc.status != 404:
                    raise
                metrics.forget(f"{namespace}/{name}")
                result = "gone"
                return Reconciled(body, result, events)
        result = "conflict"
        raise ConflictError(f"{namespace}/{name}: {CONFLICT_RETRIES} status writes conflicted")
    finally:
        metrics.RECONCILES.labels(result).inc()
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)


def _object(body: dict[str, Any]) -> dict[str, Any]:
    """What validation looks at: the status is the operator's, not the user's."""
    return {k: v for k, v in body.items() if k != "status"}


def _reconcile_once(
    kube: Kube,
    config: OperatorConfig,
    body: dict[str, Any],
    jobs_of: JobsOf,
    now: datetime,
    events: list[state.Event],
) -> Reconciled:
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    if meta.get("deletionTimestamp"):
        return Reconciled(body, "deleting")  # the finalizer's handler owns it now
    previous = body.get("status") or {}
    generation = meta.get("generation")
    try:
        kc = parse_kernelcache(_object(body), f"{namespace}/{name}")
        if (why := manifests.mount_conflict(kc, config)) is not None:  # admitted unchecked
            raise SpecError(f"{namespace}/{name}: spec.modelVolume.mountPath: {why}")
    except SpecError as exc:
        invalid = state.invalid_status(previous, exc.message, generation, now)
        return _write(kube, body, previous, invalid, "invalid", events, [])

    secret = signing.read_secret(kube, kc)  # a rotated key: new Jobs, which re-sign
    digest = manifests.spec_digest(kc, signing.job_identity(secret))
    owner = manifests.owner_reference(body)
    jobs = jobs_of(uid)
    for stale in state.superseded(jobs, digest):
        kube.delete(jobs_path(namespace, stale))

    current = state.jobs_by_arch(jobs, digest)
    learned = learning.learn(kube, config, kc, previous.get("learned"), now)
    previous_current = previous.get("observedGeneration") == generation
    before = {a.get("arch"): a for a in previous.get("arches") or []}
    if not before:  # a new object: what an earlier one of this name published still serves
        before = _recorded(kube, kc)
    policy = state.RetryPolicy(
        config.max_attempts, config.retry_backoff_seconds, config.retry_backoff_max_seconds
    )
    plans, prepared = [], False
    for arch in kc.spec.arches():
        if kc.spec.source is not None:
            plans.append(state.consumed_arch(arch, kc.spec.source.oci.artifacts[arch]))
            continue
        arch_jobs = current.get(arch, [])
        job = state.newest(arch_jobs)
        result, stuck = None, None
        # Signed by another key than the Secret's: as if for another spec, its Job runs again.
        arch_current = previous_current and not signing.stale(before.get(arch), secret)
        if job is not None and state.needs_result(job, before.get(arch), arch_current):
            pods = kube.list(path("v1", "pods", namespace), manifests.pod_selector(job))
            result = state.termination_result(pods)
        elif job is not None and state.may_be_stuck(job):
            stuck = _stuck(kube, namespace, job)
        plan = state.plan_arch(
            arch, arch_jobs, before.get(arch), arch_current, result, policy, now, stuck
        )
        if plan.create_attempt is not None:
            if not prepared:  # what Jobs mount; made only when one is due (steady state: no writes)
                _prepare(kube, kc, owner, digest, learned)
                prepared = True
            new = manifests.compile_job(
                kc,
                arch=arch,
                digest=digest,
                attempt=plan.create_attempt,
                owner=owner,
                config=config,
            )
            if kube.create(jobs_path(namespace), new):
                message = f"{arch}: created Job {new['metadata']['name']}"
                events.append(state.Event("Normal", "JobCreated", message))
        plans.append(plan)
    unfinished = [p.job for p in plans if p.job and state.job_state(p.job) in state.UNFINISHED]
    if unfinished and not prepared:  # deleted under a waiting Job (a prune): its pod needs them
        _prepare(kube, kc, owner, digest, learned)
    trust = signing.trust_condition(kc, [p.status for p in plans], secret)
    status = state.summarize(
        plans,
        generation,
        previous,
        now,
        image=manifests.image_of(kc),
        checks=[trust] if trust is not None else [],
    )
    if config.prefetch_root:
        status["nodes"] = _prefetch(kube, config, body, kc, status, owner)
    status["learned"] = learned
    reconciled = _write(kube, body, previous, status, "ok", events, plans)
    events.extend(learning.events(previous.get("learned"), learned))  # the write landed
    if published := state.published(status):
        _record(kube, kc, uid, published)
    return reconciled


def _stuck(kube: Kube, namespace: str, job: dict[str, Any]) -> str | None:
    """Why an unfinished Job's pod cannot start (``state.pod_stuck``); the pod's events are
    read only when its status does not say (a volume that cannot be mounted)."""
    pods = kube.list(path("v1", "pods", namespace), manifests.pod_selector(job))
    stuck = state.pod_stuck(pods)
    pending = [p for p in pods if (p.get("status") or {}).get("phase", "Pending") == "Pending"]
    if stuck is not None or not pending:
        return stuck
    newest = max(pending, key=lambda p: p["metadata"].get("creationTimestamp") or "")
    query = {"fieldSelector": f"involvedObject.name={newest['metadata']['name']}"}
    events = kube.request("GET", path("v1", "events", namespace), query=query).get("items")
    return state.pod_stuck(pods, events or [])


def _prefetch(
    kube: Kube,
    config: OperatorConfig,
    body: dict[str, Any],
    kc: KernelCache,
    status: dict[str, Any],
    owner: dict[str, Any],
) -> list[dict[str, Any]]:
    """Keep one prefetch DaemonSet per GPU class on what the new status serves (created,
    updated when what it fetches changed, deleted when its class or arch is gone); each
    node's state, from the pods they run."""
    serving = parse_kernelcache({**_object(body), "status": status}, "status")
    namespace, uid = kc.metadata.namespace, owner["uid"]
    collection = path("apps/v1", "daemonsets", namespace)
    existing = {
        d["metadata"]["name"]: d
        for d in kube.list(collection, manifests.selector(uid, modes.PREFETCH))
    }
    digests = {}
    for daemonset in modes.prefetch_daemonsets(serving, owner, config):
        name = daemonset["metadata"]["name"]
        digests[daemonset["metadata"]["labels"][LABEL_ARCH]] = modes.template_digest(daemonset)
        if name not in existing:
            kube.create(collection, daemonset)
        elif modes.template_digest(existing.pop(name)) != modes.template_digest(daemonset):
            kube.patch(f"{collection}/{name}", {"spec": daemonset["spec"]})
    for name in existing:  # a class removed, or an arch that serves nothing now
        kube.delete(f"{collection}/{name}")
    pods = kube.list(path("v1", "pods", namespace), manifests.selector(uid, modes.PREFETCH))
    # Serving pods say when they found a node's copy damaged and started from the source.
    users = kube.list(path("v1", "pods", namespace), f"{LABEL_CACHE}={kc.metadata.name}")
    return modes.node_states(pods, digests, users)


def _recorded(kube: Kube, kc: KernelCache) -> dict[str, dict[str, Any]]:
    """The arches an earlier KernelCache of this name published to this claim, by its record."""
    try:
        record = kube.get(
            path("v1", "configmaps", kc.metadata.namespace, manifests.record_name(kc))
        )
    except ApiError as exc:
        if exc.status == 404:
            return {}
        raise
    text = (record.get("data") or {}).get(manifests.RECORD_FILE)
    return state.recorded(text, manifests.claim_name(kc))


def _record(kube: Kube, kc: KernelCache, uid: str, arches: dict[str, Any]) -> None:
    """Keep the published record in line with the status just written: read at every
    reconcile (one GET), written when it is missing (pruned) or says anything else."""
    record = manifests.published_record(kc, uid, arches)
    where = path("v1", "configmaps", kc.metadata.namespace, record["metadata"]["name"])
    try:
        found = kube.get(where)
    except ApiError as exc:
        if exc.status != 404:
            raise
        kube.create(path("v1", "configmaps", kc.metadata.namespace), record)
        return  # created meanwhile by another reconcile: the next one compares it
    data = found.get("data") or {}
    same = data.get(manifests.RECORD_FILE) == record["data"][manifests.RECORD_FILE]
    if same and manifests.KEPT_FILE not in data:
        return
    # A namesake's kept spec goes: this KernelCache exists, and the webhook reads it.
    kube.patch(where, {"data": {**record["data"], manifests.KEPT_FILE: None}})


def _prepare(
    kube: Kube, kc: KernelCache, owner: dict[str, Any], digest: str, learned: dict[str, Any] | None
) -> None:
    """Create the claim (from spec.storage.pvc) and the spec ConfigMap, unless they exist:
    when a Job is due, and while one has not finished (they may have been deleted since). The
    ConfigMap holds what serving learned so far, fixed for this spec's Jobs."""
    namespace = kc.metadata.namespace
    if kc.spec.storage.pvc is not None:
        kube.create(
            path("v1", "persistentvolumeclaims", namespace), manifests.claim(kc, owner["uid"])
        )
    configmap = manifests.spec_configmap(kc, owner, digest)
    configmap["data"].update(learning.configmap_data(learned))
    kube.create(path("v1", "configmaps", namespace), configmap)


def _write(
    kube: Kube,
    body: dict[str, Any],
    previous: dict[str, Any],
    status: dict[str, Any],
    result: str,
    events: list[state.Event],
    plans: list[state.ArchPlan],
) -> Reconciled:
    """Write the status if it changed, conditional on the resourceVersion it was read at."""
    meta = body["metadata"]
    if state.normalized(status) != state.normalized(previous):
        kube.patch(
            kernelcache_path(meta["namespace"], meta["name"]) + "/status",
            {
                "metadata": {"resourceVersion": meta["resourceVersion"]},
                "status": state.normalized(status),
            },
        )
        events.extend(state.transitions(previous, status, plans))
        _observe_finished_jobs(previous, plans)
    key = f"{meta['namespace']}/{meta['name']}"
    metrics.set_phase(key, status["phase"])
    arches = status.get("arches") or []
    published = {a["arch"]: a["generation"] for a in arches if a.get("generation")}
    metrics.set_generations(key, published)
    return Reconciled(body, result, events)


def _observe_finished_jobs(previous: dict[str, Any], plans: list[state.ArchPlan]) -> None:
    """Record the run time of each Job whose end this status write reports first."""
    before = {a.get("arch"): a.get("phase") for a in previous.get("arches") or []}
    for plan in plans:
        arch, phase = plan.status["arch"], plan.status["phase"]
        if plan.job is None or phase not in ("Ready", "Failed") or before.get(arch) == phase:
            continue
        seconds = state.job_seconds(plan.job)
        if seconds is not None:
            outcome = "succeeded" if phase == "Ready" else "failed"
            metrics.COMPILE_JOB_SECONDS.labels(arch, outcome).observe(seconds)
