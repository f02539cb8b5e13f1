"""A compile Job changed: reconcile the KernelCache it belongs to.

Job events are how the operator hears that a compile started, finished or failed. The
reconcile reads everything afresh, so an event only says which KernelCache to look at.
"""

from __future__ import annotations

from typing import Any

from kernelcache.contract import ANNOTATION_CACHE, LABEL_CACHE_UID
from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.handlers.handle_reconcile_kernelcache import (
    JobsOf,
    Reconciled,
    reconcile_kernelcache,
)
from kernelcache.controller.kube import ApiError, Kube, kernelcache_path


def reconcile_job_owner(
    kube: Kube, config: OperatorConfig, job: dict[str, Any], jobs_of: JobsOf
) -> Reconciled | None:
    """Reconcile the Job's KernelCache; None when it is gone or was replaced by a namesake."""
    meta = job.get("metadata") or {}
    name = (meta.get("annotations") or {}).get(ANNOTATION_CACHE)
    if not name:
        return None
    try:
        body = kube.get(kernelcache_path(meta["namespace"], name))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise
    if body["metadata"].get("uid") != (meta.get("labels") or {}).get(LABEL_CACHE_UID):
        return None
    return reconcile_kernelcache(kube, config, body, jobs_of)
