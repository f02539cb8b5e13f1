"""A warmer of the spec: its type (one per toolchain that provides it), the fields each type
needs, the GPU classes it compiles for, and its workload checked as that type reads it."""

from __future__ import annotations

import builtins
from typing import Any, Literal, TypeVar, get_args

from pydantic import BaseModel, Field, ValidationError, model_validator

from kernelcache.spec.cluster import GpuClass
from kernelcache.spec.common import SPEC_CONFIG, EntryPoint, rule_error
from kernelcache.spec.describe import describe, first_error
from kernelcache.spec.workloads import B12xWorkload, VllmWorkload

# The warmer types of the API, one per value of ``spec.warmers[].type`` (the CRD enumerates
# them); each is provided by a toolchain module (``kernelcache.toolchains``; a test ties the two).
WarmerType = Literal["cute-dsl", "triton", "torch-compile", "flashinfer", "b12x", "vllm", "command"]
WARMER_TYPES: tuple[str, ...] = get_args(WarmerType)

_Workload = TypeVar("_Workload", B12xWorkload, VllmWorkload)


class Warmer(BaseModel):
    """One way of compiling kernels: Python entry points of a toolchain, or a command."""

    model_config = SPEC_CONFIG

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
                    raise rule_error(name, f"not allowed for a {self.type} warmer")
            if self.type == "b12x":
                self.b12x_workload()
            else:
                self.vllm_workload()
        elif self.type != "command":
            if not self.entry_points:
                raise rule_error("entryPoints", f"required for a {self.type} warmer")
            if self.command:
                raise rule_error("command", f"not allowed for a {self.type} warmer")
        else:
            if not self.command:
                raise rule_error("command", "required for a command warmer")
            if self.entry_points:
                raise rule_error("entryPoints", "not allowed for a command warmer")
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
            path, what = describe(first_error(exc.errors()), model)
            raise rule_error(f"workload.{path}" if path else "workload", what) from None
