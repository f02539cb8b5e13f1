"""The node map: each GPU node's feature-discovery labels, for init-containers to read.

A serving pod's init-container must know its node's SM arch before it can pick a generation,
but it has no GPU (requesting one would hold it while the cache is copied), and reading the
Node object through the API would need every serving pod's service account to be granted
``get nodes``, cluster-wide. Instead the operator, which watches Nodes, keeps a ConfigMap
``kernelcache-nodes`` in each namespace that has a KernelCache: one key per GPU node, named
after the node, whose value is the node's GPU labels as JSON. The webhook mounts it into the
init-container (``optional``: a missing map is a clear error, not a pod stuck mounting), which
reads the file named after its own node (``spec.nodeName``, from the downward API). The pod
needs no API access at all, so ``automountServiceAccountToken: false`` works.

Trade-offs, in ``docs/cluster-quickstart.md``: a node is usable once the operator has seen it
(its watch event, then one write per namespace; a pod scheduled within that moment fails its
init-container, which the kubelet retries with the map updated); a ConfigMap holds at most
1 MiB, about 5000 GPU nodes of ~200 bytes; nodes without GPU labels are left out.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kernelcache.documents import load_json
from kernelcache.errors import NoGpuInfoError

CONFIGMAP_NAME = "kernelcache-nodes"
MOUNT_DIR = "/etc/kernelcache/nodes"

# GPU feature discovery's node labels.
PRODUCT_LABEL = "nvidia.com/gpu.product"
MAJOR_LABEL = "nvidia.com/gpu.compute.major"
MINOR_LABEL = "nvidia.com/gpu.compute.minor"
GPU_LABELS = (PRODUCT_LABEL, MAJOR_LABEL, MINOR_LABEL)


def gpu_labels(node: Mapping[str, Any]) -> dict[str, str]:
    """The GPU labels of a Node object; empty for a node without any."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    return {k: str(labels[k]) for k in GPU_LABELS if k in labels}


def configmap_data(nodes: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """ConfigMap data: node name -> its GPU labels as JSON (nodes without any left out)."""
    return {
        name: json.dumps(dict(sorted(labels.items())), separators=(",", ":"))
        for name, labels in sorted(nodes.items())
        if labels
    }


def reader(directory: Path) -> Callable[[str], Mapping[str, str]]:
    """Reads a node's labels from the mounted map; a NoGpuInfoError says what is missing."""

    def read(node: str) -> Mapping[str, str]:
        where = directory / node
        try:
            text = where.read_text()
        except FileNotFoundError:
            if not (directory / "..data").exists() and not any(directory.glob("*")):
                raise NoGpuInfoError(
                    f"node {node}: no node map at {directory}: ConfigMap {CONFIGMAP_NAME} is "
                    "missing in this namespace (the operator writes it once it reconciles a "
                    "KernelCache here)"
                ) from None
            raise NoGpuInfoError(
                f"node {node}: not in the node map {directory} (ConfigMap {CONFIGMAP_NAME}): "
                f"the node has no {MAJOR_LABEL}/{MINOR_LABEL} labels, or joined after the map "
                "was last written (a pod with restartPolicy Never must be created again; "
                "others retry this init-container)"
            ) from None
        except OSError as exc:
            raise NoGpuInfoError(f"node {node}: {where}: cannot read: {exc.strerror}") from None
        try:
            labels = load_json(text, f"node {node}: {where}", NoGpuInfoError)
        except ValueError:
            labels = None
        if not isinstance(labels, dict):
            raise NoGpuInfoError(f"node {node}: {where}: not a JSON object of node labels")
        return {str(k): str(v) for k, v in labels.items()}

    return read
