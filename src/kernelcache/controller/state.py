"""Pure decisions: what a compile Job's state means, what to create next, what status to write.

Observed state comes in as plain dicts (Jobs and pods as the API server returns them, the
previous status); decisions come out as plain dicts and small dataclasses. Nothing here
talks to the API server or reads the clock, so every rule is a unit test away.

Rules, per arch of the current spec (Jobs of an older spec digest are not looked at; the
digest is new for every ``metadata.generation``, so a reverted spec's old Jobs are older):

- No Job: create attempt 0 - unless the status already says Ready or Failed for this very
  KernelCache generation (its Jobs have expired after ``ttlSecondsAfterFinished``): a
  finished result stays, nothing is rebuilt.
- The newest attempt decides the phase: not started Pending, running Compiling, complete
  Ready (with the ``ArchResult`` its pod wrote as termination message), failed Failed.
- A failed attempt is retried as a new Job (next attempt number, so a new name) once its
  backoff has passed, up to ``max_attempts``; then the arch stays Failed until the spec
  changes. Retrying with new Jobs rather than kopf's handler retries keeps every attempt
  visible (``kubectl get jobs``) and makes the attempt count survive operator restarts.
- Until a new Job publishes, the arch keeps showing the generation that is published now:
  the store's CURRENT only moves on publish.
- A Job whose pod cannot start (``pod_stuck``: unschedulable, an image that does not pull, a
  Secret, ConfigMap or claim that does not exist) is not compiling: the arch says why, in the
  scheduler's or kubelet's words, and the KernelCache is Degraded until the pod runs. A real
  Job counts such a pod as active until its ``activeDeadlineSeconds``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import ValidationError

from kernelcache.contract import LABEL_ARCH, LABEL_ATTEMPT, LABEL_DIGEST
from kernelcache.images import InvalidImageReference, same_image
from kernelcache.spec import ArchStatus

JobState = Literal["Pending", "Compiling", "Succeeded", "Failed"]
UNFINISHED: tuple[JobState, ...] = ("Pending", "Compiling")

# What an arch keeps from its last published result while a new build runs, as the CRD
# names each field of ``spec.ArchStatus``.
_PUBLISHED = {
    ArchStatus.model_fields[name].alias or name: name
    for name in (
        "generation",
        "stamp_digest",
        "artifacts",
        "bytes",
        "compile_seconds",
        "signed_by",
        "artifact",
        "engine_image",
        "coverage_gaps",
    )
}
PUBLISHED_FIELDS = tuple(_PUBLISHED)
STATUS_KEYS = (
    "phase", "observedGeneration", "readyArches", "servingArches", "arches", "conditions",
    "nodes", "learned",
)  # fmt: skip


def arch_status(**fields: Any) -> dict[str, Any]:
    """One arch's status entry, written through the CRD's model (``spec.ArchStatus``): its
    fields by the model's names or the CRD's; what is None is left out."""
    return ArchStatus.model_validate(fields).model_dump(by_alias=True, exclude_none=True)


def from_result(result: dict[str, Any]) -> dict[str, Any]:
    """The published fields of a warm's result (``build.ArchResult`` as JSON), by the model's
    names: the one place the build's names meet the status's."""
    return {
        "generation": result.get("generation"),
        "stamp_digest": result.get("stamp"),
        "artifacts": result.get("files"),
        "bytes": result.get("bytes"),
        "compile_seconds": result.get("seconds"),
        "signed_by": result.get("signed_by"),
        "artifact": result.get("artifact"),
        "coverage_gaps": result.get("coverage_gaps") or None,
    }


def published(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per arch with a generation, the published fields of a status: what CURRENT names."""
    return {
        a["arch"]: {k: a[k] for k in PUBLISHED_FIELDS if k in a}
        for a in status.get("arches") or []
        if a.get("generation")
    }


def recorded(text: str | None, claim: str) -> dict[str, dict[str, Any]]:
    """A published record's arches as status entries of a finished build; none when it is
    unreadable or of another claim (then it says nothing about this store)."""
    try:
        record = json.loads(text or "")
    except ValueError:
        return {}
    if not isinstance(record, dict) or record.get("claim") != claim:
        return {}
    arches = record.get("arches")
    found = {}
    for arch, fields in arches.items() if isinstance(arches, dict) else ():
        if not (isinstance(fields, dict) and fields.get("generation")):
            continue
        kept = {k: fields[k] for k in PUBLISHED_FIELDS if k in fields}
        try:
            found[arch] = arch_status(arch=arch, phase="Ready", **kept)
        except ValidationError:
            continue  # not what an operator wrote: it says nothing about this arch
    return found


