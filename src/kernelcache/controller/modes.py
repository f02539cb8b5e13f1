"""How a serving pod gets its generation: the shared claim, an image volume, a pull by
digest, and first of all its node's prefetched copy (docs/distribution.md, "Cluster modes").

Pure builders over a validated KernelCache (its status included: the artifacts and
generations it serves now) and the operator config. ``serving_source`` gives the
init-container's arguments, mounts and the pod's volumes and pull secrets for the mode;
``prefetch_daemonset`` the DaemonSet that keeps one GPU class's generation on its nodes.

- ``volume``: the KernelCache's claim, read-only (``--store``). A KernelCache consuming
  ``spec.source`` has no claim of its own: it is pulled.
- ``image``: each arch's artifact (``repo@sha256:…``) as a Kubernetes image volume,
  read-only at ``/var/lib/kernelcache-artifacts/<arch>`` (``--artifact``); the kubelet
  pulls and checks it by digest with the pod's ``imagePullSecrets``. Every arch is mounted
  (the pod is admitted before it is scheduled: its node's arch is not known yet), in the
  init-container and, at the same path, in every serving container: the toolchains that
  only read their files use them there, where the init-container verified them.
- ``pull``: the init-container pulls this node's arch by digest (``--pull``), with the
  read secret mounted.
- prefetch (on top of any mode, when ``prefetch_root`` is set): the node's root mounted
  read-only (``--local``, ``--want`` per arch); the init-container waits up to
  ``prefetch_wait_seconds`` for the copy, then falls back to the mode's source, or with
  ``prefetch_fallback`` off refuses the pod (and the mode's source is not mounted at all).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from kernelcache.contract import LABEL_ARCH, LABEL_DIGEST, LOCAL_DAMAGED
from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.manifests import (
    _CONTAINER_SECURITY,
    TERMINATION_LOG,
    _dns,
    _labels,
    _metadata,
    _pod_security,
    claim_name,
    registry_access,
)
from kernelcache.spec import GpuClass, KernelCache

Mode = Literal["volume", "image", "pull"]

STORE_VOLUME = "kernelcache-store"
ARTIFACT_VOLUME = "kernelcache-artifact"
ARTIFACT_DIR = "/var/lib/kernelcache-artifacts"
LOCAL_VOLUME = "kernelcache-local"
LOCAL_DIR = "/var/lib/kernelcache-local"
PREFETCH = "prefetch"


@dataclass
class Source:
    """What the init-container and the pod need to reach the generation."""

    args: list[str] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    pull_secrets: list[str] = field(default_factory=list)
    serving_mounts: list[dict[str, Any]] = field(default_factory=list)  # every serving container's


def mode_of(kc: KernelCache, config: OperatorConfig) -> Mode:
    """The mode a KernelCache's pods are served in: the operator's, except that a consumed
    KernelCache (``spec.source``) has no claim to mount and is pulled in volume mode."""
    if config.distribution_mode == "volume" and kc.spec.source is not None:
        return "pull"
    return config.distribution_mode


def artifacts(kc: KernelCache) -> dict[str, str]:
    """Per arch, the artifact it serves now: the consumed one, else the one its compile Job
    pushed (status); an arch without one has none yet."""
    if kc.spec.source is not None:
        return dict(kc.spec.source.oci.artifacts)
    arches = kc.status.arches if kc.status is not None else []
    return {a.arch: a.artifact for a in arches if a.artifact}


def wants(kc: KernelCache) -> dict[str, str]:
    """Per arch, the token a prefetched copy must have been fetched for: the artifact when
    there is one (what a prefetch pulls), else the generation the status names."""
    found = artifacts(kc)
    for a in kc.status.arches if kc.status is not None else []:
        if a.arch not in found and a.generation:
            found[a.arch] = a.generation
    return found


def reader_secret(kc: KernelCache) -> str | None:
    """The docker-config Secret that reads the KernelCache's artifacts, if any."""
    if kc.spec.source is not None:
        return kc.spec.source.oci.pull_secret
    oci = kc.spec.distribution.oci
    return oci.reader_secret() if oci is not None else None


