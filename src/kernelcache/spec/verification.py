"""How a consumer checks a generation: the tuning policy and manifest signing (with the key
names of the signing Secret)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from kernelcache.spec.common import SPEC_CONFIG, ObjectName, rule_error

# The key names of the signing Secret: what `kernelcache keygen` writes, the compile Job
# mounts (the private key) and the webhook projects into serving pods (the public key only).
SIGNING_KEY_FILE = "kernelcache.key"
PUBLIC_KEY_FILE = "kernelcache.pub"


class Signing(BaseModel):
    """Manifest signing; the key is read from a Secret."""

    model_config = SPEC_CONFIG

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
            raise rule_error("secretName", "required when enabled is true")
        return self


class Verification(BaseModel):
    """How strictly a consumer checks a generation before using it."""

    model_config = SPEC_CONFIG

    policy: Literal["strict", "permissive"] = Field(
        default="strict",
        description=(
            "Autotune results stamped for another GPU product: strict refuses the pod, "
            "permissive drops them with a warning and a metric. Integrity and signature "
            "failures always refuse."
        ),
    )
    signing: Signing = Field(default=Signing(), description="Manifest signing.")
