"""The KernelCache custom resource: models and file loader.

The pydantic models are the single source of truth. The CLI validates spec files with them,
the operator parses live objects with them, and the committed CRD is generated from them
(``kernelcache.crd``), so the API server and the tools cannot disagree about what a valid
KernelCache is.
"""

from __future__ import annotations

import builtins
import difflib
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import ErrorDetails, PydanticCustomError

from kernelcache.arch import arch_problem
from kernelcache.documents import check_depth, depth_guard
from kernelcache.errors import SpecError

GROUP = "kernelcache.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KernelCache"
PLURAL = "kernelcaches"

DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ARCH = r"^sm_[0-9]{2,3}[af]?$"
# A KernelCache's name is a label value on its serving pods (at most 63 characters).
NAME_MAX = 63
DIGEST = r"^sha256:[0-9a-f]{64}$"
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
ENTRY_POINT = rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$"
# Kubernetes' resource.Quantity grammar (as controller-gen writes it into CRDs), without
# the minus sign: no request, limit or volume size is negative.
QUANTITY = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# The API server refuses bodies near this size (etcd's request limit): refuse such a file
# before parsing it, rather than after minutes of YAML.
MAX_SPEC_BYTES = 1536 * 1024

# A raw regex is a poor error message; say what was expected instead.
PATTERN_HINTS = {
    DNS1123_LABEL: "a DNS-1123 label (lowercase letters, digits and '-')",
    DNS1123_SUBDOMAIN: "a DNS-1123 name (lowercase letters, digits, '-' and '.')",
    ARCH: "an SM arch such as sm_90a, sm_100a, sm_120a or sm_89",
    DIGEST: "an image digest of the form sha256:<64 hex digits>",
    ENTRY_POINT: "an entry point of the form module:function or module:obj.attr",
    QUANTITY: "a Kubernetes quantity such as 20Gi or 500m",
}


def _known_arch(value: str) -> str:
    if (problem := arch_problem(value)) is not None:
        raise PydanticCustomError("unknown_arch", "{problem}", {"problem": problem})
    return value


def _quantity_text(value: Any) -> Any:
    """``nvidia.com/gpu: 1`` as in a Pod: a whole number is a quantity too (kept as text).
    A fraction must be written as text, as the API server takes only integer or string."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        hint = " (write it as a string)" if isinstance(value, float) else ""
        raise PydanticCustomError(
            "quantity_type",
            "expected a Kubernetes quantity such as 20Gi or 500m, got {got}{hint}",
            {"got": repr(value), "hint": hint},
        )
    return value


Arch = Annotated[str, Field(pattern=ARCH), AfterValidator(_known_arch)]
Quantity = Annotated[
    str,
    BeforeValidator(_quantity_text),
    Field(pattern=QUANTITY),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
EntryPoint = Annotated[str, Field(pattern=ENTRY_POINT)]
# The name of another object the compile Job's pod refers to (a Secret, a claim): the API
# server refuses anything else there, after the Job was made, so it is refused here first.
ObjectName = Annotated[str, Field(max_length=253, pattern=DNS1123_SUBDOMAIN)]

# strict: the API server rejects "132" for an integer, so the CLI must too.
_SPEC_CONFIG = ConfigDict(
    alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True
)
# Status is written by the operator; an older reader must not choke on newer fields.
_STATUS_CONFIG = ConfigDict(
    alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=True
)


def _rule_error(field: str, detail: str) -> PydanticCustomError:
    """A cross-field error that names the offending field below the model's own location."""
    return PydanticCustomError("spec_rule", "{detail}", {"field": field, "detail": detail})


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


class Engine(BaseModel):
    """The serving engine image; warm Jobs run in it so caches match what serving loads."""

    model_config = _SPEC_CONFIG

    image: str = Field(min_length=1, description="Serving image the warm Job runs in.")
    image_digest: str | None = Field(
        default=None, pattern=DIGEST, description="Pins the image; recorded in the cache stamp."
    )


class Toleration(BaseModel):
    """A Kubernetes toleration, copied onto the warm Job's pods."""

    model_config = _SPEC_CONFIG

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

    model_config = _SPEC_CONFIG

    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="What the scheduler reserves, e.g. cpu: 8, memory: 32Gi."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="The most the container may use, e.g. nvidia.com/gpu: 1."
    )


