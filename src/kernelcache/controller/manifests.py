"""Pure builders of what the operator creates: claim, spec ConfigMap, compile and cleanup Jobs.

Everything here is a function of a validated KernelCache, its owner reference and the
operator config (or, for an Event, of the object it is about), returning plain dicts;
nothing talks to the API server.

How a compile Job gets its spec: the operator writes the KernelCache (apiVersion, kind,
name, namespace and the validated spec) as YAML into an immutable ConfigMap named after the
spec digest, and mounts it into the Job, which runs ``kernelcache warm -f <that file>``. The
Job therefore needs no API access (its pod mounts no service-account token), and a Job
always compiles exactly the spec it was created for, even if the KernelCache changes while
it waits for a node or retries its pod.

Names are deterministic: a compile Job is named after the KernelCache, the arch, a digest of
the KernelCache's identity and spec (which includes the engine image) and the attempt, so a
repeated reconcile creates nothing twice (the API server answers 409), and a spec or image
change yields new names, i.e. a new generation of Jobs.

The identity in that digest is the object's, not only its name: its uid and its
``metadata.generation`` (which the API server bumps on every spec change). So a KernelCache
deleted and re-created under the same name never meets the children of its namesake (which
the garbage collector is about to delete), and a spec reverted to an earlier one (A, B, A)
runs Jobs of its own instead of reading A's finished ones again: the store's ``CURRENT`` names
B's generation then, and only a Job can make A's current again.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from datetime import datetime, timezone
from pathlib import PurePosixPath
from typing import Any

import yaml

from kernelcache.contract import (
    ANNOTATION_CACHE,
    LABEL_ARCH,
    LABEL_ATTEMPT,
    LABEL_CACHE_UID,
    LABEL_COMPONENT,
    LABEL_DIGEST,
    LABEL_MANAGED_BY,
    LEARNED,
    MANAGED_BY,
    PROGRESS,
    image_reference,
)
from kernelcache.controller.config import OperatorConfig
from kernelcache.spec import (
    API_VERSION,
    KIND,
    PUBLIC_KEY_FILE,
    SIGNING_KEY_FILE,
    GpuClass,
    KernelCache,
)

COMPILE = "compile"
CLEANUP = "cleanup"
RECORD = "record"
RECORD_FILE = "published.json"
KEPT_FILE = "kept.yaml"  # the spec of a KernelCache deleted with its data kept

SPEC_DIR = "/etc/kernelcache/spec"
SPEC_FILE = "kernelcache.yaml"
# Beside it, when serving had learned anything as the ConfigMap was made (controller.learning).
LEARNED_FILE = "learned.json"
SIGNING_DIR = "/etc/kernelcache/signing"
TERMINATION_LOG = "/dev/termination-log"

_NAME_MAX = 63  # Job names become a pod label value, so they must fit one


def spec_digest(kc: KernelCache, signing: str | None = None) -> str:
    """16 hex digits of sha256 over namespace, name, uid, generation and spec (and, with
    signing, ``signing``: the signing Secret's content, ``controller.signing.job_identity``).

    Stable across reconciles and operator restarts of one spec revision; new on any spec
    change, on a revert to an earlier spec, for a re-created object of the same name, and
    when the signing Secret changes (its Jobs re-sign for the rotated key).
    """
    server_set = kc.metadata.model_extra or {}
    identity = {
        "namespace": kc.metadata.namespace,
        "name": kc.metadata.name,
        "uid": server_set.get("uid"),
        "generation": server_set.get("generation"),
        "spec": _digested_spec(kc),
    }
    if signing is not None:
        identity["signing"] = signing
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _digested_spec(kc: KernelCache) -> dict[str, Any]:
    """The spec as digested; ``distribution`` and ``source`` only when set, so a spec written
    before they existed keeps its digest (and its Jobs) across an operator upgrade."""
    spec = kc.spec.model_dump(mode="json", by_alias=True)
    if kc.spec.distribution.oci is None:
        del spec["distribution"]
    if kc.spec.source is None:
        del spec["source"]
    return spec


def _dns(text: str) -> str:
    return text.lower().replace("_", "-").replace(".", "-")


def job_name(kc_name: str, arch: str, digest: str, attempt: int) -> str:
    """``kc-<name>-<arch>-<digest>[-r<attempt>]``, the name cut to keep within 63 characters."""
    suffix = f"-{_dns(arch)}-{digest[:10]}" + (f"-r{attempt}" if attempt else "")
    room = _NAME_MAX - len("kc-") - len(suffix)
    return f"kc-{_dns(kc_name)[:room].rstrip('-')}{suffix}"


def claim_name(kc: KernelCache) -> str:
    """The claim compile Jobs mount: the existing one, or the one the operator creates."""
    if kc.spec.storage.existing_claim is not None:
        return kc.spec.storage.existing_claim
    return f"kernelcache-{kc.metadata.name}"[:253].rstrip("-.")


def configmap_name(kc: KernelCache, digest: str) -> str:
    return f"kc-{kc.metadata.name}"[: 253 - 17].rstrip("-.") + f"-{digest}"


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    """Makes a child go with its KernelCache (Kubernetes garbage collection)."""
    meta = body["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def selector(uid: str, component: str | None = None) -> str:
    """Label selector of what the operator made for the KernelCache with this uid."""
    terms = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_CACHE_UID: uid}
    if component:
        terms[LABEL_COMPONENT] = component
    return ",".join(f"{k}={v}" for k, v in terms.items())


def _labels(uid: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kernelcache",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_COMPONENT: component,
        LABEL_CACHE_UID: uid,
    }


def _metadata(
    kc: KernelCache, name: str, labels: dict[str, str], owner: dict[str, Any] | None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": kc.metadata.namespace,
        "labels": labels,
        "annotations": {ANNOTATION_CACHE: kc.metadata.name},
    }
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


def spec_document(kc: KernelCache) -> dict[str, Any]:
    """The KernelCache as ``kernelcache warm -f`` reads it: identity and validated spec only."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": kc.metadata.name, "namespace": kc.metadata.namespace},
        "spec": kc.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def spec_configmap(kc: KernelCache, owner: dict[str, Any], digest: str) -> dict[str, Any]:
    """Immutable, per spec digest: a Job's spec cannot change under it."""
    labels = {**_labels(owner["uid"], "spec"), LABEL_DIGEST: digest}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(kc, configmap_name(kc, digest), labels, owner),
        "immutable": True,
        "data": {SPEC_FILE: yaml.safe_dump(spec_document(kc), sort_keys=False)},
    }


