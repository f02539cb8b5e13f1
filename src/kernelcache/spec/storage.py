"""Where generations are kept (a claim, found or made), how many, and the model volume the
compile Jobs mount read-only."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from kernelcache.spec.common import (
    ABSOLUTE_PATH,
    SPEC_CONFIG,
    SUB_PATH,
    ObjectName,
    Quantity,
    rule_error,
)


class PvcTemplate(BaseModel):
    """A PersistentVolumeClaim the operator creates to hold the cache generations."""

    model_config = SPEC_CONFIG

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

    model_config = SPEC_CONFIG

    existing_claim: ObjectName | None = Field(
        default=None, description="A PersistentVolumeClaim of this namespace to use."
    )
    pvc: PvcTemplate | None = Field(
        default=None, description="A claim the operator creates (default: 50Gi ReadWriteMany)."
    )

    @model_validator(mode="after")
    def _check_exactly_one(self) -> Storage:
        if (self.existing_claim is None) == (self.pvc is None):
            raise rule_error("", "set exactly one of existingClaim or pvc")
        return self


class Retention(BaseModel):
    """How many published generations to keep, so a rollback has something to load."""

    model_config = SPEC_CONFIG

    generations: int = Field(
        default=2,
        ge=1,
        le=20,
        description="Generations kept per arch, the current one always among them.",
    )
    delete_data_on_delete: bool = Field(
        default=False, description="Delete the cache data (and a created PVC) with the KernelCache."
    )


class ModelClaim(BaseModel):
    """A PersistentVolumeClaim of this namespace holding the model."""

    model_config = SPEC_CONFIG

    claim_name: ObjectName = Field(description="The claim's name.")


class ModelConfigMap(BaseModel):
    """A ConfigMap of this namespace holding the model's small files (config.json), enough
    for vLLM's loadFormat dummy."""

    model_config = SPEC_CONFIG

    name: ObjectName = Field(description="The ConfigMap's name; each key becomes a file.")


class ModelImage(BaseModel):
    """An OCI image (or artifact) holding the model, mounted as a Kubernetes image volume
    (on by default from 1.35)."""

    model_config = SPEC_CONFIG

    reference: str = Field(min_length=1, description="The image, e.g. registry.example.com/m:1.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="The volume's pullPolicy; unset: the Kubernetes default."
    )


class ModelVolume(BaseModel):
    """The model mounted read-only into each compile Job: the path a warmer gives the
    engine (vLLM's --model) is a stamp factor, so it must exist there as in serving."""

    model_config = SPEC_CONFIG

    mount_path: str = Field(
        max_length=1024,
        pattern=ABSOLUTE_PATH,
        description="Where the compile Job's container sees the model: the path serving "
        "mounts it at, e.g. /models/Qwen3-30B-A3B.",
    )
    sub_path: str | None = Field(
        default=None,
        max_length=1024,
        pattern=SUB_PATH,
        description="A directory of the volume to mount instead (relative, no '..').",
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
            raise rule_error("", "set exactly one of persistentVolumeClaim, configMap or image")
        return self

    def volume_source(self) -> dict[str, Any]:
        """The Kubernetes volume source, as a pod's ``volumes[]`` entry holds it."""
        return self.model_dump(
            by_alias=True,
            exclude_none=True,
            include={"persistent_volume_claim", "config_map", "image"},
        )
