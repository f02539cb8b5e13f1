"""What every part of the KernelCache API shares: its names, the patterns its strings
follow (each with the hint an error shows instead of the regex), the field types built on
them, and the model configurations of spec (strict, closed) and status (open to newer fields).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from kernelcache.arch import arch_problem

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
SPEC_CONFIG = ConfigDict(
    alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True
)
# Status is written by the operator; an older reader must not choke on newer fields.
STATUS_CONFIG = ConfigDict(
    alias_generator=to_camel, populate_by_name=True, extra="ignore", strict=True
)


def rule_error(field: str, detail: str) -> PydanticCustomError:
    """A cross-field error that names the offending field below the model's own location."""
    return PydanticCustomError("spec_rule", "{detail}", {"field": field, "detail": detail})


# A path segment other than "." and "..", without lookarounds (the API server's schema
# patterns are RE2): it starts with no dot, or a dot and no second dot, or two dots and more.
_SEGMENT = r"([^/.\x00][^/\x00]*|\.[^/.\x00][^/\x00]*|\.\.[^/\x00]+)"
# Where a container mounts a volume: absolute, not "/", no "." or ".." segment, no "//".
ABSOLUTE_PATH = rf"^(/{_SEGMENT})+/?$"
PATTERN_HINTS[ABSOLUTE_PATH] = (
    "an absolute path below / without '.' or '..' segments, such as /var/cache/vllm"
)
# A volume's subPath, as the API server takes it: relative, no "." or ".." segment.
SUB_PATH = rf"^{_SEGMENT}(/{_SEGMENT})*/?$"
PATTERN_HINTS[SUB_PATH] = "a relative path inside the volume without '..', such as models/m"

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