def record_name(kc: KernelCache | str) -> str:
    """The published record's name, from the KernelCache or its name alone (the webhook
    looks for it when the KernelCache is gone)."""
    name = kc if isinstance(kc, str) else kc.metadata.name
    return f"kc-{name}"[: 253 - 10].rstrip("-.") + "-published"


def kept_data(kc: KernelCache) -> dict[str, str]:
    """What the finalizer adds to the record when the data stays: the spec, so that pods
    labelled for the deleted KernelCache are still given the init-container that verifies
    its kept generations (``webhook.lookup``)."""
    return {KEPT_FILE: yaml.safe_dump(spec_document(kc), sort_keys=False)}


def published_record(kc: KernelCache, uid: str, arches: dict[str, Any]) -> dict[str, Any]:
    """What the store's ``CURRENT`` names per arch, as last published under this name.

    Named after the KernelCache's name alone and without an owner reference, like the data
    in ``<store>/<namespace>/<name>``: it outlives the object, so one re-created under the
    name shows what its pods load (they read the same store) before its own Jobs have run.
    """
    record = {"claim": claim_name(kc), "arches": arches}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(kc, record_name(kc), _labels(uid, RECORD), None),
        "data": {RECORD_FILE: json.dumps(record, sort_keys=True)},
    }


def warning_event(about: dict[str, Any], reason: str, message: str) -> dict[str, Any]:
    """A Warning Event on ``about`` (an object as the API server returned it), as kopf posts
    them, for the admission handlers, where kopf's own posting does not run."""
    meta = about["metadata"]
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}"[-253:]},
        "involvedObject": {
            "apiVersion": about.get("apiVersion"),
            "kind": about.get("kind"),
            "name": meta["name"],
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
        },
        "type": "Warning",
        "reason": reason,
        "message": message[:1024],
        "source": {"component": MANAGED_BY},
        "reportingComponent": MANAGED_BY,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def claim(kc: KernelCache, uid: str) -> dict[str, Any]:
    """The PVC of ``spec.storage.pvc``.

    It has no owner reference: Kubernetes would delete the cached generations with the
    KernelCache. The finalizer deletes it only when ``retention.deleteDataOnDelete`` is set.
    """
    template = kc.spec.storage.pvc
    if template is None:
        raise ValueError("claim() needs spec.storage.pvc")
    spec: dict[str, Any] = {
        "accessModes": list(template.access_modes),
        "resources": {"requests": {"storage": template.size}},
    }
    if template.storage_class_name is not None:
        spec["storageClassName"] = template.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(kc, claim_name(kc), _labels(uid, "storage"), None),
        "spec": spec,
    }


