"""Admission decisions: inject the verify init-container into serving pods; validate specs.

Pure functions over plain dicts; ``main`` registers them with kopf and turns ``Denied`` into
an admission error. Nothing here talks to the API server except through the ``get`` callable
``lookup`` is handed.

A serving pod labelled ``kernelcache.dev/cache: <name>`` (the KernelCache of that name in the
pod's namespace) gets, as JSON-patch ``add`` operations:

- the init-container ``kernelcache`` (``kernelcache verify``, the image of
  ``OperatorConfig.init_image``): the cache's claim mounted read-only at
  ``OperatorConfig.store_mount_path`` (into it alone), the node name from the downward API,
  the engine image and policy from the KernelCache, ``--materialize /kernelcache``, the
  operator's node map (``kernelcache.nodemap``, a ConfigMap) to learn the node's arch; with
  signing enabled, the public key ``kernelcache.pub`` from the signing Secret (only that key
  is projected, so the pod never sees the private one) and ``--require-signature``;
- the emptyDir ``kernelcache`` at ``/kernelcache``: written by the init-container, read-only
  in every serving container; in ``image`` mode each arch's image volume too, read-only at
  the path the init-container verified it at (``modes``): the env file points the
  toolchains that only read their files there (``KERNELCACHE_IN_PLACE_DIR``);
- in every serving container: ``KERNELCACHE_RUNTIME=1``,
  ``KERNELCACHE_ENV_FILE=/kernelcache/kernelcache.env`` (what verify wrote: the generation
  directory, its name and arch; ``kernelcache.envfile``) and ``KERNELCACHE_STRICT``. A
  variable the container already sets is left as the pod's author wrote it. The policy is
  read from the KernelCache's ``verification.policy`` in one place (here) and reaches each
  process as its own setting: verify's ``--policy``, the runtime's ``KERNELCACHE_STRICT``
  (on the container, so that an env file gone missing cannot make a strict pod permissive);
- for a KernelCache with a vllm warmer: an emptyDir ``kernelcache-vllm-0`` mounted writable
  at the warmer's ``cacheRoot`` in the init-container (verify copies vLLM's cache back there)
  and in every serving container, with ``VLLM_CACHE_ROOT`` set to it (vLLM's cache holds
  absolute paths, and a warm start writes into it).

Pod annotations:

- ``kernelcache.dev/image-policy``: ``deny`` (default) refuses a pod whose serving container
  runs another image than the KernelCache's ``spec.engine.image`` or, while a new image
  builds, the image of a generation its arches still publish (``status.arches[].engineImage``:
  a rollout's pods on the previous image keep starting, and their init-container is told to
  load the generation built for that image); ``warn`` admits it with an
  admission warning (the init-container still verifies the generation against the
  KernelCache's image, and the runtime's stamp check sees the difference). Images are
  compared as container runtimes resolve them (``kernelcache.images``): ``vllm/x:1`` is
  ``docker.io/vllm/x:1``; a reference no runtime would pull is refused under either policy;
- ``kernelcache.dev/containers``: comma-separated names of the serving containers; default
  all of ``spec.containers`` (list them when the pod has sidecars in other images).

A KernelCache's life cycle, as a new labelled pod meets it (``docs/operations.md`` has the
table):

- deleted with its data kept (``retention.deleteDataOnDelete`` false): the finalizer keeps
  its spec in the published record (``manifests.KEPT_FILE``), and the pod is injected from
  that, with an admission warning and a Warning event on the record: the init-container
  verifies the kept generation that CURRENT names, as for a live KernelCache. Deleting the
  record (or the data) ends it: the pod is refused, or its init-container finds no
  generation and the pod does not start;
- being deleted: as above while the data stays; refused when it is deleted with its data;
- never existed (or its record is gone): refused.

Injection happens on CREATE only (a pod's containers cannot change afterwards) and once: a
pod that already has the ``kernelcache`` init-container gets an empty patch. A pod that
mounts the cache's claim writable itself is refused: only the compile Job writes the cache.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from kernelcache import contract, nodemap
from kernelcache.contract import ANNOTATION_CONTAINERS, ANNOTATION_IMAGE_POLICY, LABEL_CACHE
from kernelcache.controller import modes
from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.kube import ApiError, kernelcache_path, path
from kernelcache.controller.manifests import (
    KEPT_FILE,
    SIGNING_DIR,
    TERMINATION_LOG,
    claim_name,
    image_of,
    mount_conflict,
    record_name,
)
from kernelcache.errors import SpecError
from kernelcache.images import InvalidImageReference, parse_image, same_image
from kernelcache.spec import PUBLIC_KEY_FILE, KernelCache, parse_kernelcache

IMAGE_POLICIES = ("deny", "warn")

INIT_CONTAINER = "kernelcache"
CACHE_VOLUME = "kernelcache"
STORE_VOLUME = modes.STORE_VOLUME
KEY_VOLUME = "kernelcache-key"
NODE_MAP_VOLUME = "kernelcache-nodes"
CACHE_DIR = "/kernelcache"
VLLM_VOLUME = "kernelcache-vllm"

Patch = list[dict[str, Any]]


class Denied(Exception):
    """The admission request is refused; the message is one line for the API client."""


def cache_name(pod: dict[str, Any]) -> str | None:
    """The KernelCache a pod asks for by its label; None when it has no such label."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    value = labels.get(LABEL_CACHE)
    return None if value is None else str(value)


