"""Keep the node map (``kernelcache.nodemap``) of a namespace in line with the GPU nodes.

Called when a KernelCache of the namespace is reconciled (its resync timer included), when a
Node changes and when the map itself is deleted. Nothing remembers what was written: each
call reads the map and writes it only when it is missing or differs, so a map deleted behind
the operator's back (a GitOps prune, a namespace deleted and re-created) is written again at
the next call, and an unchanged map costs one read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelcache import nodemap
from kernelcache.contract import LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGED_BY
from kernelcache.controller.kube import ApiError, Kube, path

JSON_PATCH = "application/json-patch+json"
NODE_MAP = "node-map"
# The map's labels: the operator watches ConfigMaps with exactly these (its deletion).
LABELS = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_COMPONENT: NODE_MAP}


def publish_node_map(kube: Kube, namespace: str, nodes: Mapping[str, Mapping[str, str]]) -> bool:
    """Create or replace the namespace's map unless it already says this; True when written."""
    data = nodemap.configmap_data(nodes)
    where = path("v1", "configmaps", namespace, nodemap.CONFIGMAP_NAME)
    for _ in range(2):  # a map created between our read and our create is read again
        try:
            found = kube.get(where)
        except ApiError as exc:
            if exc.status != 404:
                raise
            if kube.create(path("v1", "configmaps", namespace), _configmap(namespace, data)):
                return True
            continue
        labels = (found.get("metadata") or {}).get("labels") or {}
        if (found.get("data") or {}) == data and LABELS.items() <= labels.items():
            return False
        # "add" replaces the whole member: nodes that are gone leave the map too.
        replace = [
            {"op": "add", "path": "/metadata/labels", "value": {**labels, **LABELS}},
            {"op": "add", "path": "/data", "value": data},
        ]
        kube.request("PATCH", where, body=replace, content_type=JSON_PATCH)
        return True
    message = f"ConfigMap {namespace}/{nodemap.CONFIGMAP_NAME} was created and gone again twice"
    raise ApiError(409, "Conflict", message)


def _configmap(namespace: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": nodemap.CONFIGMAP_NAME,
            "namespace": namespace,
            "labels": {**LABELS, "app.kubernetes.io/name": "kernelcache"},
        },
        "data": data,
    }