def gpu_class_for(kc: KernelCache, arch: str) -> GpuClass:
    """The first GPU class of an arch: its nodes compile for every class of that arch."""
    return next(c for c in kc.spec.gpu_classes if c.arch == arch)


def image_of(kc: KernelCache) -> str:
    return image_reference(kc.spec.engine.image, kc.spec.engine.image_digest)


def _pod_security(config: OperatorConfig) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": config.run_as_user,
        "runAsGroup": config.run_as_group,
        "fsGroup": config.fs_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def _job(
    metadata: dict[str, Any],
    pod_labels: dict[str, str],
    pod_spec: dict[str, Any],
    config: OperatorConfig,
    deadline: int | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "backoffLimit": config.job_backoff_limit,
        "ttlSecondsAfterFinished": config.job_ttl_seconds,
        "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
    }
    if deadline is not None:
        spec["activeDeadlineSeconds"] = deadline
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


def compile_job(
    kc: KernelCache,
    *,
    arch: str,
    digest: str,
    attempt: int,
    owner: dict[str, Any],
    config: OperatorConfig,
) -> dict[str, Any]:
    """The Job that runs ``kernelcache warm`` for one arch in the serving image.

    It writes its ``ArchResult`` as JSON to the termination log, where the operator reads it
    from the finished pod; when warm fails before writing it, the log's last lines stand in.
    """
    gpu = gpu_class_for(kc, arch)
    labels = {
        **_labels(owner["uid"], COMPILE),
        LABEL_ARCH: arch,
        LABEL_DIGEST: digest,
        LABEL_ATTEMPT: str(attempt),
    }
    command = [
        "kernelcache", "warm", "-f", f"{SPEC_DIR}/{SPEC_FILE}",
        "--store", config.store_mount_path, "--arch", arch, "--result", TERMINATION_LOG,
    ]  # fmt: skip
    mounts = [
        {"name": "store", "mountPath": config.store_mount_path},
        {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "store", "persistentVolumeClaim": {"claimName": claim_name(kc)}},
        {"name": "spec", "configMap": {"name": configmap_name(kc, digest)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if (model := kc.spec.model_volume) is not None:  # the warmers' model path, as in serving
        mount = {"name": "model", "mountPath": model.mount_path, "readOnly": True}
        mounts.append({**mount, "subPath": model.sub_path} if model.sub_path else mount)
        volumes.append({"name": "model", **model.volume_source()})
    for i, root in enumerate(kc.spec.vllm_cache_roots()):  # vLLM writes its cache there
        mounts.append({"name": f"vllm-root-{i}", "mountPath": root})
        volumes.append({"name": f"vllm-root-{i}", "emptyDir": {}})
    signing = kc.spec.verification.signing
    if signing.enabled and signing.secret_name:
        command += ["--signing-key", f"{SIGNING_DIR}/{SIGNING_KEY_FILE}"]
        command += ["--public-key", f"{SIGNING_DIR}/{PUBLIC_KEY_FILE}"]  # what pods trust
        mounts.append({"name": "signing", "mountPath": SIGNING_DIR, "readOnly": True})
        volumes.append({"name": "signing", "secret": {"secretName": signing.secret_name}})
    if (oci := kc.spec.distribution.oci) is not None:
        push_args, push_mounts, push_volumes = registry_access(oci.push_secret, config)
        command += ["--push", oci.repository, *push_args]
        mounts += push_mounts
        volumes += push_volumes
    node_selector, tolerations, resources = compile_placement(gpu)
    container = {
        "name": "warm",
        "image": image_of(kc),
        "command": command,
        "env": [
            {"name": "HOME", "value": "/tmp"},  # toolchains keep caches under $HOME
            # Each warmer and kernel in the Job's log; an older kernelcache in the engine
            # image ignores the variable, where it would refuse a flag it does not know.
            {"name": PROGRESS.name, "value": "1"},
            # What serving learned, warmed too; absent from the ConfigMap when nothing was.
            {"name": LEARNED.name, "value": f"{SPEC_DIR}/{LEARNED_FILE}"},
        ],
        "resources": resources,
        "securityContext": _CONTAINER_SECURITY,
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": mounts,
    }
    pod_spec = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(config),
        "nodeSelector": node_selector,
        "tolerations": tolerations,
        "containers": [container],
        "volumes": volumes,
    }
    if kc.spec.image_pull_secrets:  # the engine image from a private registry
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in kc.spec.image_pull_secrets]
    if config.fix_store_ownership:
        pod_spec["initContainers"] = [store_ownership_container(kc, config)]
    timeouts = sum(w.timeout_seconds for w in kc.spec.warmers_for(arch))
    deadline = timeouts + config.job_deadline_margin_seconds
    name = job_name(kc.metadata.name, arch, digest, attempt)
    return _job(_metadata(kc, name, labels, owner), labels, pod_spec, config, deadline)


REGISTRY_DIR = "/etc/kernelcache/registry"
REGISTRY_CA_DIR = "/etc/kernelcache/registry-ca"
DOCKER_CONFIG_KEY = ".dockerconfigjson"  # the key of a kubernetes.io/dockerconfigjson Secret
REGISTRY_CA_KEY = "ca.crt"


def mount_conflict(kc: KernelCache, config: OperatorConfig) -> str | None:
    """Why ``spec.modelVolume.mountPath`` cannot be mounted in the compile Job (None: it
    can): at, inside or over one of the Job's own mounts (the store, the spec, the signing
    key, registry credentials, /tmp, the termination log), it would hide it or be hidden."""
    model = kc.spec.model_volume
    if model is None:
        return None
    at = PurePosixPath(model.mount_path)
    own = {
        config.store_mount_path: "the store (KERNELCACHE_OPERATOR_STORE_MOUNT_PATH)",
        SPEC_DIR: "the spec",
        SIGNING_DIR: "the signing key",
        REGISTRY_DIR: "registry credentials",
        REGISTRY_CA_DIR: "the registry CA",
        "/tmp": "scratch space",
        TERMINATION_LOG: "the termination log",
    }
    for path, what in own.items():
        theirs = PurePosixPath(path)
        if at == theirs or theirs in at.parents or at in theirs.parents:
            where = "is" if at == theirs else "is inside" if theirs in at.parents else "is above"
            return f"{model.mount_path} {where} {path}, where the compile Job mounts {what}"
    return None


def registry_access(
    secret: str | None, config: OperatorConfig
) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """(arguments, mounts, volumes) that give a container a registry's credentials (a
    docker-config Secret, when one is named) and the CA to trust it with (``registry_ca``)."""
    args: list[str] = []
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    if secret is not None:
        args += ["--authfile", f"{REGISTRY_DIR}/{DOCKER_CONFIG_KEY}"]
        mounts.append({"name": "kernelcache-registry", "mountPath": REGISTRY_DIR, "readOnly": True})
        items = [{"key": DOCKER_CONFIG_KEY, "path": DOCKER_CONFIG_KEY}]
        volumes.append(
            {"name": "kernelcache-registry", "secret": {"secretName": secret, "items": items}}
        )
    if config.registry_ca:
        args += ["--ca-file", f"{REGISTRY_CA_DIR}/{REGISTRY_CA_KEY}"]
        mounts.append(
            {"name": "kernelcache-registry-ca", "mountPath": REGISTRY_CA_DIR, "readOnly": True}
        )
        volumes.append(
            {"name": "kernelcache-registry-ca", "configMap": {"name": config.registry_ca}}
        )
    return args, mounts, volumes


def compile_placement(
    gpu: GpuClass,
) -> tuple[dict[str, str], list[dict[str, Any]], dict[str, dict[str, str]]]:
    """(nodeSelector, tolerations, resources) of a compile Job, after the class's ``compileOn``.

    ``target`` runs on a node of the class; ``any-gpu`` keeps the class's GPU request and
    tolerations but not its node selector; ``cpu`` asks for no GPU and no GPU node at all.
    """
    resources = {k: dict(v) for k, v in gpu.resources.model_dump(by_alias=True).items() if v}
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in gpu.tolerations]
    if gpu.compile_on == "target":
        return dict(gpu.node_selector), tolerations, resources
    if gpu.compile_on == "any-gpu":
        return {}, tolerations, resources
    cpu_only = {
        kind: {name: q for name, q in amounts.items() if not _is_accelerator(name)}
        for kind, amounts in resources.items()
    }
    return {}, [], {kind: amounts for kind, amounts in cpu_only.items() if amounts}


