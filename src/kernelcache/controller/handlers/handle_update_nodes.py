"""Keep the node map (``kernelcache.nodemap``) of a namespace in line with the GPU nodes.

Called when a KernelCache of the namespace is reconciled and when a Node changes. The map a
namespace was last given is remembered (``written``), so an unchanged map costs no request;
after a restart the first call writes it once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelcache import nodemap
from kernelcache.contract import LABEL_MANAGED_BY, MANAGED_BY
from kernelcache.controller.kube import Kube, path

JSON_PATCH = "application/json-patch+json"


def publish_node_map(
    kube: Kube,
    namespace: str,
    nodes: Mapping[str, Mapping[str, str]],
    written: dict[str, dict[str, str]],
) -> bool:
    """Create or replace the namespace's map; True when it was written."""
    data = nodemap.configmap_data(nodes)
    if written.get(namespace) == data:
        return False
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": nodemap.CONFIGMAP_NAME,
            "namespace": namespace,
            "labels": {LABEL_MANAGED_BY: MANAGED_BY, "app.kubernetes.io/name": "kernelcache"},
        },
        "data": data,
    }
    if not kube.create(path("v1", "configmaps", namespace), body):
        # "add" replaces the whole member: nodes that are gone leave the map too.
        replace = [{"op": "add", "path": "/data", "value": data}]
        kube.request(
            "PATCH",
            path("v1", "configmaps", namespace, nodemap.CONFIGMAP_NAME),
            body=replace,
            content_type=JSON_PATCH,
        )
    written[namespace] = data
    return True