def serving_source(kc: KernelCache, config: OperatorConfig) -> Source:
    """The init-container's source arguments, its mounts and the pod's volumes."""
    source = Source()
    local_only = bool(config.prefetch_root) and not config.prefetch_fallback
    if config.prefetch_root:
        _add_local(source, kc, config)
    if local_only:
        return source
    mode = mode_of(kc, config)
    if mode == "volume":
        source.args += ["--store", config.store_mount_path]
        source.mounts.append(
            {"name": STORE_VOLUME, "mountPath": config.store_mount_path, "readOnly": True}
        )
        claim = {"claimName": claim_name(kc), "readOnly": True}
        source.volumes.append({"name": STORE_VOLUME, "persistentVolumeClaim": claim})
    elif mode == "image":
        for arch, ref in sorted(artifacts(kc).items()):
            name = f"{ARTIFACT_VOLUME}-{_dns(arch)}"
            where = f"{ARTIFACT_DIR}/{arch}"
            source.args += ["--artifact", f"{arch}={where}"]
            mount = {"name": name, "mountPath": where, "readOnly": True}
            source.mounts.append(mount)
            source.serving_mounts.append(dict(mount))
            image = {"reference": ref, "pullPolicy": "IfNotPresent"}
            source.volumes.append({"name": name, "image": image})
        if (secret := reader_secret(kc)) is not None:
            source.pull_secrets.append(secret)
    else:
        for arch, ref in sorted(artifacts(kc).items()):
            source.args += ["--pull", f"{arch}={ref}"]
        args, mounts, volumes = registry_access(reader_secret(kc), config)
        source.args += args
        source.mounts += mounts
        source.volumes += volumes
    return source


def _add_local(source: Source, kc: KernelCache, config: OperatorConfig) -> None:
    source.args += ["--local", LOCAL_DIR, "--local-wait", str(config.prefetch_wait_seconds)]
    if not config.prefetch_fallback:
        source.args.append("--local-only")
    for arch, token in sorted(wants(kc).items()):
        source.args += ["--want", f"{arch}={token}"]
    source.mounts.append({"name": LOCAL_VOLUME, "mountPath": LOCAL_DIR, "readOnly": True})
    host = {"path": config.prefetch_root, "type": "DirectoryOrCreate"}
    source.volumes.append({"name": LOCAL_VOLUME, "hostPath": host})


# --------------------------------------------------------------------------- the DaemonSet


def prefetch_name(kc: KernelCache, gpu_class: GpuClass) -> str:
    digest = hashlib.sha256(f"{kc.metadata.name}/{gpu_class.name}".encode()).hexdigest()[:6]
    room = 63 - len("kc--prefetch-") - len(digest) - 1
    base = f"{_dns(kc.metadata.name)}-{gpu_class.name}"[:room].rstrip("-")
    return f"kc-{base}-prefetch-{digest}"


def prefetch_daemonsets(
    kc: KernelCache, owner: dict[str, Any], config: OperatorConfig
) -> list[dict[str, Any]]:
    """One DaemonSet per GPU class whose arch serves something now; none without a root."""
    if not config.prefetch_root:
        return []
    want = wants(kc)
    return [
        prefetch_daemonset(kc, c, want[c.arch], owner, config)
        for c in kc.spec.gpu_classes
        if c.arch in want
    ]


def prefetch_daemonset(
    kc: KernelCache, gpu_class: GpuClass, token: str, owner: dict[str, Any], config: OperatorConfig
) -> dict[str, Any]:
    """Pods on the class's nodes (its nodeSelector and tolerations) whose init-containers
    fetch the arch's generation into the node's root, then hold (``sleep``, same image): a
    pod's phase is the node's prefetch state (``node_states``). The template names what it
    fetches, so a new generation is a new template and each node fetches it."""
    arch = gpu_class.arch
    key = f"{kc.metadata.namespace}/{kc.metadata.name}/{arch}"
    command = [
        "kernelcache", "prefetch", "--root", LOCAL_DIR, "--key", key, "--want", token,
        "--limit", str(config.prefetch_limit_bytes), "--termination-log", TERMINATION_LOG,
    ]  # fmt: skip
    mounts = [{"name": LOCAL_VOLUME, "mountPath": LOCAL_DIR}]
    volumes: list[dict[str, Any]] = [
        {
            "name": LOCAL_VOLUME,
            "hostPath": {"path": config.prefetch_root, "type": "DirectoryOrCreate"},
        }
    ]
    if token.count("@sha256:") == 1:  # an artifact: pulled from the registry
        args, extra_mounts, extra_volumes = registry_access(reader_secret(kc), config)
    else:  # a generation of the shared store, copied out of it
        args = ["--store", config.store_mount_path]
        extra_mounts = [
            {"name": STORE_VOLUME, "mountPath": config.store_mount_path, "readOnly": True}
        ]
        claim = {"claimName": claim_name(kc), "readOnly": True}
        extra_volumes = [{"name": STORE_VOLUME, "persistentVolumeClaim": claim}]
    # No signature check here: the copy keeps MANIFEST.json's signature, and each pod's
    # init-container checks it (with the key its webhook projects) before using the copy.
    command += args
    labels = {**_labels(owner["uid"], PREFETCH), LABEL_ARCH: arch}
    template_digest = hashlib.sha256(json.dumps(command).encode()).hexdigest()[:16]
    labels_with_digest = {**labels, LABEL_DIGEST: template_digest}
    owner_uid = f"{config.run_as_user}:{config.run_as_group}"
    pod_spec = {
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(config),
        "nodeSelector": dict(gpu_class.node_selector),
        "tolerations": [
            t.model_dump(by_alias=True, exclude_none=True) for t in gpu_class.tolerations
        ],
        "initContainers": [
            {  # the hostPath is made root's: give it to the prefetch user (CAP_CHOWN only)
                "name": "root-ownership",
                "image": config.init_image,
                "command": ["chown", owner_uid, LOCAL_DIR],
                "securityContext": {
                    **_CONTAINER_SECURITY,
                    "runAsUser": 0,
                    "runAsNonRoot": False,
                    "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
                },
                "volumeMounts": [{"name": LOCAL_VOLUME, "mountPath": LOCAL_DIR}],
            },
            {
                "name": PREFETCH,
                "image": config.init_image,
                "command": command,
                "securityContext": _CONTAINER_SECURITY,
                "terminationMessagePath": TERMINATION_LOG,
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "volumeMounts": mounts + extra_mounts,
            },
        ],
        "containers": [
            {
                "name": "hold",
                "image": config.init_image,
                "command": ["sleep", "2147483647"],
                "securityContext": _CONTAINER_SECURITY,
            }
        ],
        "volumes": volumes + extra_volumes,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _metadata(kc, prefetch_name(kc, gpu_class), labels, owner),
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": "100%"},
            },
            "template": {"metadata": {"labels": labels_with_digest}, "spec": pod_spec},
        },
    }


