"""The workloads of the warmers that drive an engine themselves: the b12x MoE layer and the
vLLM engine with its traffic, each checked against itself (sizes, lengths, the cache root)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from kernelcache.spec.common import ABSOLUTE_PATH, SPEC_CONFIG, rule_error


class B12xWorkload(BaseModel):
    """The MoE layer a b12x warmer compiles for, as the serving engine configures it."""

    model_config = SPEC_CONFIG

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
            raise rule_error(
                "intermediateSize",
                f"{self.intermediate_size} does not split into {self.tensor_parallel} slices",
            )
        if self.top_k > self.experts:
            raise rule_error("topK", f"{self.top_k} is more than the {self.experts} experts")
        if (too_big := max(self.batch_sizes)) > self.max_num_tokens:
            raise rule_error(
                "batchSizes", f"{too_big} is more than maxNumTokens ({self.max_num_tokens})"
            )
        return self

    @property
    def intermediate_per_slice(self) -> int:
        return self.intermediate_size // self.tensor_parallel


VLLM_DEFAULT_TOKEN_BUDGET = 16384


class MoeTuning(BaseModel):
    """Tuning vLLM's fused-MoE Triton configs on the compile Job's GPU (``toolchains.vllm.
    tuning``): what vLLM runs its MoE layers with where it ships no table for the shape and
    GPU product, measured instead of guessed."""

    model_config = SPEC_CONFIG

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

    model_config = SPEC_CONFIG

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
        description="Fresh engine processes at most: a cold one, one that enumerates the "
        "coverage, then ones set up as serving until one meets no JIT; what the last still "
        "meets is named in the generation as a coverage gap.",
    )
    require_full_coverage: bool = Field(
        default=False,
        description="Strict serving refuses, before ready, a generation whose warm named "
        "coverage gaps (kernels still loaded after ready); otherwise it serves it, says so and "
        "counts what compiles. Either way the gaps show in status (CoverageComplete).",
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
            raise rule_error(
                "promptLengths",
                f"{longest} + maxTokens {self.max_tokens} is more than maxModelLen "
                f"({self.max_model_len})",
            )
        if self.max_num_seqs is not None and max(self.batch_sizes) > self.max_num_seqs:
            raise rule_error(
                "batchSizes",
                f"{max(self.batch_sizes)} is more than maxNumSeqs ({self.max_num_seqs})",
            )
        return self

    def max_forward_tokens(self) -> int:
        """The most tokens one forward of this engine runs: maxNumBatchedTokens, else vLLM's
        largest default budget (16384, its offline default on large GPUs) or maxModelLen when
        longer (a prompt not chunked runs whole). A learned token count above it is no
        forward of this engine."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(VLLM_DEFAULT_TOKEN_BUDGET, self.max_model_len)

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
