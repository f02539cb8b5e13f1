"""A signing Secret changed (a rotated key): reconcile the KernelCaches that name it.

The reconcile reads the Secret afresh: its content is part of the compile Jobs' identity, so
new Jobs re-sign the published generation for the new key, and ``SignatureTrusted`` says
whether pods trust what is published meanwhile (``controller.signing``).
"""

from __future__ import annotations

from collections.abc import Iterable

from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.handlers.handle_reconcile_kernelcache import (
    JobsOf,
    Reconciled,
    reconcile_kernelcache,
)
from kernelcache.controller.kube import ApiError, Kube, kernelcache_path


def reconcile_secret_users(
    kube: Kube, config: OperatorConfig, namespace: str, caches: Iterable[str], jobs_of: JobsOf
) -> list[Reconciled]:
    """Reconcile each named KernelCache of the namespace that still exists."""
    done = []
    for name in sorted(set(caches)):
        try:
            body = kube.get(kernelcache_path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                continue
            raise
        done.append(reconcile_kernelcache(kube, config, body, jobs_of))
    return done
