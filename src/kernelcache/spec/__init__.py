"""The KernelCache custom resource: models and file loader.

The pydantic models are the single source of truth. The CLI validates spec files with them,
the operator parses live objects with them, and the committed CRD is generated from them
(``kernelcache.crd``), so the API server and the tools cannot disagree about what a valid
KernelCache is.

One module per part of the resource: ``common`` (names, patterns, field types), ``cluster``
(engine, GPU classes), ``workloads`` and ``warmers``, ``storage`` (generations and the model
volume), ``verification``, ``distribution``, ``status``, ``resource`` (the spec's cross-field
rules and the object), ``loader`` (file and API object to models), ``describe`` (an error as
one line). Every name is re-exported here: ``from kernelcache.spec import X``.
"""

from __future__ import annotations

from kernelcache.spec.cluster import Engine, GpuClass, ImagePullSecret, Resources, Toleration
from kernelcache.spec.common import (
    ABSOLUTE_PATH,
    API_VERSION,
    ARCH,
    DIGEST,
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    ENTRY_POINT,
    GROUP,
    KIND,
    NAME_MAX,
    OCI_DIGEST_REF,
    OCI_REPOSITORY,
    PATTERN_HINTS,
    PLURAL,
    QUANTITY,
    VERSION,
    Arch,
    EntryPoint,
    ObjectName,
    Quantity,
)
from kernelcache.spec.distribution import Distribution, OciSource, OciTarget, Source
from kernelcache.spec.loader import MAX_SPEC_BYTES, load_kernelcache, parse_kernelcache
from kernelcache.spec.resource import KernelCache, KernelCacheSpec, ObjectMeta
from kernelcache.spec.status import (
    COUNT_MAX,
    KEY_PODS_MAX,
    LEARNED_KEYS_MAX,
    LEARNED_PODS_MAX,
    TIMESTAMP,
    TOKENS_MAX,
    ArchStatus,
    Condition,
    KernelCacheStatus,
    LearnedKey,
    LearnedStatus,
    NodeStatus,
)
from kernelcache.spec.storage import (
    ModelClaim,
    ModelConfigMap,
    ModelImage,
    ModelVolume,
    PvcTemplate,
    Retention,
    Storage,
)
from kernelcache.spec.verification import PUBLIC_KEY_FILE, SIGNING_KEY_FILE, Signing, Verification
from kernelcache.spec.warmers import WARMER_TYPES, Warmer, WarmerType
from kernelcache.spec.workloads import (
    VLLM_DEFAULT_TOKEN_BUDGET,
    B12xWorkload,
    MoeTuning,
    VllmWorkload,
)

__all__ = [
    "ABSOLUTE_PATH",
    "API_VERSION",
    "ARCH",
    "COUNT_MAX",
    "DIGEST",
    "DNS1123_LABEL",
    "DNS1123_SUBDOMAIN",
    "ENTRY_POINT",
    "GROUP",
    "KEY_PODS_MAX",
    "KIND",
    "LEARNED_KEYS_MAX",
    "LEARNED_PODS_MAX",
    "MAX_SPEC_BYTES",
    "NAME_MAX",
    "OCI_DIGEST_REF",
    "OCI_REPOSITORY",
    "PATTERN_HINTS",
    "PLURAL",
    "PUBLIC_KEY_FILE",
    "QUANTITY",
    "SIGNING_KEY_FILE",
    "TIMESTAMP",
    "TOKENS_MAX",
    "VERSION",
    "VLLM_DEFAULT_TOKEN_BUDGET",
    "WARMER_TYPES",
    "Arch",
    "ArchStatus",
    "B12xWorkload",
    "Condition",
    "Distribution",
    "Engine",
    "EntryPoint",
    "GpuClass",
    "ImagePullSecret",
    "KernelCache",
    "KernelCacheSpec",
    "KernelCacheStatus",
    "LearnedKey",
    "LearnedStatus",
    "ModelClaim",
    "ModelConfigMap",
    "ModelImage",
    "ModelVolume",
    "MoeTuning",
    "NodeStatus",
    "ObjectMeta",
    "ObjectName",
    "OciSource",
    "OciTarget",
    "PvcTemplate",
    "Quantity",
    "Resources",
    "Retention",
    "Signing",
    "Source",
    "Storage",
    "Toleration",
    "Verification",
    "VllmWorkload",
    "Warmer",
    "WarmerType",
    "load_kernelcache",
    "parse_kernelcache",
]
