"""The operator starts: make sure the peering object its replicas meet in exists.

kopf only pauses and resumes replicas around a peering object; it does not create one. A
missing peering CRD is reported, not fixed: kopf then keeps this replica paused, which is
the safe side when replicas cannot see each other.
"""

from __future__ import annotations

from kernelcache.controller import manifests
from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.kube import ApiError, Kube, path


def ensure_peering(kube: Kube, config: OperatorConfig) -> list[str]:
    """Create the ClusterKopfPeering (or a KopfPeering per namespace); return problems."""
    if not config.peering:
        return []
    problems = []
    for namespace in config.namespaces or (None,):
        obj = manifests.peering_object(config.peering, namespace)
        plural = obj["kind"].lower() + "s"
        collection = path(obj["apiVersion"], plural, namespace)
        try:
            kube.create(collection, obj)
        except ApiError as exc:
            problems.append(f"cannot create {obj['kind']} {config.peering!r}: {exc}")
    return problems