def _is_accelerator(resource: str) -> bool:
    """An extended resource of a device plugin (``nvidia.com/gpu``, ``nvidia.com/mig-1g.10gb``)."""
    return "/" in resource and resource.split("/", 1)[0] != "kubernetes.io"


def store_ownership_container(kc: KernelCache, config: OperatorConfig) -> dict[str, Any]:
    """Creates the KernelCache's store directories and gives them to the compile Job's user.

    For volumes that ignore fsGroup (``fix_store_ownership``). Root, but no capability
    except CHOWN: creating a directory in a root-owned one needs none, and nothing below
    ``<store>/<namespace>/<name>`` is touched.
    """
    owner = f"{config.run_as_user}:{config.run_as_group}"
    directory = data_path(kc, config)
    return {
        "name": "store-ownership",
        "image": config.cleanup_image,
        "command": ["sh", "-c", 'mkdir -p "$0" && chown "$1" "${0%/*}" "$0"', directory, owner],
        "securityContext": {
            **_CONTAINER_SECURITY,
            "runAsUser": 0,
            "runAsNonRoot": False,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        },
        "volumeMounts": [{"name": "store", "mountPath": config.store_mount_path}],
    }


def data_path(kc: KernelCache, config: OperatorConfig) -> str:
    """The store directory holding every arch's key of a KernelCache (``<ns>/<name>``)."""
    return f"{config.store_mount_path}/{kc.metadata.namespace}/{kc.metadata.name}"