def injected(pod: dict[str, Any]) -> bool:
    """Whether the pod already has the init-container (a re-admission)."""
    inits = (pod.get("spec") or {}).get("initContainers") or []
    return any(c.get("name") == INIT_CONTAINER for c in inits)


def _pod_ref(pod: dict[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or meta.get("generateName") or "?"


@dataclass(frozen=True)
class Kept:
    """A KernelCache deleted with its data kept: its last spec, from its published record."""

    record: dict[str, Any]  # the ConfigMap, which the Warning event is posted on
    document: dict[str, Any]  # the KernelCache as the finalizer kept it


def lookup(
    pod: dict[str, Any], get: Callable[[str], dict[str, Any]], operation: str = "CREATE"
) -> dict[str, Any] | Kept | None:
    """The KernelCache a pod needs injected, read with ``get`` (a GET by API path); when it
    does not exist, what its finalizer kept of it (``Kept``).

    None when there is nothing to read: not a CREATE, no label, already injected, or neither
    the KernelCache nor a kept spec exists (which ``mutate_pod`` then refuses).
    """
    name = cache_name(pod)
    namespace, _ = _pod_ref(pod)
    if operation != "CREATE" or not name or not namespace or injected(pod):
        return None
    try:
        return get(kernelcache_path(namespace, name))
    except ApiError as exc:
        if exc.status != 404:
            raise Denied(f"cannot read KernelCache {namespace}/{name}: {exc}") from None
    try:
        record = get(path("v1", "configmaps", namespace, record_name(name)))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise Denied(f"cannot read ConfigMap {namespace}/{record_name(name)}: {exc}") from None
    try:
        document = yaml.safe_load((record.get("data") or {}).get(KEPT_FILE) or "")
    except yaml.YAMLError:
        document = None
    return Kept(record, document) if isinstance(document, dict) else None


def _annotations(obj: dict[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def _serving(pod: dict[str, Any], where: str) -> list[tuple[int, dict[str, Any]]]:
    """The serving containers with their index in ``spec.containers``."""
    containers = list(enumerate((pod.get("spec") or {}).get("containers") or []))
    listed = _annotations(pod).get(ANNOTATION_CONTAINERS)
    if listed is None:
        return containers
    wanted = [n.strip() for n in listed.split(",") if n.strip()]
    names = {c.get("name") for _, c in containers}
    unknown = [n for n in wanted if n not in names]
    if unknown or not wanted:
        raise Denied(
            f"pod {where}: annotation {ANNOTATION_CONTAINERS}={listed!r} names no container "
            f"of the pod ({', '.join(unknown) or 'empty list'})"
        )
    return [(i, c) for i, c in containers if c.get("name") in wanted]


def published_images(kc: KernelCache) -> list[str]:
    """The images of the generations the KernelCache's arches publish now, other than
    ``spec.engine.image``: a new image builds, and pods on the previous one still load the
    generation built for it (``status.arches[].engineImage``)."""
    expected = image_of(kc)
    found: list[str] = []
    for arch in (kc.status.arches if kc.status else None) or []:
        image = arch.engine_image
        if not arch.generation or not image or image in found:
            continue
        try:
            if not same_image(expected, image):
                found.append(image)
        except InvalidImageReference:
            continue  # not an image any pod can run: nothing to admit
    return found


def _check_images(
    pod: dict[str, Any],
    serving: list[tuple[int, dict[str, Any]]],
    kc: KernelCache,
    where: str,
    warnings: list[str] | None,
) -> str:
    """Refuse (deny) or warn about serving containers on another image than the
    KernelCache's; the image the init-container checks the generation against: the pod's own
    where every serving container runs one still published (``published_images``), else
    ``spec.engine.image``."""
    policy = _annotations(pod).get(ANNOTATION_IMAGE_POLICY, "deny")
    if policy not in IMAGE_POLICIES:
        raise Denied(
            f"pod {where}: annotation {ANNOTATION_IMAGE_POLICY}={policy!r}: "
            f"expected one of {', '.join(IMAGE_POLICIES)}"
        )
    expected = image_of(kc)
    kc_ref = f"KernelCache {kc.metadata.namespace}/{kc.metadata.name}"
    try:
        parse_image(expected)
    except InvalidImageReference as exc:
        raise Denied(f"pod {where}: {kc_ref}: spec.engine.image {exc}") from None
    previous = published_images(kc)
    runs: set[str] = set()  # the images the serving containers run, as the KernelCache names them
    for _, container in serving:
        image = str(container.get("image") or "")
        try:
            known = next((i for i in [expected, *previous] if same_image(i, image)), None)
        except InvalidImageReference as exc:
            raise Denied(f"pod {where}: container {container.get('name')!r}: image {exc}") from None
        runs.add(known or expected)
        if known is not None:
            continue
        message = (
            f"pod {where}: container {container.get('name')!r} runs image {image!r}, but "
            f"{kc_ref} caches kernels for spec.engine.image {expected!r}"
        )
        if previous:
            message += f" (and, until that one publishes, {', '.join(map(repr, previous))})"
        if policy == "deny":
            raise Denied(f"{message} (set {ANNOTATION_IMAGE_POLICY}: warn to admit it anyway)")
        if warnings is not None:
            warnings.append(f"{message}; admitted because {ANNOTATION_IMAGE_POLICY} is warn")
    return runs.pop() if len(runs) == 1 else expected


def _check_cache_read_only(pod: dict[str, Any], kc: KernelCache, where: str) -> None:
    """Refuse a pod that mounts the cache's claim writable itself: only the compile Job may
    write the cache, which every serving pod of the KernelCache runs code from."""
    spec = pod.get("spec") or {}
    claim = claim_name(kc)
    writable_volumes = {
        v.get("name")
        for v in spec.get("volumes") or []
        if (v.get("persistentVolumeClaim") or {}).get("claimName") == claim
        and not v["persistentVolumeClaim"].get("readOnly")
    }
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        for mount in container.get("volumeMounts") or []:
            if mount.get("name") in writable_volumes and not mount.get("readOnly"):
                raise Denied(
                    f"pod {where}: container {container.get('name')!r} mounts claim {claim!r}, "
                    f"the cache of KernelCache {kc.metadata.namespace}/{kc.metadata.name}, "
                    "writable; only its compile Job may write it (mount it readOnly)"
                )


def init_container(
    kc: KernelCache, config: OperatorConfig, image: str | None = None
) -> dict[str, Any]:
    """``kernelcache verify`` for this KernelCache: fails closed, so the pod does not start.
    It loads the generation built for ``image`` (default ``spec.engine.image``)."""
    source = modes.serving_source(kc, config)
    args = [
        *source.args,
        "--namespace", kc.metadata.namespace, "--name", kc.metadata.name,
        "--expect-image", image or image_of(kc),
        "--policy", kc.spec.verification.policy,
        "--materialize", CACHE_DIR,
        "--termination-log", TERMINATION_LOG,
        "--node-map", nodemap.MOUNT_DIR,
    ]  # fmt: skip
    mounts = [
        *source.mounts,
        {"name": CACHE_VOLUME, "mountPath": CACHE_DIR},
        {"name": NODE_MAP_VOLUME, "mountPath": nodemap.MOUNT_DIR, "readOnly": True},
    ]
    if kc.spec.verification.signing.enabled:
        args += ["--public-key", f"{SIGNING_DIR}/{PUBLIC_KEY_FILE}", "--require-signature"]
        mounts.append({"name": KEY_VOLUME, "mountPath": SIGNING_DIR, "readOnly": True})
    mounts += vllm_mounts(kc)  # verify puts vLLM's cache back at the root it was built at
    return {
        "name": INIT_CONTAINER,
        "image": config.init_image,
        "command": ["kernelcache", "verify"],
        "args": args,
        "env": [
            {
                "name": contract.NODE_NAME.name,
                "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
            }
        ],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": config.run_as_user,
            "runAsGroup": config.run_as_group,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": mounts,
    }


def volumes(kc: KernelCache, config: OperatorConfig) -> list[dict[str, Any]]:
    """The generation's source (the claim read-only, image volumes, a registry secret, the
    node's prefetched copies: ``modes``), the emptyDir, the node map and, with signing, the
    public key only. The map is optional: without it the init-container says so in one line."""
    found = [
        *modes.serving_source(kc, config).volumes,
        {"name": CACHE_VOLUME, "emptyDir": {}},
        *({"name": m["name"], "emptyDir": {}} for m in vllm_mounts(kc)),
        {
            "name": NODE_MAP_VOLUME,
            "configMap": {"name": nodemap.CONFIGMAP_NAME, "optional": True},
        },
    ]
    signing = kc.spec.verification.signing
    if signing.enabled and signing.secret_name:
        items = [{"key": PUBLIC_KEY_FILE, "path": PUBLIC_KEY_FILE}]
        found.append(
            {"name": KEY_VOLUME, "secret": {"secretName": signing.secret_name, "items": items}}
        )
    return found


def vllm_mounts(kc: KernelCache) -> list[dict[str, Any]]:
    """vLLM's cache roots, writable (a warm start writes into them), in init and serving."""
    roots = kc.spec.vllm_cache_roots()
    return [{"name": f"{VLLM_VOLUME}-{i}", "mountPath": root} for i, root in enumerate(roots)]


def _pull_secrets(
    spec: dict[str, Any], kc: KernelCache, config: OperatorConfig
) -> list[dict[str, str]]:
    """The secrets the kubelet needs to pull the image volumes (image mode), unless listed."""
    have = {s.get("name") for s in spec.get("imagePullSecrets") or []}
    wanted = modes.serving_source(kc, config).pull_secrets
    return [{"name": name} for name in wanted if name not in have]


def serving_env(kc: KernelCache) -> list[dict[str, str]]:
    """The variables every serving container gets."""
    env = {
        contract.RUNTIME.name: "1",
        contract.ENV_FILE_PATH.name: f"{CACHE_DIR}/{contract.ENV_FILE}",
        # On the container, not in the env file: a file that went missing must not turn a
        # strict pod permissive.
        contract.STRICT.name: "1" if kc.spec.verification.policy == "strict" else "0",
    }
    if roots := kc.spec.vllm_cache_roots():
        env["VLLM_CACHE_ROOT"] = roots[0]
    if kc.spec.vllm_version_check() == "warn":  # the spec tries a vLLM outside the range
        env[contract.VLLM_VERSION_CHECK.name] = "warn"
    return [{"name": k, "value": v} for k, v in env.items()]


def _append(ops: Patch, obj: dict[str, Any], path: str, key: str, items: list[Any]) -> None:
    """``add`` ops appending ``items`` to the list ``obj[key]`` at ``path``, made if absent."""
    if not items:
        return
    if key not in obj or obj[key] is None:
        ops.append({"op": "add", "path": f"{path}/{key}", "value": items})
    else:
        ops.extend({"op": "add", "path": f"{path}/{key}/-", "value": item} for item in items)


def mutate_pod(
    pod: dict[str, Any],
    kernelcache: dict[str, Any] | Kept | None,
    config: OperatorConfig,
    *,
    operation: str = "CREATE",
    warnings: list[str] | None = None,
) -> Patch:
    """JSON-patch ops that make a labelled pod verify and use its KernelCache's generation.

    Empty for a pod without the label, one already injected, or any operation but CREATE.
    Raises ``Denied`` when the KernelCache does not exist or is invalid, when a serving
    container's image differs from ``spec.engine.image`` under the deny image policy, when a
    container of the pod mounts the cache's claim writable, or when a name the injection
    needs is already taken in the pod. Image warnings (warn policy) are appended to
    ``warnings``.
    """
    name = cache_name(pod)
    if operation != "CREATE" or name is None or injected(pod):
        return []
    namespace, pod_name = _pod_ref(pod)
    where = f"{namespace}/{pod_name}"
    if not namespace:
        raise Denied(f"pod {pod_name}: no metadata.namespace to find its KernelCache in")
    if not name:
        raise Denied(f"pod {where}: label {LABEL_CACHE} is empty; set it to a KernelCache name")
    if kernelcache is None:
        raise Denied(
            f"pod {where}: KernelCache {namespace}/{name} (label {LABEL_CACHE}) does not exist"
        )
    document = kernelcache.document if isinstance(kernelcache, Kept) else kernelcache
    try:
        kc = parse_kernelcache(document, f"KernelCache {namespace}/{name}")
    except SpecError as exc:
        raise Denied(exc.message) from None
    if (notice := _life_cycle(kernelcache, kc, where)) and warnings is not None:
        warnings.append(notice)  # the first one: main also posts it as a Warning event

    spec = pod.get("spec") or {}
    serving = _serving(pod, where)
    image = _check_images(pod, serving, kc, where, warnings)
    _check_cache_read_only(pod, kc, where)
    new_volumes = volumes(kc, config)
    taken = {v.get("name") for v in spec.get("volumes") or []} & {v["name"] for v in new_volumes}
    if taken:
        raise Denied(f"pod {where}: volume {sorted(taken)[0]!r} exists; kernelcache needs the name")

    ops: Patch = []
    _append(ops, spec, "/spec", "initContainers", [init_container(kc, config, image)])
    _append(ops, spec, "/spec", "volumes", new_volumes)
    _append(ops, spec, "/spec", "imagePullSecrets", _pull_secrets(spec, kc, config))
    env = serving_env(kc)
    mount = {"name": CACHE_VOLUME, "mountPath": CACHE_DIR, "readOnly": True}
    mounts = [mount, *vllm_mounts(kc), *modes.serving_source(kc, config).serving_mounts]
    for i, container in serving:
        taken_paths = {m.get("mountPath") for m in container.get("volumeMounts") or []}
        if clash := [m["mountPath"] for m in mounts if m["mountPath"] in taken_paths]:
            raise Denied(
                f"pod {where}: container {container.get('name')!r} mounts {clash[0]} already"
            )
        have = {e.get("name") for e in container.get("env") or []}
        _append(
            ops,
            container,
            f"/spec/containers/{i}",
            "env",
            [e for e in env if e["name"] not in have],
        )
        _append(ops, container, f"/spec/containers/{i}", "volumeMounts", mounts)
    return ops


def life_cycle_object(kernelcache: dict[str, Any] | Kept | None) -> dict[str, Any] | None:
    """What a pod's deleted or deleting KernelCache's Warning event is posted on: the record
    of a deleted one, the KernelCache being deleted; None for a live one."""
    if isinstance(kernelcache, Kept):
        return kernelcache.record
    if kernelcache and (kernelcache.get("metadata") or {}).get("deletionTimestamp"):
        return kernelcache
    return None


def _life_cycle(kernelcache: dict[str, Any] | Kept, kc: KernelCache, where: str) -> str | None:
    """The warning for a pod of a KernelCache that is deleted or being deleted with its data
    kept; ``Denied`` when its data is being deleted (the pod would load nothing)."""
    ref = f"KernelCache {kc.metadata.namespace}/{kc.metadata.name}"
    record = record_name(kc)
    if isinstance(kernelcache, Kept):
        return (
            f"pod {where}: {ref} was deleted; the pod loads its kept generations until "
            f"ConfigMap {record} or the data is deleted"
        )
    if not (kernelcache.get("metadata") or {}).get("deletionTimestamp"):
        return None
    if kc.spec.retention.delete_data_on_delete:
        raise Denied(
            f"pod {where}: {ref} is being deleted with its data "
            "(retention.deleteDataOnDelete); there is nothing for the pod to load"
        )
    return f"pod {where}: {ref} is being deleted; the pod loads its kept generations"


def apply_ops(obj: dict[str, Any], ops: Patch) -> dict[str, Any]:
    """A copy of ``obj`` with the ``add`` ops of ``mutate_pod`` applied (RFC 6902 ``add``)."""
    result = copy.deepcopy(obj)
    for op in ops:
        if op["op"] != "add":
            raise ValueError(f"only add ops are applied here, got {op['op']!r}")
        *parents, last = op["path"].split("/")[1:]
        target: Any = result
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        value = copy.deepcopy(op["value"])
        if isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), value)
        else:
            target[last] = value
    return result


def spec_patch(pod: dict[str, Any], ops: Patch) -> dict[str, Any]:
    """The ops as a merge patch of the pod's spec: each list they touch, whole and updated.

    kopf takes handler patches as merge patches and sends the API server their JSON-patch
    difference from the admitted pod, so this yields the same change as ``ops``.
    """
    touched = {op["path"].split("/")[2] for op in ops}
    new_spec = apply_ops(pod, ops)["spec"]
    return {key: new_spec[key] for key in sorted(touched)}


def validate_kernelcache(
    obj: dict[str, Any], operation: str = "CREATE", config: OperatorConfig | None = None
) -> None:
    """Refuse a KernelCache the CRD schema admits but the spec rules do not.

    ``parse_kernelcache`` holds the cross-field rules (exactly one storage source, a signing
    secret when signing is on, unique GPU classes and warmers, fields per warmer type); its
    one-line message names the field. Deletions and objects being deleted pass: a finalizer
    must always be removable, even from an object admitted before this webhook existed.
    """
    meta = obj.get("metadata") or {}
    if operation == "DELETE" or meta.get("deletionTimestamp"):
        return
    source = f"KernelCache {meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"
    try:
        kc = parse_kernelcache(obj, source)
    except SpecError as exc:
        raise Denied(exc.message) from None
    if config is not None and (why := mount_conflict(kc, config)) is not None:
        raise Denied(f"{source}: spec.modelVolume.mountPath: {why}")