def _damaged(serving: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[str, str]]:
    """(node, arch) -> (when, line) of the latest serving pod that found that node's copy
    damaged (its init-container's termination log, exit 0: it started from the source)."""
    found: dict[tuple[str, str], tuple[str, str]] = {}
    for pod in serving:
        node = (pod.get("spec") or {}).get("nodeName")
        for init in (pod.get("status") or {}).get("initContainerStatuses") or []:
            done = (init.get("state") or {}).get("terminated") or {}
            line = (done.get("message") or "").strip()
            if not node or done.get("exitCode") != 0 or LOCAL_DAMAGED not in line:
                continue
            key = line.split(": ", 1)[0]
            arch = key.rsplit("/", 1)[-1]
            when = str(done.get("finishedAt") or "")
            if (node, arch) not in found or found[(node, arch)][0] < when:
                found[(node, arch)] = (when, line)
    return found


def node_states(
    pods: list[dict[str, Any]],
    digests: dict[str, str],
    serving: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Per node and arch, the prefetch state its DaemonSet pod shows: Ready (the fetch
    finished, the pod holds), Pulling (the fetch runs, or the pod is of an older template),
    Failed (the fetch's last failure, its one line as the message; it is retried). A copy
    a ``serving`` pod found damaged after it was fetched is Failed too, with that pod's
    line: its pods start from the source, and the node's copy is not what it says."""
    damaged = _damaged(serving or [])
    found = []
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        node = (pod.get("spec") or {}).get("nodeName")
        arch = labels.get(LABEL_ARCH)
        if not node or not arch:
            continue
        status = pod.get("status") or {}
        current = labels.get(LABEL_DIGEST) == digests.get(arch)
        inits = {c.get("name"): c for c in status.get("initContainerStatuses") or []}
        fetch = inits.get(PREFETCH) or {}
        terminated = (fetch.get("state") or {}).get("terminated") or {}
        last = (fetch.get("lastState") or {}).get("terminated") or {}
        if current and status.get("phase") == "Running":
            phase, message = "Ready", "the generation is on the node"
        elif terminated.get("exitCode") not in (None, 0) or last.get("exitCode") not in (None, 0):
            failure = terminated if terminated.get("exitCode") not in (None, 0) else last
            text = (failure.get("message") or failure.get("reason") or "failed").strip()
            phase, message = "Failed", text.splitlines()[-1][:300] if text else "failed"
        else:
            phase, message = "Pulling", "fetching the generation"
        fetched_at = str(terminated.get("finishedAt") or "")
        if phase == "Ready" and (seen := damaged.get((node, arch))) and seen[0] >= fetched_at:
            phase, message = "Failed", seen[1][:300]
        found.append({"node": node, "arch": arch, "phase": phase, "message": message})
    return sorted(found, key=lambda n: (n["node"], n["arch"]))


def template_digest(daemonset: dict[str, Any]) -> str:
    return str(daemonset["spec"]["template"]["metadata"]["labels"][LABEL_DIGEST])