def cleanup_job(kc: KernelCache, uid: str, config: OperatorConfig) -> dict[str, Any]:
    """Deletes a KernelCache's generations from an existing claim, for its finalizer.

    No owner reference: the owner is being deleted; ``ttlSecondsAfterFinished`` removes it.
    """
    labels = _labels(uid, CLEANUP)
    container = {
        "name": "cleanup",
        "image": config.cleanup_image,
        "command": ["rm", "-rf", "--", data_path(kc, config)],
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": [{"name": "store", "mountPath": config.store_mount_path}],
    }
    pod_spec = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(config),
        "containers": [container],
        "volumes": [{"name": "store", "persistentVolumeClaim": {"claimName": claim_name(kc)}}],
    }
    name = f"kc-{_dns(kc.metadata.name)[:40].rstrip('-')}-cleanup-{uid[:8]}"
    return _job(_metadata(kc, name, labels, None), labels, pod_spec, config)


def pod_selector(job: dict[str, Any]) -> str:
    """Selects a Job's pods by the labels its template gives them."""
    labels = job["spec"]["template"]["metadata"]["labels"]
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


PEERING_GROUP = "kopf.dev"
PEERING_VERSION = "v1"


def peering_crds() -> list[dict[str, Any]]:
    """kopf's peering CRDs (ClusterKopfPeering, KopfPeering): replicas meet in their status."""
    crds = []
    for kind, scope in (("ClusterKopfPeering", "Cluster"), ("KopfPeering", "Namespaced")):
        plural = kind.lower() + "s"
        crds.append(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.{PEERING_GROUP}"},
                "spec": {
                    "scope": scope,
                    "group": PEERING_GROUP,
                    "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                    "versions": [
                        {
                            "name": PEERING_VERSION,
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "properties": {
                                        "status": {
                                            "type": "object",
                                            "x-kubernetes-preserve-unknown-fields": True,
                                        }
                                    },
                                }
                            },
                        }
                    ],
                },
            }
        )
    return crds


def peering_object(name: str, namespace: str | None = None) -> dict[str, Any]:
    """The peering object replicas of this operator share (cluster-wide or per namespace)."""
    kind = "KopfPeering" if namespace else "ClusterKopfPeering"
    meta: dict[str, Any] = {"name": name, "labels": {LABEL_MANAGED_BY: MANAGED_BY}}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}", "kind": kind, "metadata": meta}
