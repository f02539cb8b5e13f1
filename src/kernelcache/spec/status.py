"""The status the operator writes: each arch's build, conditions, nodes' prefetched copies
and what serving learned. Open to fields a newer operator adds."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from kernelcache.spec.common import ARCH, DNS1123_SUBDOMAIN, PATTERN_HINTS, STATUS_CONFIG


class ArchStatus(BaseModel):
    """Progress and result of one arch's build."""

    model_config = STATUS_CONFIG

    arch: str = Field(  # as written by an operator that may know newer arches
        pattern=ARCH, description="The SM arch."
    )
    phase: Literal["Pending", "Compiling", "Ready", "Failed"] = Field(
        description="Pending: no Job yet; Compiling: its Job runs; Ready: published; Failed."
    )
    generation: str | None = Field(default=None, description="The generation published.")
    stamp_digest: str | None = Field(
        default=None, description="Digest of its stamp (`kernelcache explain` compares them)."
    )
    artifacts: int | None = Field(default=None, description="Files in the generation.")
    bytes: int | None = Field(default=None, description="Bytes in the generation.")
    compile_seconds: float | None = Field(default=None, description="Seconds the warm took.")
    signed_by: str | None = Field(
        default=None, description="Fingerprint of the key that signed the generation."
    )
    message: str | None = Field(default=None, description="Why it failed, in one line.")
    artifact: str | None = Field(
        default=None,
        description="The generation as an OCI artifact, repo@sha256:... (pushed by the "
        "compile Job, or consumed from spec.source).",
    )
    coverage_gaps: list[str] | None = Field(
        default=None,
        description="Kernels the warm still met after ready, named (family: kernel (the "
        "batch)): the generation serves, and strict serving with requireFullCoverage "
        "refuses it.",
    )
    engine_image: str | None = Field(
        default=None,
        description="The engine image the generation was built for: pods on it load this "
        "generation while a new spec.engine.image builds.",
    )


class Condition(BaseModel):
    """A standard Kubernetes condition."""

    model_config = STATUS_CONFIG

    type: str = Field(description="What the condition is about, e.g. Ready.")
    status: Literal["True", "False", "Unknown"] = Field(description="Whether it holds.")
    reason: str | None = Field(default=None, description="One CamelCase word saying why.")
    message: str | None = Field(default=None, description="Why, for a person.")
    last_transition_time: str | None = Field(
        default=None, description="When status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, description="The metadata.generation the condition was computed from."
    )


class NodeStatus(BaseModel):
    """One node's prefetched copy of one arch (node-local prefetch)."""

    model_config = STATUS_CONFIG

    node: str = Field(description="The node.")
    arch: str = Field(pattern=ARCH, description="The SM arch of its GPU class.")
    phase: Literal["Ready", "Pulling", "Failed"] = Field(
        description="Ready: the current generation is on its disk; Pulling: being fetched; "
        "Failed: the last fetch failed (it is retried)."
    )
    message: str | None = Field(default=None, description="Why it failed, in one line.")


# What a serving pod reports is untrusted: every number and string of it is bounded here, so
# the API server refuses what the operator would never write (and the operator's own parse,
# ``kernelcache.learned``, refuses it first, naming the field).
# Counts stop at the largest integer a float64 holds exactly: the API server keeps a schema's
# maximum as a float64 (2**63 - 1 rounds up past int64), and JSON readers parse counts as
# doubles.
COUNT_MAX = 2**53 - 1
# No engine runs a forward of more tokens than an int32 indexes; a KernelCache's vllm warmers
# bound them further (``VllmWorkload.max_forward_tokens``).
TOKENS_MAX = 2**31 - 1
# Distinct keys a status holds (``learned.LIMIT``; a test ties the two), and the pods each key
# is attributed to.
LEARNED_KEYS_MAX = 256
KEY_PODS_MAX = 8
LEARNED_PODS_MAX = 512
# An RFC 3339 time as the operator and the runtime write it (seconds, UTC, "Z"), nothing else:
# a free-text time let one pod grow a status by megabytes.
TIMESTAMP = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$"
PATTERN_HINTS[TIMESTAMP] = "a UTC time such as 2026-12-01T08:00:00Z"
PodName = Annotated[str, Field(max_length=253, pattern=DNS1123_SUBDOMAIN)]


class LearnedKey(BaseModel):
    """One specialization serving compiled that its generation lacked (``kernelcache.learned``)."""

    model_config = STATUS_CONFIG

    toolchain: str = Field(max_length=64, description="The toolchain that compiled it.")
    kernel: str = Field(max_length=200, description="The kernel (function or module) name.")
    key: str | None = Field(
        default=None, max_length=200, description="Its specialization key (Triton's hash)."
    )
    tokens: int | None = Field(
        default=None,
        ge=1,
        le=TOKENS_MAX,
        description="The token count of the vLLM forward it was met in (at most the engine's "
        "maxNumBatchedTokens).",
    )
    count: int = Field(
        default=1, ge=1, le=COUNT_MAX, description="Times it was met, summed over pods."
    )
    first_seen: str | None = Field(
        default=None, max_length=20, pattern=TIMESTAMP, description="When first met (UTC)."
    )
    pods: list[PodName] = Field(
        default_factory=list,
        max_length=KEY_PODS_MAX,
        description="The pods that reported it (set by the operator): a key ages out once "
        "none of them exists.",
    )
    gone_since: str | None = Field(
        default=None,
        max_length=20,
        pattern=TIMESTAMP,
        description="When the last of its pods went (set by the operator): it ages out "
        "learnForgetSeconds later unless a pod reports it again.",
    )


class LearnedStatus(BaseModel):
    """What serving pods compiled after they were ready: the next build warms it."""

    model_config = STATUS_CONFIG

    keys: list[LearnedKey] = Field(
        default_factory=list,
        max_length=LEARNED_KEYS_MAX,
        description="Distinct keys, bounded, each pod a fair share.",
    )
    dropped: int = Field(default=0, ge=0, le=COUNT_MAX, description="Keys left out past the bound.")
    pods: list[PodName] = Field(
        default_factory=list, max_length=LEARNED_PODS_MAX, description="The pods last read from."
    )
    updated_at: str | None = Field(
        default=None, max_length=20, pattern=TIMESTAMP, description="When keys last changed."
    )


class KernelCacheStatus(BaseModel):
    """Observed state, written by the operator."""

    model_config = STATUS_CONFIG

    phase: Literal["Pending", "Compiling", "Ready", "Failed", "Degraded"] | None = Field(
        default=None,
        description="Ready: every arch published; Degraded: some; Failed: a spec or Job error.",
    )
    observed_generation: int | None = Field(
        default=None, description="The metadata.generation this status describes."
    )
    ready_arches: str | None = Field(default=None, description="Ready arches out of all, e.g. 2/3.")
    serving_arches: str | None = Field(
        default=None,
        description="Arches whose store names a generation pods load now, out of all, e.g. 2/3.",
    )
    arches: list[ArchStatus] = Field(default_factory=list, description="One entry per arch.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Standard conditions (Ready)."
    )
    nodes: list[NodeStatus] = Field(
        default_factory=list,
        description="With node-local prefetch: each GPU node's copy of its arch's generation.",
    )
    learned: LearnedStatus | None = Field(
        default=None, description="Specializations serving compiled: the next build warms them."
    )
