"""The signing Secret, as the operator follows it: which public keys pods trust, what the
compile Jobs must re-run for, and whether pods would refuse what is published.

A KernelCache with signing names a Secret holding ``kernelcache.key`` (the compile Job signs
with it) and ``kernelcache.pub`` (pods verify with it; during a rotation it holds the old
and the new public key, ``docs/security.md``). The operator watches that Secret:

- an arch whose generation was signed by another key than the Secret's ``kernelcache.key``
  gets a compile Job again (``stale``; its name changes with the Secret's content,
  ``job_identity``), which re-signs the current generation without compiling (``kernelcache
  warm --signing-key --public-key``: a generation signed by a key the Secret still trusts),
  or compiles anew one it cannot vouch for;
- the condition ``SignatureTrusted`` says, per arch, when the generation that is published
  was signed by a key not in ``kernelcache.pub``: pods would refuse it now
  (``trust_condition``); while it does not hold, Ready does not either and the KernelCache
  is Degraded (``state.summarize``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

from kernelcache.controller.kube import ApiError, Kube, path
from kernelcache.errors import SignatureError
from kernelcache.spec import PUBLIC_KEY_FILE, SIGNING_KEY_FILE, KernelCache
from kernelcache.store import fingerprint
from kernelcache.store.signing import parse_private_key, parse_public_keys

CONDITION = "SignatureTrusted"


def secret_name(kc: KernelCache) -> str | None:
    signing = kc.spec.verification.signing
    return signing.secret_name if signing.enabled and signing.secret_name else None


def read_secret(kube: Kube, kc: KernelCache) -> dict[str, Any] | None:
    """The signing Secret's data (base64 values, as the API gives them); None when signing
    is off; an empty dict when the Secret does not exist (yet)."""
    name = secret_name(kc)
    if name is None:
        return None
    try:
        secret = kube.get(path("v1", "secrets", kc.metadata.namespace, name))
    except ApiError as exc:
        if exc.status == 404:
            return {}
        raise
    return dict(secret.get("data") or {})


def job_identity(data: dict[str, Any] | None) -> str | None:
    """What of the Secret a compile Job depends on: a digest of its data (None: no signing)."""
    if data is None:
        return None
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def signs_with(data: dict[str, Any] | None) -> str | None:
    """The fingerprint of the key the compile Jobs sign with (None: none usable; the Job
    then fails, naming it)."""
    encoded = (data or {}).get(SIGNING_KEY_FILE)
    if not encoded:
        return None
    try:
        return fingerprint(parse_private_key(base64.b64decode(encoded), SIGNING_KEY_FILE))
    except (binascii.Error, SignatureError):
        return None


def stale(arch: dict[str, Any] | None, data: dict[str, Any] | None) -> bool:
    """Whether an arch's published generation was signed by another key than the Secret's
    own: its Job runs again, to re-sign it."""
    key = signs_with(data)
    return bool(arch and arch.get("generation") and key and arch.get("signedBy") != key)


def trusted(data: dict[str, Any] | None) -> tuple[list[str], str | None]:
    """(the fingerprints of the public keys pods verify with, why there are none)."""
    if data is None:
        return [], None
    encoded = data.get(PUBLIC_KEY_FILE)
    if not encoded:
        return [], f"the signing Secret has no {PUBLIC_KEY_FILE}"
    try:
        keys = parse_public_keys(base64.b64decode(encoded), f"Secret data {PUBLIC_KEY_FILE}")
    except (binascii.Error, SignatureError) as exc:
        return [], f"the signing Secret's {PUBLIC_KEY_FILE} is unusable: {exc}"
    return [fingerprint(k) for k in keys], None


def trust_condition(
    kc: KernelCache, arches: list[dict[str, Any]], data: dict[str, Any] | None
) -> tuple[str, bool, str, str] | None:
    """``SignatureTrusted`` as (type, holds, reason, message); None without signing.

    False when an arch's published generation was signed by a key not in kernelcache.pub
    (or not signed, or the Secret has no usable public key): pods would refuse it.
    """
    if secret_name(kc) is None:
        return None
    prints, problem = trusted(data)
    if problem is not None:
        return CONDITION, False, "NoPublicKey", f"pods would refuse every generation: {problem}"
    signer = signs_with(data)
    if signer is not None and signer not in prints:  # re-signing would not help
        message = (
            f"the signing Secret's {SIGNING_KEY_FILE} ({signer}) and {PUBLIC_KEY_FILE} "
            f"({', '.join(prints)}) are not a pair: every generation its compile Jobs sign is "
            "refused by pods; put a matching pair in the Secret (kernelcache keygen writes one)"
        )
        return CONDITION, False, "KeysNotAPair", message
    refused = [
        f"{a['arch']}: generation {a['generation']} signed by {a.get('signedBy') or 'no key'}"
        for a in arches
        if a.get("generation") and a.get("signedBy") not in prints
    ]
    if refused:
        message = (
            f"pods trust {', '.join(prints)} and would refuse {'; '.join(refused)} "
            f"until its compile Job re-signs it with {signer}"
            if signer is not None
            else f"pods trust {', '.join(prints)} and would refuse {'; '.join(refused)}: the "
            f"signing Secret has no usable {SIGNING_KEY_FILE} to re-sign it with"
        )
        return CONDITION, False, "SignedByAnotherKey", message
    return CONDITION, True, "SignedByTrustedKey", f"pods trust {', '.join(prints)}"
