"""Where a KernelCache compiles: the engine image, the GPU classes (arch, nodes, tolerations,
resources) and the registry credentials its compile Jobs pull with."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from kernelcache.spec.common import DIGEST, DNS1123_LABEL, SPEC_CONFIG, Arch, ObjectName, Quantity


class Engine(BaseModel):
    """The serving engine image; warm Jobs run in it so caches match what serving loads."""

    model_config = SPEC_CONFIG

    image: str = Field(min_length=1, description="Serving image the warm Job runs in.")
    image_digest: str | None = Field(
        default=None, pattern=DIGEST, description="Pins the image; recorded in the cache stamp."
    )


class Toleration(BaseModel):
    """A Kubernetes toleration, copied onto the warm Job's pods."""

    model_config = SPEC_CONFIG

    key: str | None = Field(default=None, description="The taint key; empty matches every key.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Equal (the default) matches value; Exists any value."
    )
    value: str | None = Field(default=None, description="The taint value, with operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="The taint effect to tolerate; empty tolerates every effect."
    )
    toleration_seconds: int | None = Field(
        default=None, description="With NoExecute: how long the pod stays once the taint appears."
    )


class Resources(BaseModel):
    """Resource requests and limits of the warm Job's container."""

    model_config = SPEC_CONFIG

    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="What the scheduler reserves, e.g. cpu: 8, memory: 32Gi."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="The most the container may use, e.g. nvidia.com/gpu: 1."
    )


class GpuClass(BaseModel):
    """A kind of GPU node to build for; each arch gets its own cache generation."""

    model_config = SPEC_CONFIG

    name: str = Field(
        max_length=63, pattern=DNS1123_LABEL, description="Unique within the spec; names the Job."
    )
    arch: Arch = Field(description="SM architecture kernels are compiled for, e.g. sm_90a.")
    gpu_product: str | None = Field(
        default=None,
        description=(
            "GPU product name, e.g. 'NVIDIA H200'; scopes autotune results. A build where no "
            "GPU of the arch is visible (compileOn cpu or any-gpu) stamps its tuning with it; "
            "without it such a build publishes no tuning."
        ),
    )
    sm_count: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Streaming multiprocessor count. Kernels sized to the GPU (b12x) embed it, so a "
            "compile off the target GPU needs it."
        ),
    )
    max_active_clusters: int | None = Field(
        default=None,
        ge=1,
        description="Clusters of one CTA resident at once on the GPU; defaults to smCount.",
    )
    compile_on: Literal["target", "any-gpu", "cpu"] = Field(
        default="target",
        description=(
            "Where this class's compile Job runs: a node of the class itself, any GPU node, "
            "or a CPU node (for warmers that cross-compile, such as cute-dsl and b12x)."
        ),
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Labels of the nodes of this class (the compile Job's nodeSelector).",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints of those nodes the compile Job tolerates."
    )
    resources: Resources = Field(
        default_factory=Resources, description="Requests and limits of the compile Job."
    )


class ImagePullSecret(BaseModel):
    """A Secret of this namespace holding registry credentials (a pod's imagePullSecrets)."""

    model_config = SPEC_CONFIG

    name: ObjectName = Field(description="The Secret's name (type kubernetes.io/dockerconfigjson).")
