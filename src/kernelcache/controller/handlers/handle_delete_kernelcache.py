"""A KernelCache is being deleted: its finalizer stops its Jobs and, if asked, drops its data.

Compile Jobs are deleted (their pods with them) so nothing keeps writing for a KernelCache
that is gone. With ``retention.deleteDataOnDelete`` the cached generations go too: a claim
the operator created is deleted whole; from an existing claim, a cleanup Job removes the
KernelCache's directory once no compile pod is left to write into it. Without it, the data
and the claim stay, for a KernelCache of the same name to find again, and the spec is kept
in the published record: new pods labelled for the name still load the kept generations
(with a Warning event), until the record or the data is deleted.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kernelcache.controller import manifests, metrics, state
from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.kube import ApiError, Kube, jobs_path, path
from kernelcache.errors import SpecError
from kernelcache.spec import parse_kernelcache


class Cleanup(enum.Enum):
    DONE = "done"  # the finalizer can go
    WAITING = "waiting"  # look again later
    FAILED = "failed"  # the cleanup Job failed; release the object anyway, with a warning


@dataclass(frozen=True)
class Deleted:
    outcome: Cleanup
    message: str


def delete_kernelcache(kube: Kube, config: OperatorConfig, body: dict[str, Any]) -> Deleted:
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    jobs = kube.list(jobs_path(namespace), manifests.selector(uid, manifests.COMPILE))
    for job in jobs:
        kube.delete(jobs_path(namespace, job["metadata"]["name"]))
    metrics.forget(f"{namespace}/{name}")
    stopped = f"deleted {len(jobs)} compile Job(s)"
    try:
        kc = parse_kernelcache({k: v for k, v in body.items() if k != "status"}, name)
    except SpecError:
        return Deleted(Cleanup.DONE, f"{stopped}; the spec is invalid, so the data is kept")
    if not kc.spec.retention.delete_data_on_delete:
        record = path("v1", "configmaps", namespace, manifests.record_name(kc))
        try:
            kube.patch(record, {"data": manifests.kept_data(kc)})
        except ApiError as exc:
            if exc.status != 404:
                raise
            return Deleted(Cleanup.DONE, f"{stopped}; nothing was published")
        return Deleted(
            Cleanup.DONE,
            f"{stopped}; the cached data is kept and new pods labelled {name} load it, until "
            f"ConfigMap {manifests.record_name(kc)} or the data is deleted",
        )
    claim = manifests.claim_name(kc)
    kube.delete(path("v1", "configmaps", namespace, manifests.record_name(kc)))
    if kc.spec.storage.pvc is not None:
        kube.delete(path("v1", "persistentvolumeclaims", namespace, claim))
        return Deleted(Cleanup.DONE, f"{stopped}; deleted claim {claim} with the data")
    if kube.list(path("v1", "pods", namespace), manifests.selector(uid, manifests.COMPILE)):
        return Deleted(Cleanup.WAITING, "waiting for compile pods to stop")
    job = manifests.cleanup_job(kc, uid, config)
    job_name = job["metadata"]["name"]
    kube.create(jobs_path(namespace), job)
    observed = state.job_state(kube.get(jobs_path(namespace, job_name)))
    where = f"{manifests.data_path(kc, config)} on claim {claim}"
    if observed == "Succeeded":
        return Deleted(Cleanup.DONE, f"{stopped}; Job {job_name} removed {where}")
    if observed == "Failed":
        return Deleted(Cleanup.FAILED, f"Job {job_name} failed to remove {where}")
    return Deleted(Cleanup.WAITING, f"Job {job_name} is removing {where}")
