"""Admission: the pod injection and the KernelCache validation, on real AdmissionReview JSON.

Each request is an ``admission.k8s.io/v1`` AdmissionReview as the API server sends it: a Pod
made by a ReplicaSet (``generateName``, no name yet), already defaulted and given its
service-account token volume by the built-in admission plugins that run before webhooks.
The pure functions of ``kernelcache.controller.webhook`` are tested on it directly, and the
operator's kopf registrations through kopf's own admission entry point
(``serve_admission_request``, what kopf's webhook server calls), with a fake API client.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

kopf = pytest.importorskip("kopf", reason="needs kernelcache[operator]")
jsonpatch = pytest.importorskip("jsonpatch", reason="comes with kopf")

from kernelcache.controller.config import OperatorConfig  # noqa: E402
from kernelcache.controller.kube import ApiError, kernelcache_path  # noqa: E402
from kernelcache.controller.webhook import (  # noqa: E402
    ANNOTATION_CONTAINERS,
    ANNOTATION_IMAGE_POLICY,
    Denied,
    Kept,
    apply_ops,
    lookup,
    mutate_pod,
    spec_patch,
    validate_kernelcache,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "kernelcache.yaml"
IMAGE = "ghcr.io/kernelcache/examples:0.1.0"
CONFIG = OperatorConfig(init_image="ghcr.io/kernelcache/kernelcache-init:0.1.0")

# A Deployment's pod at admission: defaulted, token volume added, no name, no node yet.
POD_REVIEW = """
{
  "kind": "AdmissionReview",
  "apiVersion": "admission.k8s.io/v1",
  "request": {
    "uid": "0df28fbd-5f5f-11e8-bc74-36e6bb280816",
    "kind": {"group": "", "version": "v1", "kind": "Pod"},
    "resource": {"group": "", "version": "v1", "resource": "pods"},
    "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
    "requestResource": {"group": "", "version": "v1", "resource": "pods"},
    "namespace": "team-a",
    "operation": "CREATE",
    "userInfo": {
      "username": "system:serviceaccount:kube-system:replicaset-controller",
      "uid": "3a4c2f1e-0b5d-4e8f-9a61-2d7c8b9e0f13",
      "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system",
                 "system:authenticated"]
    },
    "object": {
      "kind": "Pod",
      "apiVersion": "v1",
      "metadata": {
        "generateName": "llama-7d9f8c6b5-",
        "namespace": "team-a",
        "creationTimestamp": null,
        "labels": {
          "app": "llama",
          "pod-template-hash": "7d9f8c6b5",
          "kernelcache.dev/cache": "demo"
        },
        "ownerReferences": [{
          "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llama-7d9f8c6b5",
          "uid": "b2e1c3d4-5f6a-4b7c-8d9e-0f1a2b3c4d5e",
          "controller": true, "blockOwnerDeletion": true
        }],
        "managedFields": [{
          "manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
          "time": "2025-05-01T12:00:00Z", "fieldsType": "FieldsV1",
          "fieldsV1": {"f:metadata": {"f:generateName": {}}}
        }]
      },
      "spec": {
        "volumes": [{
          "name": "kube-api-access-x2b9q",
          "projected": {
            "sources": [
              {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
              {"configMap": {"name": "kube-root-ca.crt",
                             "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
              {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
                "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}
            ],
            "defaultMode": 420
          }
        }],
        "containers": [{
          "name": "vllm",
          "image": "ghcr.io/kernelcache/examples:0.1.0",
          "args": ["--model", "example/elementwise-and-tiled", "--port", "8000"],
          "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
          "env": [{"name": "HF_HOME", "value": "/models"}],
          "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}},
          "volumeMounts": [{
            "name": "kube-api-access-x2b9q", "readOnly": true,
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"
          }],
          "terminationMessagePath": "/dev/termination-log",
          "terminationMessagePolicy": "File",
          "imagePullPolicy": "IfNotPresent"
        }],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "serviceAccount": "default",
        "securityContext": {},
        "schedulerName": "default-scheduler",
        "tolerations": [
          {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
           "effect": "NoExecute", "tolerationSeconds": 300},
          {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
           "effect": "NoExecute", "tolerationSeconds": 300}
        ],
        "priority": 0,
        "enableServiceLinks": true,
        "preemptionPolicy": "PreemptLowerPriority"
      },
      "status": {}
    },
    "oldObject": null,
    "dryRun": false,
    "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
  }
}
"""


def pod_review(**changes: Any) -> dict[str, Any]:
    """The review above; ``annotations`` / ``image`` / ``labels`` change its pod."""
    review = json.loads(POD_REVIEW)
    pod = review["request"]["object"]
    if "annotations" in changes:
        pod["metadata"]["annotations"] = changes["annotations"]
    if "image" in changes:
        pod["spec"]["containers"][0]["image"] = changes["image"]
    if "labels" in changes:
        pod["metadata"]["labels"] = changes["labels"]
    return review


def the_pod(**changes: Any) -> dict[str, Any]:
    pod: dict[str, Any] = pod_review(**changes)["request"]["object"]
    return pod


def kernelcache(
    policy: str = "strict", annotations: dict[str, str] | None = None, **spec: Any
) -> dict[str, Any]:
    """The example KernelCache in the pod's namespace, as the API server returns it."""
    kc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    kc["metadata"].update(
        namespace="team-a",
        uid="6f1d2c3b-4a5e-4f60-8b7c-9d0e1f2a3b4c",
        resourceVersion="4711",
        generation=1,
        annotations=annotations or {},
    )
    kc["spec"]["verification"]["policy"] = policy
    kc["spec"].update(spec)
    kc["status"] = {"phase": "Ready", "readyArches": "2/2"}
    return kc


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def mutated(pod: dict[str, Any], kc: dict[str, Any] | None) -> dict[str, Any]:
    ops = mutate_pod(pod, kc, CONFIG)
    result: dict[str, Any] = jsonpatch.apply_patch(pod, ops)
    return result


# -- the pure functions ------------------------------------------------------------------------


def test_patch_adds_exactly_the_init_container_volumes_mounts_and_env() -> None:
    pod = the_pod()
    ops = mutate_pod(pod, kernelcache(), CONFIG)
    assert all(op["op"] == "add" for op in ops)
    assert [op["path"] for op in ops] == [
        "/spec/initContainers",  # the pod had none: the list is created
        "/spec/volumes/-",
        "/spec/volumes/-",
        "/spec/volumes/-",
        "/spec/containers/0/env/-",
        "/spec/containers/0/env/-",
        "/spec/containers/0/env/-",
        "/spec/containers/0/volumeMounts/-",
    ]
    new = jsonpatch.apply_patch(pod, ops)
    assert apply_ops(pod, ops) == new  # the applier kopf's merge patch is built with agrees

    # Everything else is untouched: remove what was added and the original remains.
    stripped = copy.deepcopy(new)
    del stripped["spec"]["initContainers"]
    stripped["spec"]["volumes"] = stripped["spec"]["volumes"][:1]
    serving = stripped["spec"]["containers"][0]
    serving["env"] = serving["env"][:1]
    serving["volumeMounts"] = serving["volumeMounts"][:1]
    assert stripped == pod

    (init,) = new["spec"]["initContainers"]
    assert init["name"] == "kernelcache"
    assert init["image"] == CONFIG.init_image
    assert init["command"] == ["kernelcache", "verify"]
    assert init["args"] == [
        "--store", CONFIG.store_mount_path,
        "--namespace", "team-a", "--name", "demo",
        "--expect-image", IMAGE,
        "--policy", "strict",
        "--materialize", "/kernelcache",
        "--termination-log", "/dev/termination-log",
        "--node-map", "/etc/kernelcache/nodes",
    ]  # fmt: skip
    assert init["env"] == [
        {"name": "KERNELCACHE_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    ]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    security = init["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] >= 1
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert init["volumeMounts"] == [
        {"name": "kernelcache-store", "mountPath": CONFIG.store_mount_path, "readOnly": True},
        {"name": "kernelcache", "mountPath": "/kernelcache"},
        {"name": "kernelcache-nodes", "mountPath": "/etc/kernelcache/nodes", "readOnly": True},
    ]

    volumes = {v["name"]: v for v in new["spec"]["volumes"]}
    assert volumes["kernelcache-store"]["persistentVolumeClaim"] == {
        "claimName": "kernelcache-demo",  # the claim the operator creates for spec.storage.pvc
        "readOnly": True,
    }
    assert volumes["kernelcache"] == {"name": "kernelcache", "emptyDir": {}}
    # The operator's node map: optional, so a namespace without one fails in one line.
    assert volumes["kernelcache-nodes"] == {
        "name": "kernelcache-nodes",
        "configMap": {"name": "kernelcache-nodes", "optional": True},
    }

    container = new["spec"]["containers"][0]
    assert container["volumeMounts"][-1] == {
        "name": "kernelcache",
        "mountPath": "/kernelcache",
        "readOnly": True,
    }
    assert all(m["name"] != "kernelcache-store" for m in container["volumeMounts"])
    assert env_of(container) == {
        "HF_HOME": "/models",
        "KERNELCACHE_RUNTIME": "1",
        "KERNELCACHE_ENV_FILE": "/kernelcache/kernelcache.env",
        "KERNELCACHE_STRICT": "1",
    }


def test_patched_pod_is_well_formed() -> None:
    """Every mount names a volume, names are unique, no serving container can write the cache."""
    new = mutated(the_pod(), kernelcache())
    spec = new["spec"]
    volume_names = [v["name"] for v in spec["volumes"]]
    assert len(volume_names) == len(set(volume_names))
    every = spec["initContainers"] + spec["containers"]
    assert len({c["name"] for c in every}) == len(every)
    for container in every:
        names = [e["name"] for e in container.get("env", [])]
        assert len(names) == len(set(names))
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volume_names
    for container in spec["containers"]:
        for mount in container["volumeMounts"]:
            if mount["name"].startswith("kernelcache"):
                assert mount["readOnly"] is True


def test_readmission_of_a_patched_pod_gets_an_empty_patch() -> None:
    new = mutated(the_pod(), kernelcache())
    assert mutate_pod(new, kernelcache(), CONFIG) == []

    def get(_: str) -> dict[str, Any]:
        raise AssertionError("a re-admission reads nothing")

    assert lookup(new, get) is None


def test_no_label_and_non_create_get_an_empty_patch() -> None:
    assert mutate_pod(the_pod(labels={"app": "llama"}), None, CONFIG) == []
    assert mutate_pod(the_pod(), kernelcache(), CONFIG, operation="UPDATE") == []


def test_missing_kernelcache_is_denied_naming_it() -> None:
    read = []

    def get(path: str) -> dict[str, Any]:
        read.append(path)
        raise ApiError(404, "NotFound", "not found")

    pod = the_pod()
    assert lookup(pod, get) is None
    # The KernelCache, then the record where a finalizer would have kept its spec.
    assert read == [kernelcache_path("team-a", "demo"), RECORD_PATH]
    with pytest.raises(Denied, match=r"KernelCache team-a/demo \(label kernelcache.dev/cache\)"):
        mutate_pod(pod, None, CONFIG)


RECORD_PATH = "/api/v1/namespaces/team-a/configmaps/kc-demo-published"


def record(kept: dict[str, Any] | None) -> dict[str, Any]:
    """The published record as the finalizer leaves it when the data stays."""
    data = {"published.json": '{"arches": {}, "claim": "kernelcache-demo"}'}
    if kept is not None:
        doc = {k: kept[k] for k in ("apiVersion", "kind", "spec")}
        doc["metadata"] = {"name": "demo", "namespace": "team-a"}
        data["kept.yaml"] = yaml.safe_dump(doc)
    meta = {"name": "kc-demo-published", "namespace": "team-a", "uid": "r1"}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def deleted(kept: dict[str, Any] | None) -> Any:
    def get(path: str) -> dict[str, Any]:
        if path == RECORD_PATH:
            return record(kept)
        raise ApiError(404, "NotFound", "not found")

    return get


def test_a_deleted_kernelcache_whose_data_is_kept_still_injects_with_a_warning() -> None:
    """A Deployment can scale and replace its pods: they verify the kept generation."""
    pod, live = the_pod(), kernelcache()
    found = lookup(pod, deleted(live))
    assert isinstance(found, Kept) and found.record["metadata"]["name"] == "kc-demo-published"
    warnings: list[str] = []
    ops = mutate_pod(pod, found, CONFIG, warnings=warnings)
    assert ops == mutate_pod(pod, live, CONFIG)  # the same init-container, volumes and env
    assert warnings == [
        "pod team-a/llama-7d9f8c6b5-: KernelCache team-a/demo was deleted; the pod loads its "
        "kept generations until ConfigMap kc-demo-published or the data is deleted"
    ]
    # The record without a kept spec (its data was deleted, or nothing was kept): refused.
    assert lookup(pod, deleted(None)) is None


def test_a_kernelcache_being_deleted_injects_only_while_its_data_stays() -> None:
    pod = the_pod()
    going = kernelcache()
    going["metadata"]["deletionTimestamp"] = "2026-01-02T03:04:05Z"
    warnings: list[str] = []
    assert mutate_pod(pod, going, CONFIG, warnings=warnings)
    assert warnings == [
        "pod team-a/llama-7d9f8c6b5-: KernelCache team-a/demo is being deleted; the pod loads "
        "its kept generations"
    ]
    going["spec"]["retention"]["deleteDataOnDelete"] = True
    with pytest.raises(Denied, match=r"is being deleted with its data \(retention"):
        mutate_pod(pod, going, CONFIG)


def test_unreadable_kernelcache_is_denied() -> None:
    def get(_: str) -> dict[str, Any]:
        raise ApiError(403, "Forbidden", "cannot get resource")

    with pytest.raises(Denied, match="cannot read KernelCache team-a/demo: 403 Forbidden"):
        lookup(the_pod(), get)


def test_image_mismatch_is_denied_by_default() -> None:
    pod = the_pod(image="ghcr.io/kernelcache/examples:0.2.0")
    with pytest.raises(Denied) as denied:
        mutate_pod(pod, kernelcache(), CONFIG)
    message = str(denied.value)
    assert "\n" not in message
    assert "'vllm'" in message and "examples:0.2.0" in message and IMAGE in message
    assert "spec.engine.image" in message


def test_image_mismatch_is_admitted_with_a_warning_under_warn() -> None:
    pod = the_pod(
        image="ghcr.io/kernelcache/examples:0.2.0",
        annotations={ANNOTATION_IMAGE_POLICY: "warn"},
    )
    warnings: list[str] = []
    ops = mutate_pod(pod, kernelcache(), CONFIG, warnings=warnings)
    assert ops
    (warning,) = warnings
    assert "examples:0.2.0" in warning and "warn" in warning


def test_during_an_image_change_pods_on_the_still_published_image_are_admitted() -> None:
    """spec.engine.image moved to 0.2.0 while each arch still publishes 0.1.0's generation: a
    rollout's pods on 0.1.0 keep starting, told to load the generation built for 0.1.0; pods
    on 0.2.0 are told to load 0.2.0's (refused until it publishes); any other image is denied,
    naming both."""
    old, new = IMAGE, "ghcr.io/kernelcache/examples:0.2.0"
    kc = kernelcache(engine={"image": new})
    kc["status"]["arches"] = [
        {"arch": "sm_90a", "phase": "Compiling", "generation": "g1", "engineImage": old},
        {"arch": "sm_120a", "phase": "Pending"},  # never published: admits nothing more
    ]
    for runs in (old, new):
        init = mutated(the_pod(image=runs), kc)["spec"]["initContainers"][0]
        assert init["args"][init["args"].index("--expect-image") + 1] == runs
    with pytest.raises(Denied) as denied:
        mutate_pod(the_pod(image="ghcr.io/kernelcache/examples:0.3.0"), kc, CONFIG)
    assert new in str(denied.value) and f"until that one publishes, '{old}'" in str(denied.value)
    # Once 0.2.0's generation publishes, a pod on 0.1.0 is another image again.
    kc["status"]["arches"][0].update(generation="g2", engineImage=new)
    with pytest.raises(Denied):
        mutate_pod(the_pod(image=old), kc, CONFIG)


@pytest.mark.parametrize(
    ("cached", "runs"),
    [
        ("vllm/vllm-openai:v0.12.0", "docker.io/vllm/vllm-openai:v0.12.0"),
        ("docker.io/vllm/vllm-openai:v0.12.0", "index.docker.io/vllm/vllm-openai:v0.12.0"),
        ("ubuntu", "docker.io/library/ubuntu:latest"),
    ],
)
def test_an_image_named_another_way_runtimes_resolve_alike_is_admitted(
    cached: str, runs: str
) -> None:
    new = mutated(the_pod(image=runs), kernelcache(engine={"image": cached}))
    args = new["spec"]["initContainers"][0]["args"]
    assert args[args.index("--expect-image") + 1] == cached


def test_an_image_reference_no_runtime_pulls_is_denied_in_one_line() -> None:
    pod = the_pod(image="ghcr.io/KernelCache/examples:0.1.0")
    for policy in ("deny", "warn"):
        pod["metadata"]["annotations"] = {ANNOTATION_IMAGE_POLICY: policy}
        with pytest.raises(Denied) as denied:
            mutate_pod(pod, kernelcache(), CONFIG)
        message = str(denied.value)
        assert "\n" not in message
        assert "container 'vllm'" in message and "must be lowercase" in message, message


def test_bad_image_policy_is_denied() -> None:
    pod = the_pod(annotations={ANNOTATION_IMAGE_POLICY: "allow"})
    with pytest.raises(Denied, match=r"kernelcache\.dev/image-policy='allow'"):
        mutate_pod(pod, kernelcache(), CONFIG)


def test_pinned_digest_accepts_the_same_digest_from_a_mirror() -> None:
    digest = "sha256:" + "ab" * 32
    kc = kernelcache(engine={"image": IMAGE, "imageDigest": digest})
    new = mutated(the_pod(image=f"mirror.local/examples@{digest}"), kc)
    assert f"{IMAGE}@{digest}" in new["spec"]["initContainers"][0]["args"]


def test_sidecars_are_left_alone_when_serving_containers_are_named() -> None:
    pod = the_pod(annotations={ANNOTATION_CONTAINERS: "vllm"})
    pod["spec"]["containers"].append({"name": "proxy", "image": "envoyproxy/envoy:v1.31"})
    new = mutated(pod, kernelcache())
    assert "env" not in new["spec"]["containers"][1]
    assert "KERNELCACHE_RUNTIME" in env_of(new["spec"]["containers"][0])
    with pytest.raises(Denied, match="envoy"):
        mutate_pod(the_pod() | {"spec": pod["spec"]}, kernelcache(), CONFIG)


def test_strict_and_permissive_env() -> None:
    strict = mutated(the_pod(), kernelcache("strict"))
    permissive = mutated(the_pod(), kernelcache("permissive"))
    # One policy, each process's own setting: verify's --policy and the runtime's variable,
    # on the container itself (never only in the env file, which could go missing).
    for pod, policy, flag in ((strict, "strict", "1"), (permissive, "permissive", "0")):
        (init,) = pod["spec"]["initContainers"]
        assert init["args"][init["args"].index("--policy") + 1] == policy
        assert env_of(pod["spec"]["containers"][0])["KERNELCACHE_STRICT"] == flag
    assert env_of(permissive["spec"]["containers"][0])["KERNELCACHE_RUNTIME"] == "1"


def test_flashinfer_jit_is_left_to_the_serving_side() -> None:
    """The generation's own FlashInfer AOT modules decide FLASHINFER_DISABLE_JIT in serving;
    the webhook, which cannot see the generation, sets it under no annotation."""
    aot = {"kernelcache.dev/flashinfer-aot": "true"}
    for kc in (kernelcache(annotations=aot), kernelcache(), kernelcache("permissive")):
        serving = mutated(the_pod(), kc)["spec"]["containers"][0]
        assert "FLASHINFER_DISABLE_JIT" not in env_of(serving)


def test_a_variable_the_pod_sets_is_kept() -> None:
    pod = the_pod()
    pod["spec"]["containers"][0]["env"].append({"name": "KERNELCACHE_RUNTIME", "value": "0"})
    container = mutated(pod, kernelcache())["spec"]["containers"][0]
    assert [e for e in container["env"] if e["name"] == "KERNELCACHE_RUNTIME"] == [
        {"name": "KERNELCACHE_RUNTIME", "value": "0"}
    ]


def test_signing_projects_only_the_public_key() -> None:
    kc = kernelcache()
    kc["spec"]["verification"]["signing"] = {"enabled": True, "secretName": "demo-signing"}
    new = mutated(the_pod(), kc)
    init = new["spec"]["initContainers"][0]
    assert init["args"][-3:] == [
        "--public-key",
        "/etc/kernelcache/signing/kernelcache.pub",
        "--require-signature",
    ]
    key = next(v for v in new["spec"]["volumes"] if v["name"] == "kernelcache-key")
    assert key["secret"] == {
        "secretName": "demo-signing",
        "items": [{"key": "kernelcache.pub", "path": "kernelcache.pub"}],
    }
    assert all(m["name"] != "kernelcache-key" for m in new["spec"]["containers"][0]["volumeMounts"])


def test_a_taken_volume_name_is_denied() -> None:
    pod = the_pod()
    pod["spec"]["volumes"].append({"name": "kernelcache", "emptyDir": {}})
    with pytest.raises(Denied, match="volume 'kernelcache' exists"):
        mutate_pod(pod, kernelcache(), CONFIG)


def test_spec_patch_is_the_same_change_as_a_merge_patch() -> None:
    pod = the_pod()
    ops = mutate_pod(pod, kernelcache(), CONFIG)
    merged = {**pod, "spec": {**pod["spec"], **spec_patch(pod, ops)}}
    assert merged == jsonpatch.apply_patch(pod, ops)
    assert sorted(spec_patch(pod, ops)) == ["containers", "initContainers", "volumes"]


def test_validation_accepts_the_example() -> None:
    validate_kernelcache(kernelcache())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            {"storage": {"existingClaim": "models", "pvc": {"size": "10Gi"}}},
            "spec.storage: set exactly one of existingClaim or pvc",
        ),
        (
            {"verification": {"signing": {"enabled": True}}},
            "spec.verification.signing.secretName: required when enabled is true",
        ),
        (
            {"warmers": [{"type": "command", "entryPoints": ["m:f"], "command": ["true"]}]},
            "spec.warmers[0].entryPoints: not allowed for a command warmer",
        ),
    ],
)
def test_validation_rejects_cross_field_errors_naming_the_field(
    change: dict[str, Any], field: str
) -> None:
    kc = kernelcache()
    kc["spec"].update(change)
    with pytest.raises(Denied) as denied:
        validate_kernelcache(kc)
    assert str(denied.value) == f"KernelCache team-a/demo: {field}"


@pytest.mark.parametrize(
    ("mount", "said"),
    [
        ("/var/lib/kernelcache", "is /var/lib/kernelcache, where the compile Job mounts the store"),
        ("/var/lib/kernelcache/models", "is inside /var/lib/kernelcache"),
        ("/var", "is above /var/lib/kernelcache"),
        ("/etc/kernelcache", "is above /etc/kernelcache/spec"),
        ("/tmp/model", "is inside /tmp"),
    ],
)
def test_a_model_mounted_over_the_jobs_own_mounts_is_refused_naming_the_field(
    mount: str, said: str
) -> None:
    kc = kernelcache(modelVolume={"mountPath": mount, "configMap": {"name": "qwen-config"}})
    validate_kernelcache(kc)  # the spec alone is fine: the store's path is the operator's
    with pytest.raises(Denied) as denied:
        validate_kernelcache(kc, "CREATE", CONFIG)
    assert str(denied.value).startswith(
        f"KernelCache team-a/demo: spec.modelVolume.mountPath: {mount} {said}"
    )
    fine = kernelcache(modelVolume={"mountPath": "/models/m", "configMap": {"name": "c"}})
    validate_kernelcache(fine, "CREATE", CONFIG)


def test_validation_lets_an_object_being_deleted_through() -> None:
    kc = kernelcache(storage={"existingClaim": "models", "pvc": {"size": "10Gi"}})
    kc["metadata"]["deletionTimestamp"] = "2025-05-01T12:00:00Z"
    validate_kernelcache(kc, "UPDATE")
    validate_kernelcache(kc, "DELETE")


# -- through kopf's admission machinery and the operator's registrations -----------------------


class FakeKube:
    """Answers GETs from a dict (anything else is a 404); keeps what is created."""

    def __init__(self, objects: dict[str, dict[str, Any]]) -> None:
        self.objects = objects
        self.gets: list[str] = []
        self.created: list[tuple[str, dict[str, Any]]] = []

    def create(self, collection: str, body: dict[str, Any]) -> bool:
        self.created.append((collection, body))
        return True

    def get(self, path: str) -> dict[str, Any]:
        self.gets.append(path)
        if path not in self.objects:
            raise ApiError(404, "NotFound", f"{path} not found")
        return copy.deepcopy(self.objects[path])


def admit(review: dict[str, Any], kube: FakeKube, reason: str) -> dict[str, Any]:
    """Run one AdmissionReview through kopf as its webhook server would; the response."""
    from kopf._cogs.structs import references
    from kopf._core.engines import admission, indexing
    from kopf._core.intents import causes
    from kopf._core.reactor import inventory

    import kernelcache.controller.main  # noqa: F401  (registers the handlers)

    pods = references.Resource(
        "", "v1", "pods", kind="Pod", singular="pod", namespaced=True, preferred=True
    )
    kcs = references.Resource(
        "kernelcache.dev",
        "v1alpha1",
        "kernelcaches",
        kind="KernelCache",
        singular="kernelcache",
        shortcuts=frozenset({"kc"}),
        namespaced=True,
        preferred=True,
    )
    insights = references.Insights()
    insights.webhook_resources.update({pods, kcs})
    memo = kopf.Memo()
    memo.kube = kube

    async def serve() -> dict[str, Any]:
        response = await admission.serve_admission_request(
            review,
            reason=causes.WebhookType(reason),
            settings=kopf.OperatorSettings(),
            memories=inventory.ResourceMemories(),
            memobase=memo,
            registry=kopf.get_default_registry(),
            insights=insights,
            indices=indexing.OperatorIndexers().indices,
        )
        return dict(response)

    return asyncio.run(serve())


def kc_review(kc: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    review = json.loads(POD_REVIEW)
    request = review["request"]
    request.update(
        kind={"group": "kernelcache.dev", "version": "v1alpha1", "kind": "KernelCache"},
        resource={"group": "kernelcache.dev", "version": "v1alpha1", "resource": "kernelcaches"},
        userInfo={"username": "alice", "groups": ["system:authenticated"]},
        operation=operation,
        name=kc["metadata"]["name"],
        object=kc,
    )
    request["requestKind"], request["requestResource"] = request["kind"], request["resource"]
    return review


def test_kopf_mutating_webhook_patches_the_pod() -> None:
    kube = FakeKube({kernelcache_path("team-a", "demo"): kernelcache()})
    review = pod_review()
    response = admit(review, kube, "mutating")
    assert response["apiVersion"] == "admission.k8s.io/v1"
    answer = response["response"]
    assert answer["uid"] == review["request"]["uid"]
    assert answer["allowed"] is True
    assert answer["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(answer["patch"]))
    pod = review["request"]["object"]
    # kopf re-derives the ops from our merge patch; applied, they make the same pod.
    assert jsonpatch.apply_patch(pod, ops) == mutated(pod, kernelcache())
    assert kube.gets == [kernelcache_path("team-a", "demo")]

    readmitted = pod_review()
    readmitted["request"]["object"] = jsonpatch.apply_patch(pod, ops)
    again = admit(readmitted, kube, "mutating")["response"]
    assert again["allowed"] is True and "patch" not in again
    assert len(kube.gets) == 1  # nothing read on re-admission


def test_kopf_mutating_webhook_denies_a_missing_kernelcache() -> None:
    answer = admit(pod_review(), FakeKube({}), "mutating")["response"]
    assert answer["allowed"] is False
    assert answer["status"]["code"] == 403
    assert "KernelCache team-a/demo" in answer["status"]["message"]
    assert "does not exist" in answer["status"]["message"]


def test_kopf_mutating_webhook_injects_a_deleted_kernelcaches_pod_with_a_warning_event() -> None:
    """Through kopf's admission entry point, which runs no event queue: the event is posted
    by the operator's own client (kopf.event raised here, and the pod was refused)."""
    kube = FakeKube({RECORD_PATH: record(kernelcache())})
    answer = admit(pod_review(), kube, "mutating")["response"]
    assert answer["allowed"] is True and "patch" in answer, answer
    (warning,) = answer["warnings"]
    assert "KernelCache team-a/demo was deleted" in warning
    ((collection, event),) = kube.created
    assert collection == "/api/v1/namespaces/team-a/events"
    assert event["type"] == "Warning" and event["reason"] == "DeletedKernelCache"
    assert event["message"] == warning
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "kc-demo-published",
        "namespace": "team-a",
        "uid": "r1",
    }


def test_kopf_mutating_webhook_image_policies() -> None:
    kube = FakeKube({kernelcache_path("team-a", "demo"): kernelcache()})
    other = "ghcr.io/kernelcache/examples:0.2.0"
    denied = admit(pod_review(image=other), kube, "mutating")["response"]
    assert denied["allowed"] is False and other in denied["status"]["message"]
    review = pod_review(image=other, annotations={ANNOTATION_IMAGE_POLICY: "warn"})
    warned = admit(review, kube, "mutating")["response"]
    assert warned["allowed"] is True and "patch" in warned
    assert len(warned["warnings"]) == 1 and other in warned["warnings"][0]


def test_kopf_mutating_webhook_ignores_unlabelled_pods() -> None:
    kube = FakeKube({})
    answer = admit(pod_review(labels={"app": "llama"}), kube, "mutating")["response"]
    assert answer["allowed"] is True and "patch" not in answer
    assert kube.gets == []


def test_kopf_validating_webhook() -> None:
    good = admit(kc_review(kernelcache()), FakeKube({}), "validating")["response"]
    assert good["allowed"] is True and "patch" not in good
    bad = kernelcache(storage={"existingClaim": "models", "pvc": {"size": "10Gi"}})
    answer = admit(kc_review(bad, "UPDATE"), FakeKube({}), "validating")["response"]
    assert answer["allowed"] is False
    assert answer["status"] == {
        "code": 422,
        "message": "KernelCache team-a/demo: spec.storage: set exactly one of existingClaim or pvc",
    }
