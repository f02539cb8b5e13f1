"""The KernelCache resource: its metadata, its spec (the rules that span its parts) and the
object as the API server holds it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from kernelcache.spec.cluster import Engine, GpuClass, ImagePullSecret
from kernelcache.spec.common import (
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    NAME_MAX,
    SPEC_CONFIG,
    rule_error,
)
from kernelcache.spec.distribution import Distribution, Source
from kernelcache.spec.status import KernelCacheStatus
from kernelcache.spec.storage import ModelVolume, PvcTemplate, Retention, Storage
from kernelcache.spec.verification import Verification
from kernelcache.spec.warmers import Warmer


class ObjectMeta(BaseModel):
    """Kubernetes object metadata; server-set keys (uid, resourceVersion, ...) pass through."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="allow", strict=True
    )

    # A serving pod names its KernelCache in a label, and label values stop at 63.
    name: str = Field(max_length=NAME_MAX, pattern=DNS1123_SUBDOMAIN)
    namespace: str = Field(default="default", max_length=63, pattern=DNS1123_LABEL)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class KernelCacheSpec(BaseModel):
    """What to compile (model, engine, warmers), for which GPUs, and where to keep it."""

    model_config = SPEC_CONFIG

    model: str = Field(min_length=1, description="The served model, e.g. Qwen/Qwen3-30B-A3B.")
    engine: Engine = Field(description="The serving engine image the compile Jobs run in.")
    image_pull_secrets: list[ImagePullSecret] = Field(
        default_factory=list,
        description="Secrets the compile Jobs pull spec.engine.image with (a private registry); "
        "serving pods keep their own.",
    )
    gpu_classes: list[GpuClass] = Field(
        min_length=1, description="The kinds of GPU node to build for; one generation per arch."
    )
    warmers: list[Warmer] = Field(
        default_factory=list,
        description="How kernels are compiled, run in order in each compile Job; required "
        "unless source names generations built elsewhere.",
    )
    storage: Storage = Field(
        default=Storage(pvc=PvcTemplate()), description="Where the generations are kept."
    )
    retention: Retention = Field(default=Retention(), description="How many generations to keep.")
    verification: Verification = Field(
        default=Verification(), description="How serving pods check a generation before use."
    )
    distribution: Distribution = Field(
        default=Distribution(), description="Where generations go besides the store (OCI)."
    )
    model_volume: ModelVolume | None = Field(
        default=None,
        description="Mount the model into the compile Jobs (read-only), where a warmer's "
        "model path must exist: a claim, a ConfigMap or an image volume.",
    )
    source: Source | None = Field(
        default=None,
        description="Consume generations built elsewhere, by digest: no compile Job runs; "
        "each node's init-container still checks the stamp against the node and pod.",
    )

    @model_validator(mode="after")
    def _check_unique(self) -> KernelCacheSpec:
        names: dict[str, int] = {}
        for i, gpu_class in enumerate(self.gpu_classes):
            if (first := names.setdefault(gpu_class.name, i)) != i:
                raise rule_error(f"gpuClasses[{i}].name", f"duplicate of gpuClasses[{first}].name")
        warmers: dict[tuple[str, tuple[str, ...], tuple[str, ...], str], int] = {}
        for i, w in enumerate(self.warmers):
            # A vllm warmer is its engine and traffic: two engines are two warmers.
            engine = repr(sorted(w.workload.items())) if w.type == "vllm" else ""
            key = (w.type, tuple(w.entry_points), tuple(w.command), engine)
            if (first := warmers.setdefault(key, i)) != i:
                field = {"cute-dsl": "entryPoints", "vllm": "workload"}.get(w.type, "command")
                raise rule_error(f"warmers[{i}].{field}", f"duplicate of warmers[{first}]")
        roots: dict[str, int] = {}
        for i, w in enumerate(self.warmers):
            if w.type == "vllm" and roots.setdefault(w.vllm_workload().cache_root, i) != i:
                continue
            if w.type == "vllm" and len(roots) > 1:  # one engine, one VLLM_CACHE_ROOT per pod
                raise rule_error(
                    f"warmers[{i}].workload.cacheRoot",
                    f"differs from warmers[{min(roots.values())}]'s; a pod has one VLLM_CACHE_ROOT",
                )
        return self

    @model_validator(mode="after")
    def _check_source(self) -> KernelCacheSpec:
        """Consumed generations are built elsewhere: no warmers, one artifact per arch."""
        if self.source is None:
            if not self.warmers:
                raise rule_error("warmers", "needs at least 1 item(s), got 0")
            return self
        if self.warmers:
            raise rule_error(
                "warmers", "not allowed with source: its generations are built elsewhere"
            )
        if self.distribution.oci is not None:
            raise rule_error(
                "distribution.oci", "not allowed with source: nothing is built here to push"
            )
        if self.model_volume is not None:
            raise rule_error("modelVolume", "not allowed with source: no compile Job runs here")
        given = self.source.oci.artifacts
        for arch in self.arches():
            if arch not in given:
                raise rule_error(f"source.oci.artifacts.{arch}", "required: a GPU class is " + arch)
        for arch in given:
            if arch not in self.arches():
                raise rule_error(
                    f"source.oci.artifacts.{arch}",
                    f"no GPU class of this arch (arches: {', '.join(self.arches())})",
                )
        return self

    @model_validator(mode="after")
    def _check_model_volume(self) -> KernelCacheSpec:
        """The model's mount and vLLM's writable cache root are two volumes of the Job."""
        model = self.model_volume
        if model is not None and model.mount_path.rstrip("/") in self.vllm_cache_roots():
            raise rule_error(
                "modelVolume.mountPath", "is a vllm warmer's cacheRoot: the model is read-only"
            )
        return self

    @model_validator(mode="after")
    def _check_warmer_classes(self) -> KernelCacheSpec:
        """Every class a warmer names exists, and every class has a warmer to build it."""
        if self.source is not None:
            return self
        classes = [c.name for c in self.gpu_classes]
        for i, w in enumerate(self.warmers):
            for j, name in enumerate(w.gpu_classes):
                if name not in classes:
                    raise rule_error(
                        f"warmers[{i}].gpuClasses[{j}]",
                        f"no GPU class named {name!r} (gpuClasses: {', '.join(classes)})",
                    )
        for i, gpu_class in enumerate(self.gpu_classes):
            if not any(w.compiles_for(gpu_class) for w in self.warmers):
                raise rule_error(
                    f"gpuClasses[{i}]",
                    f"no warmer compiles for {gpu_class.name!r}: every warmer names other "
                    "classes in its gpuClasses",
                )
        return self

    def warmers_for(self, arch: str) -> list[Warmer]:
        """The warmers that compile for an arch: those naming no class or a class of it."""
        classes = [c for c in self.gpu_classes if c.arch == arch]
        return [w for w in self.warmers if any(w.compiles_for(c) for c in classes)]

    def arches(self) -> list[str]:
        """The distinct arches to build, sorted; one warm Job and generation per arch."""
        return sorted({c.arch for c in self.gpu_classes})

    def max_forward_tokens(self) -> int | None:
        """The most tokens a forward of this KernelCache's engines runs (None: no vllm
        warmer says): what a serving pod may report as a learned key's token count."""
        bounds = [w.vllm_workload().max_forward_tokens() for w in self.warmers if w.type == "vllm"]
        return max(bounds) if bounds else None

    def vllm_cache_roots(self) -> list[str]:
        """The vllm warmers' cache roots: writable in the compile Job and the serving pod."""
        return sorted({w.vllm_workload().cache_root for w in self.warmers if w.type == "vllm"})

    def vllm_version_check(self) -> str | None:
        """``warn`` when a vllm warmer asks to try a vLLM outside the supported range, else
        ``refuse`` (None: no vllm warmer)."""
        checks = {w.vllm_workload().vllm_version_check for w in self.warmers if w.type == "vllm"}
        return ("warn" if "warn" in checks else "refuse") if checks else None


class KernelCache(BaseModel):
    """Builds GPU kernel caches ahead of time so serving pods start with them warm."""

    model_config = SPEC_CONFIG

    api_version: Literal["kernelcache.dev/v1alpha1"] = Field(
        description="The versioned schema of this object: kernelcache.dev/v1alpha1."
    )
    kind: Literal["KernelCache"] = Field(description="KernelCache.")
    metadata: ObjectMeta = Field(description="Standard object metadata (name, namespace).")
    spec: KernelCacheSpec = Field(description="What to build, for which GPUs, kept where.")
    status: KernelCacheStatus | None = Field(
        default=None, description="What the operator observed; written by it alone."
    )