class GpuClass(BaseModel):
    """A kind of GPU node to build for; each arch gets its own cache generation."""

    model_config = _SPEC_CONFIG

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


# The warmer types of the API, one per value of ``spec.warmers[].type`` (the CRD enumerates
# them); each is provided by a toolchain module (``kernelcache.toolchains``; a test ties the two).
WarmerType = Literal["cute-dsl", "triton", "torch-compile", "flashinfer", "b12x", "vllm", "command"]
WARMER_TYPES: tuple[str, ...] = get_args(WarmerType)


class B12xWorkload(BaseModel):
    """The MoE layer a b12x warmer compiles for, as the serving engine configures it."""

    model_config = _SPEC_CONFIG

    experts: int = Field(ge=1, description="Experts of the model (global).")
    top_k: int = Field(ge=1, description="Experts routed per token.")
    hidden_size: int = Field(ge=128, multiple_of=128, description="The model's hidden size.")
    intermediate_size: int = Field(ge=16, description="The model's, before tensor parallelism.")
    tensor_parallel: int = Field(default=1, ge=1, description="Intermediate-size slices.")
    local_experts: int | None = Field(default=None, ge=1, description="Expert parallelism.")
    activation: Literal["silu", "gelu_tanh", "swigluoai_uninterleave", "relu2"] = Field(
        default="silu", description="The experts' activation."
    )
    quantization: Literal["nvfp4", "mxfp4", "w4a16"] = Field(
        default="nvfp4", description="The experts' weight format."
    )
    max_num_tokens: int = Field(
        default=4096,
        ge=1,
        description="The engine's MoE chunk size (vLLM: VLLM_MOE_DP_CHUNK_SIZE).",
    )
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(
        min_length=1, description="Token counts per forward the engine serves (m)."
    )
    compile_workers: int | None = Field(
        default=None, ge=1, description="Parallel compile processes; default: one per CPU."
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> B12xWorkload:
        if self.intermediate_size % self.tensor_parallel:
            raise _rule_error(
                "intermediateSize",
                f"{self.intermediate_size} does not split into {self.tensor_parallel} slices",
            )
        if self.top_k > self.experts:
            raise _rule_error("topK", f"{self.top_k} is more than the {self.experts} experts")
        if (too_big := max(self.batch_sizes)) > self.max_num_tokens:
            raise _rule_error(
                "batchSizes", f"{too_big} is more than maxNumTokens ({self.max_num_tokens})"
            )
        return self

    @property
    def intermediate_per_slice(self) -> int:
        return self.intermediate_size // self.tensor_parallel


ABSOLUTE_PATH = r"^/[^\x00]*$"
PATTERN_HINTS[ABSOLUTE_PATH] = "an absolute path such as /var/cache/vllm"


class MoeTuning(BaseModel):
    """Tuning vLLM's fused-MoE Triton configs on the compile Job's GPU (``toolchains.vllm.
    tuning``): what vLLM runs its MoE layers with where it ships no table for the shape and
    GPU product, measured instead of guessed."""

    model_config = _SPEC_CONFIG

    mode: Literal["auto", "always", "off"] = Field(
        default="auto",
        description="auto: the MoE shapes vLLM ships no config for on the Job's GPU product; "
        "always: every shape, vLLM's shipped config as the baseline to beat; off: none.",
    )
    budget_seconds: int = Field(
        default=600,
        ge=10,
        le=7200,
        description="Seconds the search may take in all (compiles included); the Job's log "
        "shows each batch bucket as it is tuned.",
    )


class VllmWorkload(BaseModel):
    """The engine a vllm warmer starts, as the serving pod starts it, and the traffic it sees.

    The engine arguments are vLLM's own (``LLM(...)``/``vllm serve`` flags); every one of
    them that vLLM hashes into its compile cache must be the same in serving, so they are
    part of the workload factor. ``cacheRoot`` is where vLLM's cache lives in the compile Job
    and in the serving pod alike: vLLM writes absolute paths into its artifacts.
    """

    model_config = _SPEC_CONFIG

    model: str = Field(
        min_length=1,
        description="What the engine is given as --model: a directory the image or a volume "
        "holds (weights, or only config.json with loadFormat dummy), or a hub name.",
    )
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        default="auto", description="dummy: random weights, enough to compile every kernel."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    tensor_parallel_size: int = Field(default=1, ge=1)
    max_model_len: int = Field(ge=16, description="The engine's --max-model-len.")
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    max_num_seqs: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    skip_tokenizer_init: bool = Field(
        default=False, description="For a model directory without a tokenizer."
    )
    attention_backend: str | None = Field(
        default=None,
        pattern=r"^[A-Z0-9_]+$",
        description="vLLM's --attention-backend (FLASHINFER, FLASH_ATTN, ...); unset: vLLM picks.",
    )
    compilation_config: dict[str, Any] = Field(
        default_factory=dict, description="vLLM's --compilation-config, as JSON."
    )
    cache_root: str = Field(
        default="/var/cache/vllm",
        pattern=ABSOLUTE_PATH,
        description="VLLM_CACHE_ROOT in the compile Job and the serving pod: the same path.",
    )
    prompt_lengths: list[Annotated[int, Field(ge=1)]] = Field(
        min_length=1, description="Prompt lengths (tokens) serving will see, smallest to largest."
    )
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(
        min_length=1, description="Concurrent requests serving will see."
    )
    max_tokens: int = Field(default=16, ge=1, description="Tokens generated per request.")
    max_passes: int = Field(
        default=3,
        ge=2,
        le=6,
        description="Fresh engine processes at most; the last must meet no JIT at all.",
    )
    moe_tuning: MoeTuning = Field(
        default_factory=MoeTuning,
        description="Fused-MoE configs tuned for the GPU product the compile Job runs on; "
        "kept in the generation and read by serving (VLLM_TUNED_CONFIG_FOLDER).",
    )
    vllm_version_check: Literal["refuse", "warn"] = Field(
        default="refuse",
        description="A vLLM outside the range the vllm toolchain supports (docs/vllm.md): "
        "refuse (the warm and each serving start stop, naming the version and the range) or "
        "warn (tried anyway, with a warning; strict mode still refuses what it refuses).",
    )

    @model_validator(mode="after")
    def _check_lengths(self) -> VllmWorkload:
        if (longest := max(self.prompt_lengths)) + self.max_tokens > self.max_model_len:
            raise _rule_error(
                "promptLengths",
                f"{longest} + maxTokens {self.max_tokens} is more than maxModelLen "
                f"({self.max_model_len})",
            )
        if self.max_num_seqs is not None and max(self.batch_sizes) > self.max_num_seqs:
            raise _rule_error(
                "batchSizes",
                f"{max(self.batch_sizes)} is more than maxNumSeqs ({self.max_num_seqs})",
            )
        if self.cache_root.rstrip("/") == "":
            raise _rule_error("cacheRoot", "must not be the filesystem root")
        return self

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` (vLLM's ``EngineArgs``), unset ones left out."""
        args = {
            "model": self.model,
            "load_format": self.load_format,
            "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "attention_backend": self.attention_backend,
            "compilation_config": self.compilation_config or None,
        }
        return {name: value for name, value in args.items() if value is not None}


_Workload = TypeVar("_Workload", B12xWorkload, VllmWorkload)


class Warmer(BaseModel):
    """One way of compiling kernels: Python entry points of a toolchain, or a command."""

    model_config = _SPEC_CONFIG

    type: WarmerType = Field(
        description="The toolchain driven; docs/warmers/<type>.md shows each with a worked spec."
    )
    entry_points: list[EntryPoint] = Field(
        default_factory=list,
        description="All but command: functions called with the workload that compile kernels.",
    )
    command: list[str] = Field(default_factory=list, description="command only: argv to run.")
    expect: list[str] = Field(
        default_factory=list,
        description=(
            "Artifacts that must appear, by name (a Triton kernel's autotune result, a "
            "FlashInfer module or tactics file); a declared one missing fails the warm."
        ),
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment of the warm; the cache variables cannot be overridden.",
    )
    workload: dict[str, Any] = Field(
        default_factory=dict, description="Free-form JSON passed to the entry points."
    )
    timeout_seconds: int = Field(
        default=3600, ge=1, description="Seconds this warmer may run; past them the warm fails."
    )
    gpu_classes: list[str] = Field(
        default_factory=list,
        description=(
            "Names of the GPU classes this warmer compiles for; empty: every class. One "
            "KernelCache then covers a mixed fleet (b12x for the sm_120a classes, another "
            "warmer for an sm_90a class)."
        ),
    )

    @model_validator(mode="after")
    def _check_type_fields(self) -> Warmer:
        if self.type in ("b12x", "vllm"):  # drive FlashInfer's MoE wrapper, or vLLM itself
            for name, value in (("entryPoints", self.entry_points), ("command", self.command)):
                if value:
                    raise _rule_error(name, f"not allowed for a {self.type} warmer")
            if self.type == "b12x":
                self.b12x_workload()
            else:
                self.vllm_workload()
        elif self.type != "command":
            if not self.entry_points:
                raise _rule_error("entryPoints", f"required for a {self.type} warmer")
            if self.command:
                raise _rule_error("command", f"not allowed for a {self.type} warmer")
        else:
            if not self.command:
                raise _rule_error("command", "required for a command warmer")
            if self.entry_points:
                raise _rule_error("entryPoints", "not allowed for a command warmer")
        return self

    def compiles_for(self, gpu_class: GpuClass) -> bool:
        return not self.gpu_classes or gpu_class.name in self.gpu_classes

    def b12x_workload(self) -> B12xWorkload:
        """The workload of a b12x warmer, checked; errors name ``workload.<field>``."""
        return self._workload_as(B12xWorkload)

    def vllm_workload(self) -> VllmWorkload:
        """The workload of a vllm warmer, checked; errors name ``workload.<field>``."""
        return self._workload_as(VllmWorkload)

    def _workload_as(self, model: builtins.type[_Workload]) -> _Workload:
        try:
            return model.model_validate(self.workload)
        except ValidationError as exc:
            path, what = _describe(exc.errors()[0])
            raise _rule_error(f"workload.{path}" if path else "workload", what) from None


class PvcTemplate(BaseModel):
    """A PersistentVolumeClaim the operator creates to hold the cache generations."""

    model_config = _SPEC_CONFIG

    storage_class_name: str | None = Field(
        default=None, description="The claim's StorageClass; unset: the cluster's default."
    )
    size: Quantity = Field(default="50Gi", description="The claim's requested size.")
    access_modes: list[
        Literal["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]
    ] = Field(
        default=["ReadWriteMany"],
        min_length=1,
        description="ReadWriteMany lets compile Jobs and serving pods on many nodes share it.",
    )


class Storage(BaseModel):
    """Where generations live: an existing claim, or a claim the operator creates."""

    model_config = _SPEC_CONFIG

    existing_claim: ObjectName | None = Field(
        default=None, description="A PersistentVolumeClaim of this namespace to use."
    )
    pvc: PvcTemplate | None = Field(
        default=None, description="A claim the operator creates (default: 50Gi ReadWriteMany)."
    )

    @model_validator(mode="after")
    def _check_exactly_one(self) -> Storage:
        if (self.existing_claim is None) == (self.pvc is None):
            raise _rule_error("", "set exactly one of existingClaim or pvc")
        return self


class Retention(BaseModel):
    """How many published generations to keep, so a rollback has something to load."""

    model_config = _SPEC_CONFIG

    generations: int = Field(
        default=2,
        ge=1,
        le=20,
        description="Generations kept per arch, the current one always among them.",
    )
    delete_data_on_delete: bool = Field(
        default=False, description="Delete the cache data (and a created PVC) with the KernelCache."
    )


# The key names of the signing Secret: what `kernelcache keygen` writes, the compile Job
# mounts (the private key) and the webhook projects into serving pods (the public key only).
SIGNING_KEY_FILE = "kernelcache.key"
PUBLIC_KEY_FILE = "kernelcache.pub"


class Signing(BaseModel):
    """Manifest signing; the key is read from a Secret."""

    model_config = _SPEC_CONFIG

    enabled: bool = Field(
        default=False, description="Sign manifests; consumers then refuse unsigned ones."
    )
    secret_name: ObjectName | None = Field(
        default=None,
        description="Secret holding the key pair `kernelcache keygen` writes; required if enabled.",
    )

    @model_validator(mode="after")
    def _check_secret(self) -> Signing:
        if self.enabled and self.secret_name is None:
            raise _rule_error("secretName", "required when enabled is true")
        return self


class Verification(BaseModel):
    """How strictly a consumer checks a generation before using it."""

    model_config = _SPEC_CONFIG

    policy: Literal["strict", "permissive"] = Field(
        default="strict",
        description=(
            "Autotune results stamped for another GPU product: strict refuses the pod, "
            "permissive drops them with a warning and a metric. Integrity and signature "
            "failures always refuse."
        ),
    )
    signing: Signing = Field(default=Signing(), description="Manifest signing.")


class ImagePullSecret(BaseModel):
    """A Secret of this namespace holding registry credentials (a pod's imagePullSecrets)."""

    model_config = _SPEC_CONFIG

    name: ObjectName = Field(description="The Secret's name (type kubernetes.io/dockerconfigjson).")


# An OCI reference pinned by digest: ``registry/repository@sha256:<64 hex>`` (a tag before
# the digest is allowed and ignored, as container runtimes do). Serving never follows a tag.
OCI_REPOSITORY = r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+$"
OCI_DIGEST_REF = (
    r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?@sha256:[0-9a-f]{64}$"
)
PATTERN_HINTS[OCI_REPOSITORY] = (
    "a repository such as registry.example.com/caches/demo (no tag, no digest)"
)
PATTERN_HINTS[OCI_DIGEST_REF] = (
    "an artifact pinned by digest such as registry.example.com/caches/demo@sha256:<64 hex>"
)


class OciTarget(BaseModel):
    """Where compile Jobs push each published generation, as an image-shaped OCI artifact."""

    model_config = _SPEC_CONFIG

    repository: str = Field(
        max_length=255,
        pattern=OCI_REPOSITORY,
        description="The repository, e.g. registry.example.com/caches/demo; each generation "
        "is pushed under a tag of its arch and id, and recorded by digest in status.",
    )
    push_secret: ObjectName = Field(
        description="A kubernetes.io/dockerconfigjson Secret with push rights, mounted into "
        "the compile Jobs only."
    )
    pull_secret: ObjectName | None = Field(
        default=None,
        description="A kubernetes.io/dockerconfigjson Secret with read rights, for serving "
        "pods and the prefetch DaemonSet (image and pull modes); unset: pushSecret.",
    )

    def reader_secret(self) -> str:
        return self.pull_secret or self.push_secret


class Distribution(BaseModel):
    """Where generations go besides the store."""

    model_config = _SPEC_CONFIG

    oci: OciTarget | None = Field(
        default=None, description="Push every published generation to an OCI registry."
    )


class OciSource(BaseModel):
    """Generations built elsewhere (another cluster), consumed by digest."""

    model_config = _SPEC_CONFIG

    artifacts: dict[str, Annotated[str, Field(max_length=512, pattern=OCI_DIGEST_REF)]] = Field(
        description="Per SM arch, the artifact to serve, pinned by digest "
        "(repo@sha256:..., what the building cluster's status.arches[].artifact says).",
    )
    pull_secret: ObjectName | None = Field(
        default=None,
        description="A kubernetes.io/dockerconfigjson Secret to read the artifacts with; "
        "unset: the registry allows anonymous reads.",
    )


class Source(BaseModel):
    """Where the generations come from instead of this cluster's compile Jobs."""

    model_config = _SPEC_CONFIG

    oci: OciSource = Field(description="Artifacts in an OCI registry, by digest.")


class ModelClaim(BaseModel):
    """A PersistentVolumeClaim of this namespace holding the model."""

    model_config = _SPEC_CONFIG

    claim_name: ObjectName = Field(description="The claim's name.")


class ModelConfigMap(BaseModel):
    """A ConfigMap of this namespace holding the model's small files (config.json), enough
    for vLLM's loadFormat dummy."""

    model_config = _SPEC_CONFIG

    name: ObjectName = Field(description="The ConfigMap's name; each key becomes a file.")


class ModelImage(BaseModel):
    """An OCI image (or artifact) holding the model, mounted as a Kubernetes image volume
    (on by default from 1.35)."""

    model_config = _SPEC_CONFIG

    reference: str = Field(min_length=1, description="The image, e.g. registry.example.com/m:1.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="The volume's pullPolicy; unset: the Kubernetes default."
    )


class ModelVolume(BaseModel):
    """The model mounted read-only into each compile Job: the path a warmer gives the
    engine (vLLM's --model) is a stamp factor, so it must exist there as in serving."""

    model_config = _SPEC_CONFIG

    mount_path: str = Field(
        pattern=ABSOLUTE_PATH,
        description="Where the compile Job's container sees the model: the path serving "
        "mounts it at, e.g. /models/Qwen3-30B-A3B.",
    )
    sub_path: str | None = Field(
        default=None, min_length=1, description="A directory of the volume to mount instead."
    )
    persistent_volume_claim: ModelClaim | None = Field(
        default=None, description="The weights on a claim (ReadOnlyMany or ReadWriteMany)."
    )
    config_map: ModelConfigMap | None = Field(
        default=None, description="Only the model's config, for loadFormat dummy."
    )
    image: ModelImage | None = Field(default=None, description="The model in an OCI image.")

    @model_validator(mode="after")
    def _check_exactly_one(self) -> ModelVolume:
        sources = (self.persistent_volume_claim, self.config_map, self.image)
        if sum(source is not None for source in sources) != 1:
            raise _rule_error("", "set exactly one of persistentVolumeClaim, configMap or image")
        return self

    def volume_source(self) -> dict[str, Any]:
        """The Kubernetes volume source, as a pod's ``volumes[]`` entry holds it."""
        return self.model_dump(
            by_alias=True,
            exclude_none=True,
            include={"persistent_volume_claim", "config_map", "image"},
        )


class KernelCacheSpec(BaseModel):
    """What to compile (model, engine, warmers), for which GPUs, and where to keep it."""

    model_config = _SPEC_CONFIG

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
                raise _rule_error(f"gpuClasses[{i}].name", f"duplicate of gpuClasses[{first}].name")
        warmers: dict[tuple[str, tuple[str, ...], tuple[str, ...], str], int] = {}
        for i, w in enumerate(self.warmers):
            # A vllm warmer is its engine and traffic: two engines are two warmers.
            engine = repr(sorted(w.workload.items())) if w.type == "vllm" else ""
            key = (w.type, tuple(w.entry_points), tuple(w.command), engine)
            if (first := warmers.setdefault(key, i)) != i:
                field = {"cute-dsl": "entryPoints", "vllm": "workload"}.get(w.type, "command")
                raise _rule_error(f"warmers[{i}].{field}", f"duplicate of warmers[{first}]")
        roots: dict[str, int] = {}
        for i, w in enumerate(self.warmers):
            if w.type == "vllm" and roots.setdefault(w.vllm_workload().cache_root, i) != i:
                continue
            if w.type == "vllm" and len(roots) > 1:  # one engine, one VLLM_CACHE_ROOT per pod
                raise _rule_error(
                    f"warmers[{i}].workload.cacheRoot",
                    f"differs from warmers[{min(roots.values())}]'s; a pod has one VLLM_CACHE_ROOT",
                )
        return self

    @model_validator(mode="after")
    def _check_source(self) -> KernelCacheSpec:
        """Consumed generations are built elsewhere: no warmers, one artifact per arch."""
        if self.source is None:
            if not self.warmers:
                raise _rule_error("warmers", "needs at least 1 item(s), got 0")
            return self
        if self.warmers:
            raise _rule_error(
                "warmers", "not allowed with source: its generations are built elsewhere"
            )
        if self.distribution.oci is not None:
            raise _rule_error(
                "distribution.oci", "not allowed with source: nothing is built here to push"
            )
        if self.model_volume is not None:
            raise _rule_error("modelVolume", "not allowed with source: no compile Job runs here")
        given = self.source.oci.artifacts
        for arch in self.arches():
            if arch not in given:
                raise _rule_error(
                    f"source.oci.artifacts.{arch}", "required: a GPU class is " + arch
                )
        for arch in given:
            if arch not in self.arches():
                raise _rule_error(
                    f"source.oci.artifacts.{arch}",
                    f"no GPU class of this arch (arches: {', '.join(self.arches())})",
                )
        return self

    @model_validator(mode="after")
    def _check_model_volume(self) -> KernelCacheSpec:
        """The model's mount and vLLM's writable cache root are two volumes of the Job."""
        model = self.model_volume
        if model is not None and model.mount_path.rstrip("/") in self.vllm_cache_roots():
            raise _rule_error(
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
                    raise _rule_error(
                        f"warmers[{i}].gpuClasses[{j}]",
                        f"no GPU class named {name!r} (gpuClasses: {', '.join(classes)})",
                    )
        for i, gpu_class in enumerate(self.gpu_classes):
            if not any(w.compiles_for(gpu_class) for w in self.warmers):
                raise _rule_error(
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

    def vllm_cache_roots(self) -> list[str]:
        """The vllm warmers' cache roots: writable in the compile Job and the serving pod."""
        return sorted({w.vllm_workload().cache_root for w in self.warmers if w.type == "vllm"})

    def vllm_version_check(self) -> str | None:
        """``warn`` when a vllm warmer asks to try a vLLM outside the supported range, else
        ``refuse`` (None: no vllm warmer)."""
        checks = {w.vllm_workload().vllm_version_check for w in self.warmers if w.type == "vllm"}
        return ("warn" if "warn" in checks else "refuse") if checks else None


class ArchStatus(BaseModel):
    """Progress and result of one arch's build."""

    model_config = _STATUS_CONFIG

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
    engine_image: str | None = Field(
        default=None,
        description="The engine image the generation was built for: pods on it load this "
        "generation while a new spec.engine.image builds.",
    )


class Condition(BaseModel):
    """A standard Kubernetes condition."""

    model_config = _STATUS_CONFIG

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

    model_config = _STATUS_CONFIG

    node: str = Field(description="The node.")
    arch: str = Field(pattern=ARCH, description="The SM arch of its GPU class.")
    phase: Literal["Ready", "Pulling", "Failed"] = Field(
        description="Ready: the current generation is on its disk; Pulling: being fetched; "
        "Failed: the last fetch failed (it is retried)."
    )
    message: str | None = Field(default=None, description="Why it failed, in one line.")


class LearnedKey(BaseModel):
    """One specialization serving compiled that its generation lacked (``kernelcache.learned``)."""

    model_config = _STATUS_CONFIG

    toolchain: str = Field(max_length=64, description="The toolchain that compiled it.")
    kernel: str = Field(max_length=200, description="The kernel (function or module) name.")
    key: str | None = Field(
        default=None, max_length=200, description="Its specialization key (Triton's hash)."
    )
    tokens: int | None = Field(
        default=None, ge=1, description="The token count of the vLLM forward it was met in."
    )
    count: int = Field(default=1, ge=1, description="Times it was met, summed over pods.")
    first_seen: str | None = Field(default=None, description="When first met (RFC 3339).")


class LearnedStatus(BaseModel):
    """What serving pods compiled after they were ready: the next build warms it."""

    model_config = _STATUS_CONFIG

    keys: list[LearnedKey] = Field(default_factory=list, description="Distinct keys, bounded.")
    dropped: int = Field(default=0, ge=0, description="Keys left out past the bound.")
    pods: list[str] = Field(default_factory=list, description="The pods last read from.")
    updated_at: str | None = Field(default=None, description="When keys last changed.")


class KernelCacheStatus(BaseModel):
    """Observed state, written by the operator."""

    model_config = _STATUS_CONFIG

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


class KernelCache(BaseModel):
    """Builds GPU kernel caches ahead of time so serving pods start with them warm."""

    model_config = _SPEC_CONFIG

    api_version: Literal["kernelcache.dev/v1alpha1"] = Field(
        description="The versioned schema of this object: kernelcache.dev/v1alpha1."
    )
    kind: Literal["KernelCache"] = Field(description="KernelCache.")
    metadata: ObjectMeta = Field(description="Standard object metadata (name, namespace).")
    spec: KernelCacheSpec = Field(description="What to build, for which GPUs, kept where.")
    status: KernelCacheStatus | None = Field(
        default=None, description="What the operator observed; written by it alone."
    )


def _format_loc(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", item):
            parts.append(f".{item}" if parts else item)
        else:
            parts.append(f'["{item}"]')  # a map key such as nvidia.com/gpu.product
    return "".join(parts)


def _describe(error: ErrorDetails) -> tuple[str, str]:
    """The camelCase field path and a short explanation of one pydantic error."""
    ctx = error.get("ctx", {})
    path = _format_loc(error["loc"])
    if error["type"] == "spec_rule":
        field = ctx["field"]
        path = f"{path}.{field}" if path and field else path or field
        return path, error["msg"]
    got = error.get("input")
    shown = f", got {got!r:.60}" if isinstance(got, (str, int, float)) else ""
    if error["type"] == "missing":
        return path, "required field is missing"
    if error["type"] == "extra_forbidden":
        return path, "unknown field" + _did_you_mean(error["loc"])
    if error["type"] == "unknown_arch":
        return path, error["msg"]
    if error["type"] == "too_short":
        return path, f"needs at least {ctx['min_length']} item(s), got {ctx['actual_length']}"
    if error["type"] == "string_pattern_mismatch" and ctx.get("pattern") in PATTERN_HINTS:
        return path, f"expected {PATTERN_HINTS[ctx['pattern']]}{shown}"
    if error["type"] == "quantity_type":
        return path, error["msg"]
    return path, error["msg"] + shown


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model whose fields are at ``loc`` (camelCase names, list indices, map keys)."""
    model: type[BaseModel] = KernelCache
    for part in loc:
        if isinstance(part, int):
            continue
        fields = {info.alias or name: info for name, info in model.model_fields.items()}
        if part not in fields:
            return None
        inner = _models_in(fields[part].annotation)
        if not inner:
            return None
        model = inner[0]
    return model


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _did_you_mean(loc: tuple[int | str, ...]) -> str:
    """A hint for an unknown field: the camelCase spelling, or the closest field name."""
    model = _model_at(loc[:-1])
    if model is None or not isinstance(loc[-1], str):
        return ""
    names = [info.alias or name for name, info in model.model_fields.items()]
    if (camel := to_camel(loc[-1])) in names and camel != loc[-1]:
        return f" (fields are camelCase: {camel})"
    close = difflib.get_close_matches(loc[-1], names, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _first_error(errors: list[ErrorDetails]) -> ErrorDetails:
    """The error to report: an unknown field before all else, since a misspelled field is
    also a missing one, and "missing" alone hides the typo."""
    return next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _SpecLoader(yaml.SafeLoader):
    """YAML as the API server reads JSON: a key given twice is an error, not "last wins"."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first at line {seen[key]})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def parse_kernelcache(obj: Any, source: str) -> KernelCache:
    """Validate a KernelCache object (from a file or the API server) or raise SpecError."""
    if not isinstance(obj, dict):
        raise SpecError(
            f"{source}: expected a KernelCache mapping, got {type(obj).__name__}", path=source
        )
    check_depth(obj, source, SpecError)
    try:
        return KernelCache.model_validate(obj, by_alias=True, by_name=False)
    except ValidationError as exc:
        errors = exc.errors()
        path, what = _describe(_first_error(errors))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        where = f"{path}: " if path else ""
        raise SpecError(
            _one_line(f"{source}: {where}{what}{more}"), path=source, field=path or None
        ) from None


def load_kernelcache(path: str | Path) -> KernelCache:
    """Read a one-document KernelCache YAML file; any problem becomes a one-line SpecError."""
    source = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"{source}: cannot read: {exc.strerror or exc}", path=source) from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(
            f"{source}: larger than {MAX_SPEC_BYTES // 1024} KiB, more than the API server "
            "accepts for one object",
            path=source,
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{source}: not UTF-8 text", path=source) from None
    try:
        with depth_guard(source, SpecError):
            docs = [doc for doc in yaml.load_all(text, Loader=_SpecLoader) if doc is not None]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        message = f"{source}: {where}YAML syntax error: {exc.problem or exc.context}"
        raise SpecError(_one_line(message), path=source) from None
    except yaml.YAMLError as exc:
        raise SpecError(_one_line(f"{source}: YAML error: {exc}"), path=source) from None
    if len(docs) != 1:
        raise SpecError(
            f"{source}: expected exactly one YAML document, found {len(docs)}", path=source
        )
    return parse_kernelcache(docs[0], source)