def parse_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def format_time(value: datetime) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(job: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return dict(condition)
    return None


def job_state(job: dict[str, Any]) -> JobState:
    """Complete and Failed conditions are final; an active pod means it is compiling."""
    if _condition(job, "Complete"):
        return "Succeeded"
    if _condition(job, "Failed"):
        return "Failed"
    status = job.get("status") or {}
    return "Compiling" if status.get("active") or status.get("ready") else "Pending"


def job_attempt(job: dict[str, Any]) -> int:
    labels = job.get("metadata", {}).get("labels") or {}
    try:
        return int(labels.get(LABEL_ATTEMPT, "0"))
    except ValueError:
        return 0


def job_image(job: dict[str, Any]) -> str | None:
    """The engine image a compile Job's ``warm`` container runs: what its generation is for."""
    template = ((job.get("spec") or {}).get("template") or {}).get("spec") or {}
    for container in template.get("containers") or []:
        if container.get("name") == "warm" and container.get("image"):
            return str(container["image"])
    return None


def job_failure(job: dict[str, Any]) -> str:
    """The Job's own account of its failure, e.g. ``BackoffLimitExceeded: Job has reached…``."""
    condition = _condition(job, "Failed") or {}
    reason, message = condition.get("reason") or "Failed", condition.get("message") or ""
    return f"{reason}: {message}" if message else reason


def job_finished_at(job: dict[str, Any]) -> datetime | None:
    condition = _condition(job, "Complete") or _condition(job, "Failed") or {}
    status = job.get("status") or {}
    return parse_time(condition.get("lastTransitionTime") or status.get("completionTime"))


def job_seconds(job: dict[str, Any]) -> float | None:
    """How long a finished Job ran, from its start to its final condition."""
    started = parse_time((job.get("status") or {}).get("startTime"))
    finished = job_finished_at(job)
    if started is None or finished is None:
        return None
    return max(0.0, (finished - started).total_seconds())


def may_be_stuck(job: dict[str, Any]) -> bool:
    """Whether a Job has a pod that may not have started: active, none of them ready (a Job
    controller that reports ``ready`` saves reading the pods of every running compile)."""
    status = job.get("status") or {}
    return job_state(job) == "Compiling" and not status.get("ready")


# A container waiting for these is on its way; any other reason is the kubelet refusing it.
_STARTING = frozenset({"ContainerCreating", "PodInitializing"})


def pod_stuck(pods: Iterable[dict[str, Any]], events: Iterable[dict[str, Any]] = ()) -> str | None:
    """Why the newest pod of a Job cannot start, in one line; None when it runs or may yet.

    In the order Kubernetes reports it: the scheduler's ``PodScheduled`` condition (no node,
    a claim that does not exist), a container waiting for a reason other than being created
    (``ErrImagePull``, ``ImagePullBackOff``, ``CreateContainerConfigError``: a Secret or
    ConfigMap key its env names), then the newest Warning event about the pod (the kubelet's
    ``FailedMount`` for a Secret or ConfigMap volume that does not exist, which leaves the
    container merely ``ContainerCreating``). Every reason is taken as given, so a cause this
    module has never heard of is shown as well.
    """
    newest = max(
        pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "", default=None
    )
    if newest is None or (newest.get("status") or {}).get("phase", "Pending") != "Pending":
        return None
    meta, status = newest.get("metadata") or {}, newest.get("status") or {}
    pod = f"pod {meta.get('name', '?')}"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return _reason(
                pod, condition.get("reason") or "Unschedulable", condition.get("message")
            )
    for container in [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") and waiting["reason"] not in _STARTING:
            where = f"{pod} container {container.get('name', '?')}"
            return _reason(where, waiting["reason"], waiting.get("message"))
    warnings = [
        e
        for e in events
        if e.get("type") == "Warning"
        and (e.get("involvedObject") or {}).get("kind") == "Pod"
        and (e.get("involvedObject") or {}).get("name") == meta.get("name")
        and (e.get("involvedObject") or {}).get("uid") in (None, meta.get("uid"))
    ]
    if warnings:
        last = max(warnings, key=_event_time)
        return _reason(pod, last.get("reason") or "Warning", last.get("message"))
    return None


def _reason(where: str, reason: str, message: str | None) -> str:
    text = " ".join((message or "").split())[:300]
    return f"{where}: {reason}: {text}" if text else f"{where}: {reason}"


def _event_time(event: dict[str, Any]) -> str:
    return str(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )


def termination_result(pods: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``ArchResult`` the newest pod's ``warm`` container left as termination message.

    ``kernelcache warm --result /dev/termination-log`` writes it as JSON on success; a warm
    that failed first leaves its last log lines instead (FallbackToLogsOnError), of which
    the last non-empty one becomes the message.
    """
    newest = sorted(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "")
    for pod in reversed(newest):
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            if container.get("name") != "warm":
                continue
            terminated = (container.get("state") or {}).get("terminated") or (
                container.get("lastState") or {}
            ).get("terminated")
            text = ((terminated or {}).get("message") or "").strip()
            if not text:
                continue
            try:
                result = json.loads(text)
            except ValueError:
                result = None
            if isinstance(result, dict) and "status" in result:
                return result
            return {"status": "failed", "message": text.splitlines()[-1].strip()[:300]}
    return None


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int
    backoff_seconds: float
    backoff_max_seconds: float

    def delay(self, attempt: int) -> float:
        """Seconds after attempt ``attempt`` (0-based) failed before the next one starts."""
        return min(self.backoff_max_seconds, self.backoff_seconds * 2**attempt)


@dataclass(frozen=True)
class ArchPlan:
    """One arch's status to write, and whether a Job should be created for it."""

    status: dict[str, Any]
    create_attempt: int | None = None  # create the Job of this attempt
    progressing: bool = False  # a Job is waiting or running, or a retry is scheduled
    job: dict[str, Any] | None = None  # the newest Job the status was read from
    # A Warning this state is (CANNOT_START, or a failure retried at once): posted with the
    # arch's message when it changes, and the reason the KernelCache is Degraded.
    warning: str | None = None


CANNOT_START = "JobCannotStart"
COMPILE_FAILED = "CompileFailed"


def jobs_by_arch(jobs: Iterable[dict[str, Any]], digest: str) -> dict[str, list[dict[str, Any]]]:
    """The compile Jobs of the current spec digest, per arch."""
    result: dict[str, list[dict[str, Any]]] = {}
    for job in jobs:
        labels = job.get("metadata", {}).get("labels") or {}
        if labels.get(LABEL_DIGEST) == digest and LABEL_ARCH in labels:
            result.setdefault(labels[LABEL_ARCH], []).append(job)
    return result


def newest(jobs: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    return max(jobs, key=job_attempt, default=None)


def superseded(jobs: Iterable[dict[str, Any]], digest: str) -> list[str]:
    """Unfinished Jobs of an older spec: deleted, or they could publish over the new one.

    Finished ones are left to ``ttlSecondsAfterFinished``; no store data is deleted either
    way (a killed build leaves only a staging directory, which the next writer removes).
    """
    return [
        job["metadata"]["name"]
        for job in jobs
        if (job["metadata"].get("labels") or {}).get(LABEL_DIGEST) != digest
        and job_state(job) in UNFINISHED
    ]


def needs_result(
    job: dict[str, Any], previous: dict[str, Any] | None, previous_current: bool
) -> bool:
    """Whether to read the pods of a Job: it finished and its result is not in status yet."""
    outcome = job_state(job)
    if outcome == "Failed":
        return True
    already = previous is not None and previous_current and previous.get("phase") == "Ready"
    return outcome == "Succeeded" and not already


def plan_arch(
    arch: str,
    jobs: list[dict[str, Any]],
    previous: dict[str, Any] | None,
    previous_current: bool,
    result: dict[str, Any] | None,
    policy: RetryPolicy,
    now: datetime,
    stuck: str | None = None,
) -> ArchPlan:
    """Decide one arch's status and next Job from its Jobs of the current spec.

    ``previous`` is the arch's entry in the status as last written and ``previous_current``
    whether that status was written for the current ``metadata.generation``; ``result`` is
    the newest Job's termination result when it has finished (``needs_result``), ``stuck``
    why its pod cannot start (``pod_stuck``) while it has not.
    """
    published = {_PUBLISHED[k]: previous[k] for k in PUBLISHED_FIELDS if previous and k in previous}

    def status(phase: str, message: str, **fields: Any) -> dict[str, Any]:
        return arch_status(
            **{"arch": arch, "phase": phase, **published, **fields, "message": message}
        )

    job = newest(jobs)
    if job is None:
        if previous and previous_current and previous.get("phase") in ("Ready", "Failed"):
            return ArchPlan(previous)
        return ArchPlan(status("Pending", "creating the compile Job"), 0, True)
    name, attempt = job["metadata"]["name"], job_attempt(job)
    of = f" (attempt {attempt + 1} of {policy.max_attempts})" if attempt else ""
    outcome = job_state(job)
    if outcome in UNFINISHED and stuck:
        message = f"Job {name} cannot start{of}: {stuck}"
        return ArchPlan(status("Pending", message), None, True, job, CANNOT_START)
    if outcome == "Pending":
        return ArchPlan(status("Pending", f"Job {name} is waiting to start{of}"), None, True, job)
    if outcome == "Compiling":
        return ArchPlan(status("Compiling", f"Job {name} is compiling{of}"), None, True, job)
    if outcome == "Succeeded":
        if result is None and previous and previous_current and previous.get("phase") == "Ready":
            return ArchPlan(previous, job=job)
        unread = f"Job {name} succeeded; no result was readable"
        if result is None:
            return ArchPlan(status("Ready", unread), job=job)
        fields = {k: v for k, v in from_result(result).items() if v is not None}
        if fields.get("generation"):
            fields["engine_image"] = job_image(job)
        try:
            done = status("Ready", f"{result['status']} by Job {name}", **fields)
        except ValidationError as exc:  # not what kernelcache warm writes
            done = status("Ready", f"{unread}: {exc.errors()[0]['loc'][0]} malformed")
        return ArchPlan(done, job=job)
    detail = job_failure(job)
    if result and result.get("message"):
        detail += f"; {result['message']}"
    detail = f"Job {name}: {detail}"
    if attempt + 1 >= policy.max_attempts:
        gave_up = f"{detail} (gave up after {policy.max_attempts} attempt(s))"
        return ArchPlan(status("Failed", gave_up), job=job)
    failed_at = job_finished_at(job) or parse_time(job["metadata"].get("creationTimestamp"))
    due = (failed_at or now) + timedelta(seconds=policy.delay(attempt))
    if now >= due:  # seen only now (the backoff passed unseen): told as the retry starts
        told = previous is not None and previous.get("phase") == "Failed"
        retrying = status("Pending", f"retrying after {detail}")
        return ArchPlan(retrying, attempt + 1, True, job, None if told else COMPILE_FAILED)
    retry = f"{detail}; retry {attempt + 2} of {policy.max_attempts} at {format_time(due)}"
    return ArchPlan(status("Failed", retry), None, True, job)


def consumed_arch(arch: str, artifact: str) -> ArchPlan:
    """An arch of a KernelCache consuming ``spec.source``: built elsewhere, no Job; each
    node's init-container checks its stamp when a pod starts."""
    message = "consumed by digest from spec.source; no compile Job runs here"
    return ArchPlan(arch_status(arch=arch, phase="Ready", artifact=artifact, message=message))


def _conditions(
    wanted: list[tuple[str, bool, str, str]],
    previous: list[dict[str, Any]],
    generation: int | None,
    now: datetime,
) -> list[dict[str, Any]]:
    """Conditions with lastTransitionTime kept while the status does not change."""
    before = {c.get("type"): c for c in previous}
    result = []
    for kind, true, reason, message in wanted:
        value = "True" if true else "False"
        old = before.get(kind) or {}
        since = old.get("lastTransitionTime") if old.get("status") == value else None
        condition = {
            "type": kind,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since or format_time(now),
        }
        if generation is not None:
            condition["observedGeneration"] = generation
        result.append(condition)
    return result


# Reasons of a True Degraded condition that nothing will change until the spec does.
FAILED_REASONS = frozenset({"InvalidSpec", "AllArchesFailed"})
IMAGE_NOT_PUBLISHED = "ImageNotPublished"
# Degraded reasons whose Warning events are posted per arch (``transitions``).
_TOLD_PER_ARCH = frozenset({"InvalidSpec", "AllArchesFailed", COMPILE_FAILED, CANNOT_START})

Check = tuple[str, bool, str, str]  # a condition of its own: (type, holds, reason, message)


def phase_of(conditions: Iterable[dict[str, Any]]) -> str:
    """The phase, read from the conditions alone (the one source of both):

    - Degraded True: Failed when nothing changes until the spec does (an invalid spec, every
      arch failed), else Degraded;
    - else Ready True: Ready;
    - else Progressing True: Compiling once an arch compiles or is built, else Pending;
    - else Pending.
    """
    found = {c.get("type"): c for c in conditions}

    def holds(kind: str) -> bool:
        return (found.get(kind) or {}).get("status") == "True"

    if holds("Degraded"):
        return "Failed" if found["Degraded"].get("reason") in FAILED_REASONS else "Degraded"
    if holds("Ready"):
        return "Ready"
    if holds("Progressing") and found["Progressing"].get("reason") == "Compiling":
        return "Compiling"
    return "Pending"


def serves_image(arch: dict[str, Any], image: str | None) -> bool:
    """Whether pods on ``image`` load the arch's published generation: it was built for that
    image (a status written before the image was recorded is taken to be)."""
    built = arch.get("engineImage")
    if not built or image is None:
        return True
    try:
        return same_image(built, image)
    except InvalidImageReference:
        return False


def _refusal(arch: dict[str, Any], image: str | None) -> str:
    """Which pods of an arch are refused, and which load what. Without the build's progress
    (the arch's own message says it), so that it changes, and is told, once per image."""
    return (
        f"{arch['arch']}: pods on {image} are refused until its generation publishes, unless "
        f"the store still keeps one built for it; pods on {arch.get('engineImage')} load "
        f"generation {arch.get('generation')}"
    )


def coverage_condition(arches: list[dict[str, Any]]) -> Check:
    """CoverageComplete: whether every published generation covers what its warm met (the
    kernels it still met after ready are named, per arch). It says, it does not decide:
    serving accepts a generation with gaps unless the spec demands full coverage."""
    gaps = [(a["arch"], a["coverageGaps"]) for a in arches if a.get("coverageGaps")]
    if not gaps:
        return ("CoverageComplete", True, "NoGaps", "every published generation covers its warm")
    said = "; ".join(f"{arch}: {', '.join(named)}" for arch, named in gaps)
    return ("CoverageComplete", False, "CoverageGaps", f"still loaded after ready: {said}")


def summarize(
    plans: list[ArchPlan],
    generation: int | None,
    previous: dict[str, Any],
    now: datetime,
    *,
    image: str | None = None,
    checks: Sequence[Check] = (),
) -> dict[str, Any]:
    """The whole status: per-arch entries, the conditions, and the phase read from them.

    ``readyArches`` counts the arches built for the current spec; ``servingArches`` those
    whose store names a generation that pods on ``image`` (``spec.engine.image``) load now:
    while a change of anything else builds, the previous generation still serves (``0/2``
    ready is not ``0/2`` serving); while a new image builds, the previous image's pods load
    its generation and the new image's are refused, which Degraded says
    (``ImageNotPublished``). ``checks`` are conditions of their own (``SignatureTrusted``):
    one that does not hold makes Ready False and Degraded True.
    """
    arches = [p.status for p in plans]
    ready = sum(a["phase"] == "Ready" for a in arches)
    published = [a for a in arches if a.get("generation") or a.get("artifact")]
    refused = [a for a in published if not serves_image(a, image)]
    failed = [a for a in arches if a["phase"] == "Failed"]
    stuck = [p.status for p in plans if p.warning == CANNOT_START]
    busy = [a for a, p in zip(arches, plans, strict=True) if p.progressing]
    failing = [c for c in checks if not c[1]]
    count = f"{ready}/{len(arches)} arches ready"
    all_ready = bool(arches) and ready == len(arches) and not failing
    busy_text = "; ".join(f"{a['arch']}: {a['message']}" for a in busy) or count
    problems = [
        *(f"{a['arch']}: {a['message']}" for a in failed + stuck),
        *(_refusal(a, image) for a in refused),
        *(c[3] for c in failing),
    ]
    if failed and len(failed) == len(arches):
        degraded = "AllArchesFailed"
    elif failed or stuck:
        degraded = COMPILE_FAILED if failed else CANNOT_START
    elif refused:
        degraded = IMAGE_NOT_PUBLISHED
    else:
        degraded = failing[0][2] if failing else "NoFailures"
    if all_ready:
        ready_reason, ready_text = "ArchesReady", count
    elif failing and ready == len(arches):
        ready_reason, ready_text = failing[0][2], failing[0][3]
    else:
        ready_reason, ready_text = "ArchesNotReady", count
    compiling = any(a["phase"] in ("Compiling", "Ready") for a in arches)
    wanted = [
        ("Ready", all_ready, ready_reason, ready_text),
        (
            "Progressing",
            bool(busy),
            "Idle" if not busy else "Compiling" if compiling else "Pending",
            busy_text,
        ),
        ("Degraded", bool(problems), degraded, "; ".join(problems) or count),
        coverage_condition(arches),
        *checks,
    ]
    conditions = _conditions(wanted, previous.get("conditions") or [], generation, now)
    return {
        "phase": phase_of(conditions),
        "observedGeneration": generation,
        "readyArches": f"{ready}/{len(arches)}",
        "servingArches": f"{len(published) - len(refused)}/{len(arches)}",
        "arches": arches,
        "conditions": conditions,
    }


def invalid_status(
    previous: dict[str, Any], message: str, generation: int | None, now: datetime
) -> dict[str, Any]:
    """Failed, with the validation message in the conditions; what is published stays listed."""
    wanted = [
        ("Ready", False, "InvalidSpec", message),
        ("Progressing", False, "InvalidSpec", "nothing is compiled until the spec is fixed"),
        ("Degraded", True, "InvalidSpec", message),
    ]
    conditions = _conditions(wanted, previous.get("conditions") or [], generation, now)
    return {
        "phase": phase_of(conditions),
        "observedGeneration": generation,
        "readyArches": previous.get("readyArches"),
        "servingArches": previous.get("servingArches"),
        "arches": previous.get("arches") or [],
        "conditions": conditions,
        "learned": previous.get("learned"),  # what serving met holds whatever the spec says
    }


def normalized(status: dict[str, Any] | None) -> dict[str, Any]:
    """The status keys the operator owns, for comparing and for a merge patch (None deletes)."""
    status = status or {}
    return {key: status.get(key) for key in STATUS_KEYS}


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the KernelCache."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def transitions(
    previous: dict[str, Any], status: dict[str, Any], plans: Iterable[ArchPlan] = ()
) -> list[Event]:
    """Events for what changed: an arch started, published, failed or cannot start (the
    ``warning`` of its plan); the spec became invalid."""
    events: list[Event] = []
    before = {a.get("arch"): a for a in previous.get("arches") or []}
    warned = {p.status["arch"]: p.warning for p in plans if p.warning}
    for arch in status.get("arches") or []:
        old = before.get(arch["arch"]) or {}
        if (reason := warned.get(arch["arch"])) and old.get("message") != arch["message"]:
            events.append(Event("Warning", reason, f"{arch['arch']}: {arch['message']}"))
            continue
        if old.get("phase") == arch["phase"] and arch["phase"] != "Failed":
            continue
        if arch["phase"] == "Failed" and old.get("message") == arch["message"]:
            continue
        message = f"{arch['arch']}: {arch['message']}"
        if arch["phase"] == "Compiling":
            events.append(Event("Normal", "Compiling", message))
        elif arch["phase"] == "Ready":
            events.append(Event("Normal", "Published", message))
        elif arch["phase"] == "Failed":
            events.append(Event("Warning", "CompileFailed", message))
    ready = _find(status, "Ready")
    was = _find(previous, "Ready")
    if ready.get("reason") == "InvalidSpec" and ready.get("message") != was.get("message"):
        events.append(Event("Warning", "InvalidSpec", ready.get("message") or ""))
    degraded, before_degraded = _find(status, "Degraded"), _find(previous, "Degraded")
    if (
        degraded.get("status") == "True"
        and degraded.get("reason") not in _TOLD_PER_ARCH
        and degraded.get("message") != before_degraded.get("message")
    ):  # pods refused for a reason no arch's event says: a new image, an untrusted key
        events.append(Event("Warning", degraded["reason"], degraded.get("message") or ""))
    if status.get("phase") == "Ready" and previous.get("phase") != "Ready":
        events.append(Event("Normal", "Ready", f"all arches ready ({status.get('readyArches')})"))
    return events


def _find(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})
