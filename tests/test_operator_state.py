"""The operator's decisions: Jobs, pods and the previous status as dicts in, decisions out."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from kernelcache.controller import state
from kernelcache.controller.manifests import LABEL_ARCH, LABEL_ATTEMPT, LABEL_DIGEST
from kernelcache.spec import ArchStatus

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
POLICY = state.RetryPolicy(max_attempts=3, backoff_seconds=60, backoff_max_seconds=600)


def ts(seconds_ago: float) -> str:
    return state.format_time(NOW - timedelta(seconds=seconds_ago))


def job(
    arch: str = "sm_90a",
    attempt: int = 0,
    digest: str = "d1",
    *,
    complete: bool = False,
    failed: bool = False,
    active: int = 0,
    finished_ago: float = 10,
) -> dict[str, Any]:
    name = f"kc-demo-{arch.replace('_', '-')}-{digest}" + (f"-r{attempt}" if attempt else "")
    status: dict[str, Any] = {"startTime": ts(finished_ago + 100)}
    if active:
        status["active"] = active
    if complete:
        status["conditions"] = [
            {"type": "Complete", "status": "True", "lastTransitionTime": ts(finished_ago)}
        ]
    if failed:
        status["conditions"] = [
            {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "Job has reached the specified backoff limit",
                "lastTransitionTime": ts(finished_ago),
            }
        ]
    labels = {LABEL_ARCH: arch, LABEL_ATTEMPT: str(attempt), LABEL_DIGEST: digest}
    return {"metadata": {"name": name, "labels": labels}, "status": status}


def pod(message: str, created: str = "2026-01-01T00:00:00Z", last: bool = False) -> dict[str, Any]:
    terminated = {"terminated": {"exitCode": 0, "message": message}}
    container = {"name": "warm", **({"lastState": terminated} if last else {"state": terminated})}
    return {
        "metadata": {"creationTimestamp": created},
        "status": {"containerStatuses": [{"name": "istio-proxy"}, container]},
    }


RESULT = {
    "arch": "sm_90a",
    "status": "published",
    "generation": "g1",
    "stamp": "blake3:ff",
    "files": 12,
    "bytes": 4096,
    "compiled": 12,
    "seconds": 41.5,
    "exit_code": 0,
    "message": "",
}


# Jobs


def test_job_state() -> None:
    assert state.job_state(job()) == "Pending"
    assert state.job_state(job(active=1)) == "Compiling"
    assert state.job_state({"status": {"ready": 1}}) == "Compiling"
    assert state.job_state(job(complete=True)) == "Succeeded"
    assert state.job_state(job(failed=True, active=1)) == "Failed"
    false = {"status": {"conditions": [{"type": "Failed", "status": "False"}]}}
    assert state.job_state(false) == "Pending"
    assert state.job_state({}) == "Pending"


def test_job_attempt_failure_and_timing() -> None:
    assert state.job_attempt(job(attempt=2)) == 2
    assert state.job_attempt({"metadata": {"labels": {LABEL_ATTEMPT: "x"}}}) == 0
    assert state.job_failure(job(failed=True)) == (
        "BackoffLimitExceeded: Job has reached the specified backoff limit"
    )
    assert state.job_failure(
        {"status": {"conditions": [{"type": "Failed", "status": "True"}]}}
    ) == ("Failed")
    assert state.job_finished_at(job(complete=True, finished_ago=5)) == NOW - timedelta(seconds=5)
    assert state.job_finished_at(job()) is None
    assert state.job_seconds(job(complete=True)) == 100.0
    assert state.job_seconds(job()) is None


def test_termination_result_reads_the_newest_warm_container() -> None:
    assert state.termination_result([]) is None
    assert state.termination_result([pod("")]) is None
    assert state.termination_result([pod(json.dumps(RESULT))]) == RESULT
    older = pod(json.dumps({**RESULT, "generation": "old"}), created="2025-01-01T00:00:00Z")
    assert state.termination_result([pod(json.dumps(RESULT)), older])["generation"] == "g1"
    assert state.termination_result([pod(json.dumps(RESULT), last=True)]) == RESULT


def test_termination_result_falls_back_to_the_last_log_line() -> None:
    logs = "warming sm_90a\nkernelcache: error: cute-dsl: demo_kernels:warm raised\n\n"
    assert state.termination_result([pod(logs)]) == {
        "status": "failed",
        "message": "kernelcache: error: cute-dsl: demo_kernels:warm raised",
    }
    assert state.termination_result([pod("[1, 2]")])["message"] == "[1, 2]"


def test_jobs_by_arch_newest_and_superseded() -> None:
    jobs = [
        job("sm_90a", 0, "d1", failed=True),
        job("sm_90a", 1, "d1", active=1),
        job("sm_120a", 0, "d1"),
        job("sm_90a", 0, "d0", active=1),  # an older spec, still running
        job("sm_120a", 0, "d0", complete=True),  # an older spec, finished
    ]
    grouped = state.jobs_by_arch(jobs, "d1")
    assert sorted(grouped) == ["sm_120a", "sm_90a"]
    assert len(grouped["sm_90a"]) == 2
    assert state.job_attempt(state.newest(grouped["sm_90a"]) or {}) == 1
    assert state.newest([]) is None
    assert state.superseded(jobs, "d1") == ["kc-demo-sm-90a-d0"]


def test_needs_result_only_for_finished_jobs_not_yet_in_status() -> None:
    ready = {"arch": "sm_90a", "phase": "Ready"}
    assert state.needs_result(job(complete=True), None, False)
    assert state.needs_result(job(complete=True), ready, False)
    assert not state.needs_result(job(complete=True), ready, True)
    assert state.needs_result(job(failed=True), {"phase": "Failed"}, True)
    assert not state.needs_result(job(active=1), None, False)


def test_retry_policy_doubles_up_to_the_cap() -> None:
    assert [POLICY.delay(n) for n in range(5)] == [60, 120, 240, 480, 600]


# One arch


def plan(
    jobs: list[dict[str, Any]],
    previous: dict[str, Any] | None = None,
    *,
    current: bool = True,
    result: dict[str, Any] | None = None,
) -> state.ArchPlan:
    return state.plan_arch("sm_90a", jobs, previous, current, result, POLICY, NOW)


def test_no_job_creates_the_first_attempt() -> None:
    decided = plan([])
    assert decided.create_attempt == 0
    assert decided.progressing
    assert decided.status == {
        "arch": "sm_90a",
        "phase": "Pending",
        "message": "creating the compile Job",
    }


@pytest.mark.parametrize("phase", ["Ready", "Failed"])
def test_a_finished_arch_stays_finished_after_its_jobs_expire(phase: str) -> None:
    previous = {"arch": "sm_90a", "phase": phase, "generation": "g1", "message": "m"}
    assert plan([], previous) == state.ArchPlan(previous)
    # ... but a status written for an older metadata.generation means a new spec: build.
    assert plan([], previous, current=False).create_attempt == 0


def test_pending_and_compiling_jobs() -> None:
    pending = plan([job()])
    assert pending.status["phase"] == "Pending"
    assert pending.status["message"] == "Job kc-demo-sm-90a-d1 is waiting to start"
    assert pending.progressing and pending.create_attempt is None
    compiling = plan([job(failed=True), job(attempt=1, active=1)])
    assert compiling.status["phase"] == "Compiling"
    assert compiling.status["message"] == "Job kc-demo-sm-90a-d1-r1 is compiling (attempt 2 of 3)"


def test_a_succeeded_job_makes_the_arch_ready_with_its_result() -> None:
    decided = plan([job(complete=True)], result=RESULT)
    assert decided.status == {
        "arch": "sm_90a",
        "phase": "Ready",
        "generation": "g1",
        "stampDigest": "blake3:ff",
        "artifacts": 12,
        "bytes": 4096,
        "compileSeconds": 41.5,
        "message": "published by Job kc-demo-sm-90a-d1",
    }
    assert not decided.progressing and decided.job is not None


def test_a_succeeded_job_without_a_readable_result() -> None:
    previous = {"arch": "sm_90a", "phase": "Ready", "generation": "g1", "message": "m"}
    assert plan([job(complete=True)], previous).status == previous
    unreadable = plan([job(complete=True)], None)
    assert unreadable.status["phase"] == "Ready"
    assert "no result was readable" in unreadable.status["message"]


def test_a_result_the_crd_would_refuse_is_not_written_into_the_status() -> None:
    """The status is built through spec.ArchStatus: a result field of the wrong type (here
    a count as a string) is reported as unreadable instead of patched into the status,
    which the API server would refuse on every reconcile."""
    odd = plan([job(complete=True)], result={**RESULT, "files": "12"})
    assert odd.status["phase"] == "Ready" and "artifacts" not in odd.status
    assert "no result was readable: artifacts malformed" in odd.status["message"]
    ArchStatus.model_validate(odd.status)


def test_a_new_build_keeps_showing_the_published_generation() -> None:
    published = {
        "arch": "sm_90a",
        "phase": "Ready",
        "generation": "g1",
        "stampDigest": "s1",
        "artifacts": 3,
        "bytes": 9,
        "compileSeconds": 1.0,
        "message": "old",
    }
    decided = plan([job(digest="d2", active=1)], published, current=False)
    assert decided.status["phase"] == "Compiling"
    assert decided.status["generation"] == "g1"
    assert decided.status["stampDigest"] == "s1"
    newer = plan([job(digest="d2", complete=True)], published, current=False, result=RESULT)
    assert newer.status["generation"] == "g1" and newer.status["artifacts"] == 12


def test_a_failed_job_waits_for_its_backoff_then_retries() -> None:
    failure = {"status": "failed", "message": "kernelcache: error: boom"}
    waiting = plan([job(failed=True, finished_ago=10)], result=failure)
    assert waiting.status["phase"] == "Failed"
    assert waiting.create_attempt is None and waiting.progressing
    assert waiting.status["message"] == (
        "Job kc-demo-sm-90a-d1: BackoffLimitExceeded: Job has reached the specified backoff "
        f"limit; kernelcache: error: boom; retry 2 of 3 at {ts(-50)}"
    )
    due = plan([job(failed=True, finished_ago=61)], result=failure)
    assert due.create_attempt == 1
    assert due.status["phase"] == "Pending"
    assert due.status["message"].startswith("retrying after Job kc-demo-sm-90a-d1: Backoff")
    second = plan([job(failed=True), job(attempt=1, failed=True, finished_ago=119)])
    assert second.create_attempt is None  # the second backoff is 120 s


def test_the_last_attempt_failing_gives_up() -> None:
    jobs = [job(attempt=n, failed=True, finished_ago=10_000) for n in range(3)]
    decided = plan(jobs)
    assert decided.status["phase"] == "Failed"
    assert decided.status["message"].endswith("(gave up after 3 attempt(s))")
    assert decided.create_attempt is None and not decided.progressing


# The whole status


@pytest.mark.parametrize(
    ("phases", "overall"),
    [
        (["Ready", "Ready"], "Ready"),
        (["Failed", "Failed"], "Failed"),
        (["Failed", "Ready"], "Degraded"),
        (["Failed", "Compiling"], "Degraded"),
        (["Ready", "Pending"], "Compiling"),
        (["Compiling", "Pending"], "Compiling"),
        (["Pending", "Pending"], "Pending"),
        ([], "Pending"),
    ],
)
def test_overall_phase(phases: list[str], overall: str) -> None:
    plans = [
        arch_plan(f"sm_{90 + i}a", p, progressing=p in ("Pending", "Compiling"))
        for i, p in enumerate(phases)
    ]
    assert state.summarize(plans, 1, {}, NOW)["phase"] == overall


CONDITION_REASONS = {
    "Ready": ("ArchesReady", "ArchesNotReady", "NoPublicKey", "KeysNotAPair", "InvalidSpec"),
    "Progressing": ("Compiling", "Pending", "Idle", "InvalidSpec"),
    "Degraded": (
        "NoFailures", "CompileFailed", "AllArchesFailed", "JobCannotStart", "InvalidSpec",
        "ImageNotPublished", "SignedByAnotherKey", "KeysNotAPair",
    ),
}  # fmt: skip


def _every_condition(kind: str) -> list[dict[str, Any] | None]:
    found: list[dict[str, Any] | None] = [None]  # absent: a status an older operator wrote
    for status in ("True", "False", "Unknown"):
        found += [{"type": kind, "status": status, "reason": r} for r in CONDITION_REASONS[kind]]
    return found


def test_every_combination_of_conditions_gives_a_consistent_phase() -> None:
    """The phase is read from the conditions alone and never contradicts one of them."""
    seen = set()
    for ready in _every_condition("Ready"):
        for progressing in _every_condition("Progressing"):
            for degraded in _every_condition("Degraded"):
                conditions = [c for c in (ready, progressing, degraded) if c is not None]
                phase = state.phase_of(conditions)
                seen.add(phase)
                holds = {c["type"] for c in conditions if c["status"] == "True"}
                assert (phase == "Ready") == ({"Ready"} <= holds and "Degraded" not in holds)
                assert (phase in ("Degraded", "Failed")) == ("Degraded" in holds)
                if phase == "Failed":
                    assert degraded and degraded["reason"] in state.FAILED_REASONS
                if phase == "Compiling":
                    assert "Progressing" in holds
    assert seen == {"Ready", "Degraded", "Failed", "Compiling", "Pending"}


@pytest.mark.parametrize("trusted", [True, False])
@pytest.mark.parametrize("stuck", [True, False])
@pytest.mark.parametrize(
    "phases",
    [[a, b] for a in ("Pending", "Compiling", "Ready", "Failed") for b in ("Ready", "Failed")],
)
def test_every_status_summarized_has_the_phase_of_its_conditions(
    phases: list[str], stuck: bool, trusted: bool
) -> None:
    """Whatever the arches and the checks, the written phase is the conditions' phase: Ready
    only with every arch Ready and every check holding (a missing signing key made a status
    say Ready beside a False Ready condition)."""
    plans = [
        state.ArchPlan(
            {"arch": f"sm_{90 + i}a", "phase": p, "message": p},
            progressing=p in ("Pending", "Compiling"),
            warning=state.CANNOT_START if stuck and p == "Pending" else None,
        )
        for i, p in enumerate(phases)
    ]
    check = ("SignatureTrusted", trusted, "SignedByTrustedKey" if trusted else "NoPublicKey", "k")
    status = state.summarize(plans, 1, {}, NOW, checks=[check])
    found = conditions(status)
    assert status["phase"] == state.phase_of(status["conditions"])
    ready = all(p == "Ready" for p in phases) and trusted
    assert (status["phase"] == "Ready") == ready == (found["Ready"]["status"] == "True")
    assert (found["Degraded"]["status"] == "True") == (status["phase"] in ("Degraded", "Failed"))


def test_coverage_gaps_a_build_named_are_a_condition_of_their_own() -> None:
    """A generation whose warm still met kernels after ready is published and Ready; the
    kernels it named travel from the Job's result into the arch's status and a
    CoverageComplete condition that says which, per arch, until a build without them."""
    result = {
        "status": "published",
        "generation": "g1",
        "stamp": "s",
        "files": 3,
        "bytes": 9,
        "seconds": 1.0,
        "coverage_gaps": ["attention: mask_empty_context_kernel (a batch)"],
    }
    gapped = state.arch_status(arch="sm_90a", phase="Ready", **state.from_result(result))
    assert gapped["coverageGaps"] == ["attention: mask_empty_context_kernel (a batch)"]
    status = state.summarize([state.ArchPlan(gapped)], 1, {}, NOW)
    found = conditions(status)
    assert status["phase"] == "Ready" and found["Ready"]["status"] == "True"
    assert found["CoverageComplete"]["status"] == "False"
    assert found["CoverageComplete"]["reason"] == "CoverageGaps"
    assert found["CoverageComplete"]["message"] == (
        "still loaded after ready: sm_90a: attention: mask_empty_context_kernel (a batch)"
    )
    whole = state.arch_status(arch="sm_90a", phase="Ready", **state.from_result(
        {**result, "coverage_gaps": []}))  # fmt: skip
    assert "coverageGaps" not in whole
    found = conditions(state.summarize([state.ArchPlan(whole)], 2, status, NOW))
    assert found["CoverageComplete"]["status"] == "True"


def test_a_new_image_building_says_which_pods_are_refused_and_serves_the_old() -> None:
    """While spec.engine.image moves from 0.1 to 0.2, the arch still publishes 0.1's
    generation: pods on 0.1 load it, pods on 0.2 are refused until 0.2's publishes. Status
    says so (serving 0/1, Degraded, a Warning event); once it publishes, all is well."""
    old, new = "ghcr.io/x/engine:0.1", "ghcr.io/x/engine:0.2"
    built = {"arch": "sm_90a", "phase": "Ready", "generation": "g-old", "engineImage": old}
    ready = state.summarize(
        [state.ArchPlan({**built, "message": "published"})], 1, {}, NOW, image=old
    )
    assert ready["phase"] == "Ready" and ready["servingArches"] == "1/1"

    building = {**built, "phase": "Compiling", "message": "Job kc-new is compiling"}
    status = state.summarize([state.ArchPlan(building, progressing=True)], 2, ready, NOW, image=new)
    found = conditions(status)
    assert status["phase"] == "Degraded" and status["servingArches"] == "0/1"
    assert found["Degraded"]["reason"] == state.IMAGE_NOT_PUBLISHED
    assert found["Degraded"]["message"] == (
        f"sm_90a: pods on {new} are refused until its generation publishes, unless the store "
        f"still keeps one built for it; pods on {old} load generation g-old"
    )
    (warning,) = [e for e in state.transitions(ready, status) if e.type == "Warning"]
    assert warning.reason == state.IMAGE_NOT_PUBLISHED and new in warning.message
    assert state.serves_image(building, old) and not state.serves_image(building, new)
    # The same image under another spelling is the same image.
    assert state.serves_image(building, "ghcr.io/x/engine:0.1")

    published = {**built, "generation": "g-new", "engineImage": new, "message": "published"}
    done = state.summarize([state.ArchPlan(published)], 2, status, NOW, image=new)
    assert done["phase"] == "Ready" and done["servingArches"] == "1/1"


def test_a_succeeded_job_records_the_image_its_generation_was_built_for() -> None:
    finished = job(complete=True)
    finished["spec"] = {
        "template": {"spec": {"containers": [{"name": "warm", "image": "ghcr.io/x/e:1"}]}}
    }
    result = {"status": "published", "generation": "g1", "stamp": "blake3:" + "ab" * 32}
    plan = state.plan_arch("sm_90a", [finished], None, True, result, POLICY, NOW)
    assert plan.status["engineImage"] == "ghcr.io/x/e:1"
    assert state.published({"arches": [plan.status]})["sm_90a"]["engineImage"] == "ghcr.io/x/e:1"


def arch_plan(arch: str, phase: str, progressing: bool = False) -> state.ArchPlan:
    return state.ArchPlan(
        {"arch": arch, "phase": phase, "message": f"{arch} is {phase}"}, progressing=progressing
    )


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_summarize_counts_ready_arches_and_sets_conditions() -> None:
    plans = [arch_plan("sm_90a", "Ready"), arch_plan("sm_120a", "Compiling", progressing=True)]
    status = state.summarize(plans, 3, {}, NOW)
    assert status["phase"] == "Compiling"
    assert status["observedGeneration"] == 3
    assert status["readyArches"] == "1/2"
    assert status["arches"] == [p.status for p in plans]
    found = conditions(status)
    assert found["Ready"]["status"] == "False" and found["Ready"]["message"] == "1/2 arches ready"
    assert found["Progressing"]["status"] == "True"
    assert found["Progressing"]["message"] == "sm_120a: sm_120a is Compiling"
    assert found["Degraded"]["status"] == "False"
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])
    assert all(c["lastTransitionTime"] == state.format_time(NOW) for c in status["conditions"])

    failed = state.summarize([arch_plan("sm_90a", "Failed")], 3, {}, NOW)
    assert conditions(failed)["Degraded"] == {
        "type": "Degraded",
        "status": "True",
        "reason": "AllArchesFailed",
        "message": "sm_90a: sm_90a is Failed",
        "lastTransitionTime": state.format_time(NOW),
        "observedGeneration": 3,
    }


def test_conditions_keep_their_transition_time_while_unchanged() -> None:
    plans = [arch_plan("sm_90a", "Ready")]
    first = state.summarize(plans, 1, {}, NOW - timedelta(hours=1))
    again = state.summarize(plans, 1, first, NOW)
    assert again == first
    broken = state.summarize([arch_plan("sm_90a", "Failed")], 2, first, NOW)
    assert conditions(broken)["Ready"]["lastTransitionTime"] == state.format_time(NOW)
    earlier = conditions(first)["Progressing"]["lastTransitionTime"]
    assert conditions(broken)["Progressing"]["lastTransitionTime"] == earlier


def test_invalid_status_names_the_field_and_keeps_what_is_published() -> None:
    previous = state.summarize([arch_plan("sm_90a", "Ready")], 1, {}, NOW)
    message = "default/demo: spec.storage: set exactly one of existingClaim or pvc"
    status = state.invalid_status(previous, message, 2, NOW)
    assert status["phase"] == "Failed"
    assert status["observedGeneration"] == 2
    assert status["arches"] == previous["arches"] and status["readyArches"] == "1/1"
    found = conditions(status)
    assert found["Ready"]["reason"] == "InvalidSpec" and found["Ready"]["message"] == message
    assert found["Degraded"]["status"] == "True"
    assert found["Progressing"]["status"] == "False"
    assert state.invalid_status({}, message, 1, NOW)["readyArches"] is None


def test_normalized_status_has_exactly_the_operators_keys() -> None:
    assert state.normalized(None) == dict.fromkeys(state.STATUS_KEYS)
    assert state.normalized({"phase": "Ready", "kopf": {}})["phase"] == "Ready"
    assert "kopf" not in state.normalized({"kopf": {}})


# Events


def test_transitions_post_one_event_per_change() -> None:
    pending = state.summarize([arch_plan("sm_90a", "Pending")], 1, {}, NOW)
    compiling = state.summarize([arch_plan("sm_90a", "Compiling")], 1, pending, NOW)
    ready = state.summarize([arch_plan("sm_90a", "Ready")], 1, compiling, NOW)
    assert state.transitions({}, pending) == []
    assert state.transitions(pending, compiling) == [
        state.Event("Normal", "Compiling", "sm_90a: sm_90a is Compiling")
    ]
    assert state.transitions(compiling, ready) == [
        state.Event("Normal", "Published", "sm_90a: sm_90a is Ready"),
        state.Event("Normal", "Ready", "all arches ready (1/1)"),
    ]
    assert state.transitions(ready, ready) == []


def test_transitions_warn_on_failures_and_invalid_specs() -> None:
    compiling = state.summarize([arch_plan("sm_90a", "Compiling")], 1, {}, NOW)
    failed = state.summarize([arch_plan("sm_90a", "Failed")], 1, compiling, NOW)
    assert state.transitions(compiling, failed) == [
        state.Event("Warning", "CompileFailed", "sm_90a: sm_90a is Failed")
    ]
    assert state.transitions(failed, failed) == []
    gave_up = {**failed, "arches": [{**failed["arches"][0], "message": "gave up"}]}
    assert state.transitions(failed, gave_up) == [
        state.Event("Warning", "CompileFailed", "sm_90a: gave up")
    ]
    invalid = state.invalid_status(failed, "spec.model: required field is missing", 2, NOW)
    assert state.transitions(failed, invalid) == [
        state.Event("Warning", "InvalidSpec", "spec.model: required field is missing")
    ]
    assert state.transitions(invalid, invalid) == []


def test_a_failure_without_a_transition_time_counts_from_the_jobs_creation() -> None:
    undated = job(failed=True)
    del undated["status"]["conditions"][0]["lastTransitionTime"]
    undated["metadata"]["creationTimestamp"] = ts(3600)
    assert plan([undated]).create_attempt == 1


# The published record


def test_published_keeps_what_current_names_per_arch() -> None:
    status = {
        "arches": [
            {"arch": "sm_90a", "phase": "Pending", "generation": "g1", "bytes": 9, "message": "m"},
            {"arch": "sm_120a", "phase": "Pending", "message": "creating the compile Job"},
        ]
    }
    assert state.published(status) == {"sm_90a": {"generation": "g1", "bytes": 9}}
    assert state.published({}) == {}


def test_a_record_of_this_claim_reads_back_as_finished_arches() -> None:
    record = json.dumps(
        {"claim": "kernelcache-demo", "arches": {"sm_90a": {"generation": "g1", "junk": 1}}}
    )
    assert state.recorded(record, "kernelcache-demo") == {
        "sm_90a": {"arch": "sm_90a", "phase": "Ready", "generation": "g1"}
    }
    # Another claim's store says nothing about this one; an unreadable record says nothing.
    assert state.recorded(record, "shared") == {}
    for text in (None, "", "{", "[]", json.dumps({"claim": "kernelcache-demo", "arches": 3})):
        assert state.recorded(text, "kernelcache-demo") == {}


# A compile pod that cannot start


def pending_pod(
    *,
    conditions: list[dict[str, Any]] | None = None,
    waiting: dict[str, str] | None = None,
    init_waiting: dict[str, str] | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending", "conditions": conditions or []}
    if init_waiting is not None:
        status["initContainerStatuses"] = [
            {"name": "store-ownership", "state": {"waiting": init_waiting}}
        ]
    status["containerStatuses"] = [
        {"name": "warm", "state": {"waiting": waiting or {"reason": "ContainerCreating"}}}
    ]
    meta = {"name": "kc-demo-sm-90a-d1-x7k2p", "uid": "u1", "creationTimestamp": ts(30)}
    return {"metadata": meta, "status": status}


def warning(reason: str, message: str, *, name: str = "kc-demo-sm-90a-d1-x7k2p", ago: float = 5,
            kind: str = "Warning") -> dict[str, Any]:  # fmt: skip
    return {
        "type": kind,
        "reason": reason,
        "message": message,
        "involvedObject": {"kind": "Pod", "name": name, "uid": "u1"},
        "lastTimestamp": ts(ago),
    }


UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "message": '0/2 nodes are available: persistentvolumeclaim "kernelcache-demo" not found.',
}
NOT_FOUND = 'MountVolume.SetUp failed for volume "signing" : secret "kc-signing-typo" not found'


@pytest.mark.parametrize(
    ("pod_", "events", "said"),
    [
        (  # no claim (the scheduler's words), or no node of the class
            pending_pod(conditions=[UNSCHEDULABLE]),
            [],
            'Unschedulable: 0/2 nodes are available: persistentvolumeclaim "kernelcache-demo" '
            "not found.",
        ),
        (
            pending_pod(
                waiting={"reason": "ImagePullBackOff", "message": "Back-off pulling image"}
            ),
            [],
            "container warm: ImagePullBackOff: Back-off pulling image",
        ),
        (  # a Secret key the env names
            pending_pod(
                waiting={
                    "reason": "CreateContainerConfigError",
                    "message": 'secret "kc-signing-typo" not found',
                }
            ),
            [],
            'container warm: CreateContainerConfigError: secret "kc-signing-typo" not found',
        ),
        (  # a Secret volume: the container only says ContainerCreating; the event says why
            pending_pod(),
            [warning("FailedMount", "old", ago=60), warning("FailedMount", NOT_FOUND)],
            f"FailedMount: {NOT_FOUND}",
        ),
        (  # a reason nobody listed, from the init container
            pending_pod(init_waiting={"reason": "RunContainerError", "message": "exec: no sh"}),
            [],
            "container store-ownership: RunContainerError: exec: no sh",
        ),
        (  # a sandbox that cannot be made: an event of a kind nobody listed either
            pending_pod(),
            [warning("FailedCreatePodSandBox", "failed to set up network")],
            "FailedCreatePodSandBox: failed to set up network",
        ),
    ],
    ids=["unschedulable", "image-pull", "secret-key", "secret-volume", "init-error", "sandbox"],
)
def test_a_pod_that_cannot_start_says_why(
    pod_: dict[str, Any], events: list[dict[str, Any]], said: str
) -> None:
    stuck = state.pod_stuck([pod_], events)
    name = pod_["metadata"]["name"]
    assert stuck is not None and stuck.startswith(f"pod {name}"), stuck
    assert stuck.endswith(said), stuck


def test_only_a_job_with_an_active_pod_none_ready_may_be_stuck() -> None:
    assert state.may_be_stuck(job(active=1))
    assert not state.may_be_stuck(job())  # no pod yet
    assert not state.may_be_stuck({**job(active=1), "status": {"active": 1, "ready": 1}})
    assert not state.may_be_stuck(job(failed=True, active=1))


def test_a_pod_on_its_way_is_not_stuck() -> None:
    assert state.pod_stuck([]) is None
    assert state.pod_stuck([pending_pod()]) is None  # being created, nothing said against it
    other = [
        warning("FailedMount", NOT_FOUND, name="another-pod"),
        warning("Pulled", "ok", kind="Normal"),
    ]
    assert state.pod_stuck([pending_pod()], other) is None
    running = {**pending_pod(), "status": {"phase": "Running"}}
    assert state.pod_stuck([running], [warning("FailedMount", NOT_FOUND)]) is None


def test_a_job_whose_pod_cannot_start_degrades_the_kernelcache_and_warns() -> None:
    stuck = state.pod_stuck([pending_pod()], [warning("FailedMount", NOT_FOUND)])
    decided = state.plan_arch("sm_90a", [job(active=1)], None, True, None, POLICY, NOW, stuck)
    assert decided.status["phase"] == "Pending" and decided.progressing
    assert decided.status["message"] == f"Job kc-demo-sm-90a-d1 cannot start: {stuck}"
    compiling = state.summarize([arch_plan("sm_90a", "Compiling", True)], 1, {}, NOW)
    status = state.summarize([decided], 1, compiling, NOW)
    assert status["phase"] == "Degraded"
    degraded = conditions(status)["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "JobCannotStart"
    assert 'secret "kc-signing-typo" not found' in degraded["message"]
    assert state.transitions(compiling, status, [decided]) == [
        state.Event("Warning", "JobCannotStart", f"sm_90a: {decided.status['message']}")
    ]
    assert state.transitions(status, status, [decided]) == []  # said once


def test_a_failure_seen_only_when_its_retry_is_due_is_still_told() -> None:
    """The operator was busy or down through the whole backoff: the arch goes from Compiling
    straight to the retry, and the failure still gets its Warning event."""
    due = plan([job(failed=True, finished_ago=61)])
    compiling = state.summarize([arch_plan("sm_90a", "Compiling", True)], 1, {}, NOW)
    status = state.summarize([due], 1, compiling, NOW)
    (event,) = state.transitions(compiling, status, [due])
    assert event.type == "Warning" and event.reason == "CompileFailed"
    assert "BackoffLimitExceeded" in event.message
    # Seen during its backoff, the failure was told then (phase Failed): not told twice.
    waited = plan([job(failed=True, finished_ago=10)])
    failed = state.summarize([waited], 1, compiling, NOW)
    assert [e.reason for e in state.transitions(compiling, failed, [waited])] == ["CompileFailed"]
    retry = plan([job(failed=True, finished_ago=61)], failed["arches"][0])
    assert state.transitions(failed, state.summarize([retry], 1, failed, NOW), [retry]) == []
