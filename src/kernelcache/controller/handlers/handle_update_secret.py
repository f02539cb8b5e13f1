"""A signing Secret changed (a rotated key): reconcile the KernelCaches that name it.

The reconcile reads the Secret afresh: its content is part of the compile Jobs' identity, so
new Jobs re-sign the published generation for the new key, and ``SignatureTrusted`` says
whether pods trust what is published meanwhile (``controller.signing``).
"""

from __future__ import annotations

from typing import Any

from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.handlers.handle_reconcile_kernelcache import (
    JobsOf,
    Reconciled,
    reconcile_kernelcache,
)
from kernelcache.controller.kube import Kube, kernelcache_path


def reconcile_secret_users(
    kube: Kube, config: OperatorConfig, namespace: str, secret: str, jobs_of: JobsOf
) -> list[Reconciled]:
    """Reconcile each KernelCache of the namespace whose signing Secret is ``secret``.

    Listed on the event, not kept in an index: Secrets change rarely, KernelCaches often,
    and an index would run on every KernelCache event.
    """
    return [
        reconcile_kernelcache(kube, config, body, jobs_of)
        for body in kube.list(kernelcache_path(namespace))
        if _signs_with(body, secret)
    ]


def _signs_with(body: dict[str, Any], secret: str) -> bool:
    signing = ((body.get("spec") or {}).get("verification") or {}).get("signing") or {}
    return bool(signing.get("enabled")) and signing.get("secretName") == secret
