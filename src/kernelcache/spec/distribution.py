"""Generations to and from OCI registries: where compile Jobs push, and the artifacts a
KernelCache consumes by digest instead of building."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from kernelcache.spec.common import OCI_DIGEST_REF, OCI_REPOSITORY, SPEC_CONFIG, ObjectName


class OciTarget(BaseModel):
    """Where compile Jobs push each published generation, as an image-shaped OCI artifact."""

    model_config = SPEC_CONFIG

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

    model_config = SPEC_CONFIG

    oci: OciTarget | None = Field(
        default=None, description="Push every published generation to an OCI registry."
    )


class OciSource(BaseModel):
    """Generations built elsewhere (another cluster), consumed by digest."""

    model_config = SPEC_CONFIG

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

    model_config = SPEC_CONFIG

    oci: OciSource = Field(description="Artifacts in an OCI registry, by digest.")
