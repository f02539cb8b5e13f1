"""The operator's builders and config: a validated KernelCache in, plain dicts out."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelcache.controller import manifests
from kernelcache.controller.config import ConfigError, OperatorConfig
from kernelcache.spec import KernelCache, parse_kernelcache

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "kernelcache.yaml"
UID = "6f1c2a9e-0000-4000-8000-000000000001"
OWNER = {
    "apiVersion": "kernelcache.dev/v1alpha1",
    "kind": "KernelCache",
    "name": "demo",
    "uid": UID,
    "controller": True,
    "blockOwnerDeletion": True,
}
CONFIG = OperatorConfig()


def kernelcache(**spec: Any) -> KernelCache:
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["spec"].update(copy.deepcopy(spec))
    return parse_kernelcache(obj, "test")


def test_spec_digest_is_stable_and_changes_with_the_spec_or_image() -> None:
    kc = kernelcache()
    assert manifests.spec_digest(kc) == manifests.spec_digest(kernelcache())
    assert len(manifests.spec_digest(kc)) == 16
    image = kernelcache(engine={"image": "ghcr.io/kernelcache/examples:0.2.0"})
    assert manifests.spec_digest(image) != manifests.spec_digest(kc)
    renamed = kernelcache()
    renamed.metadata.name = "other"
    assert manifests.spec_digest(renamed) != manifests.spec_digest(kc)


def test_job_name_is_deterministic_and_fits_a_label() -> None:
    assert (
        manifests.job_name("demo", "sm_90a", "0123456789abcdef", 0) == "kc-demo-sm-90a-0123456789"
    )
    assert manifests.job_name("demo", "sm_90a", "0123456789abcdef", 2).endswith("-r2")
    long = manifests.job_name("a" * 253, "sm_120a", "0123456789abcdef", 9)
    assert len(long) <= 63 and long.endswith("-sm-120a-0123456789-r9")
    dotted = manifests.job_name("team.model", "sm_90a", "f" * 16, 0)
    assert dotted == "kc-team-model-sm-90a-ffffffffff"


def test_compile_job_pulls_the_engine_image_with_the_specs_pull_secrets() -> None:
    """spec.imagePullSecrets reach the compile Job's pod spec as they are; none: no key."""
    kc = kernelcache(imagePullSecrets=[{"name": "regcred"}, {"name": "mirror"}])
    job = manifests.compile_job(
        kc, arch="sm_90a", digest="d" * 16, attempt=0, owner=OWNER, config=CONFIG
    )
    pod = job["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    plain = manifests.compile_job(
        kernelcache(), arch="sm_90a", digest="d" * 16, attempt=0, owner=OWNER, config=CONFIG
    )
    assert "imagePullSecrets" not in plain["spec"]["template"]["spec"]


def test_owner_reference_points_at_the_kernelcache() -> None:
    body = {"metadata": {"name": "demo", "namespace": "default", "uid": UID}}
    assert manifests.owner_reference(body) == OWNER


def test_compile_job_runs_warm_for_its_arch_in_the_serving_image() -> None:
    kc = kernelcache()
    job = manifests.compile_job(
        kc, arch="sm_90a", digest="d" * 16, attempt=0, owner=OWNER, config=CONFIG
    )
    meta, spec = job["metadata"], job["spec"]
    assert meta["name"] == "kc-demo-sm-90a-dddddddddd"
    assert meta["ownerReferences"] == [OWNER]
    assert meta["labels"][manifests.LABEL_ARCH] == "sm_90a"
    assert meta["labels"][manifests.LABEL_ATTEMPT] == "0"
    assert meta["annotations"] == {manifests.ANNOTATION_CACHE: "demo"}
    assert spec["backoffLimit"] == CONFIG.job_backoff_limit
    assert spec["ttlSecondsAfterFinished"] == CONFIG.job_ttl_seconds
    assert spec["activeDeadlineSeconds"] == 3600 + CONFIG.job_deadline_margin_seconds
    pod = spec["template"]["spec"]
    assert spec["template"]["metadata"]["labels"] == meta["labels"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/kernelcache/examples:0.1.0"
    assert container["command"] == [
        "kernelcache", "warm", "-f", "/etc/kernelcache/spec/kernelcache.yaml",
        "--store", "/var/lib/kernelcache", "--arch", "sm_90a",
        "--result", "/dev/termination-log",
    ]  # fmt: skip
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert pod["restartPolicy"] == "Never"
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 1000
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["store"]["persistentVolumeClaim"] == {"claimName": "kernelcache-demo"}
    assert volumes["spec"]["configMap"]["name"] == manifests.configmap_name(kc, "d" * 16)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["store"]["mountPath"] == "/var/lib/kernelcache"
    assert mounts["spec"]["readOnly"] is True


def test_compile_job_takes_resources_digest_signing_and_attempt() -> None:
    kc = kernelcache(
        engine={"image": "img:1", "imageDigest": "sha256:" + "a" * 64},
        gpuClasses=[
            {"name": "b200", "arch": "sm_100a", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
        ],
        storage={"existingClaim": "shared"},
        verification={"signing": {"enabled": True, "secretName": "keys"}},
    )
    config = OperatorConfig(store_mount_path="/cache", run_as_user=4242)
    job = manifests.compile_job(
        kc, arch="sm_100a", digest="e" * 16, attempt=1, owner=OWNER, config=config
    )
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert job["metadata"]["name"].endswith("-r1")
    assert container["image"] == "img:1@sha256:" + "a" * 64
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert container["command"][-4:] == [
        "--signing-key",
        "/etc/kernelcache/signing/kernelcache.key",
        "--public-key",  # what pods trust: the signing key must be one of them
        "/etc/kernelcache/signing/kernelcache.pub",
    ]
    assert "--store" in container["command"] and "/cache" in container["command"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["signing"] == {"name": "signing", "secret": {"secretName": "keys"}}
    assert volumes["store"]["persistentVolumeClaim"] == {"claimName": "shared"}
    assert pod["nodeSelector"] == {} and pod["tolerations"] == []
    assert pod["securityContext"]["runAsUser"] == 4242


def test_the_first_gpu_class_of_an_arch_places_its_job() -> None:
    kc = kernelcache(
        gpuClasses=[
            {"name": "h100", "arch": "sm_90a", "nodeSelector": {"gpu": "h100"}},
            {"name": "h200", "arch": "sm_90a", "nodeSelector": {"gpu": "h200"}},
        ]
    )
    assert manifests.gpu_class_for(kc, "sm_90a").name == "h100"


RTX_PRO = {
    "name": "rtx-pro-6000",
    "arch": "sm_120a",
    "smCount": 188,
    "nodeSelector": {"nvidia.com/gpu.product": "RTX-PRO-6000"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "resources": {
        "requests": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "1"},
    },
}


@pytest.mark.parametrize(
    ("compile_on", "selector", "tolerated", "resources"),
    [
        ("target", RTX_PRO["nodeSelector"], True, RTX_PRO["resources"]),
        ("any-gpu", {}, True, RTX_PRO["resources"]),
        ("cpu", {}, False, {"requests": {"cpu": "8", "memory": "32Gi"}}),
    ],
)
def test_compile_on_places_the_job(
    compile_on: str, selector: dict[str, str], tolerated: bool, resources: dict[str, Any]
) -> None:
    """A b12x cache for a Blackwell-consumer fleet compiles on whatever node the class says."""
    kc = kernelcache(gpuClasses=[{**RTX_PRO, "compileOn": compile_on}])
    job = manifests.compile_job(
        kc, arch="sm_120a", digest="e" * 16, attempt=0, owner=OWNER, config=CONFIG
    )
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == selector
    assert bool(pod["tolerations"]) is tolerated
    assert pod["containers"][0]["resources"] == resources


def test_spec_configmap_round_trips_through_the_parser() -> None:
    kc = kernelcache()
    kc.spec.warmers[0].workload["none"] = None  # free-form JSON keeps its nulls
    cm = manifests.spec_configmap(kc, OWNER, "c" * 16)
    assert cm["immutable"] is True
    assert cm["metadata"]["name"] == "kc-demo-" + "c" * 16
    assert cm["metadata"]["ownerReferences"] == [OWNER]
    document = yaml.safe_load(cm["data"]["kernelcache.yaml"])
    assert set(document) == {"apiVersion", "kind", "metadata", "spec"}
    assert parse_kernelcache(document, "configmap").spec == kc.spec


def test_claim_follows_the_pvc_template_and_has_no_owner() -> None:
    kc = kernelcache(
        storage={
            "pvc": {"size": "20Gi", "storageClassName": "fast", "accessModes": ["ReadWriteOnce"]}
        }
    )
    pvc = manifests.claim(kc, UID)
    assert pvc["metadata"]["name"] == "kernelcache-demo"
    assert "ownerReferences" not in pvc["metadata"]
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "20Gi"}},
        "storageClassName": "fast",
    }
    assert manifests.claim_name(kernelcache(storage={"existingClaim": "mine"})) == "mine"
    with pytest.raises(ValueError):
        manifests.claim(kernelcache(storage={"existingClaim": "mine"}), UID)


def test_cleanup_job_removes_the_kernelcache_directory_of_the_claim() -> None:
    kc = kernelcache(storage={"existingClaim": "shared"})
    job = manifests.cleanup_job(kc, UID, CONFIG)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["rm", "-rf", "--", "/var/lib/kernelcache/default/demo"]
    assert container["image"] == CONFIG.cleanup_image
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "shared"}
    assert "ownerReferences" not in job["metadata"]
    assert job["metadata"]["labels"][manifests.LABEL_COMPONENT] == manifests.CLEANUP
    assert len(job["metadata"]["name"]) <= 63


def test_selectors_match_what_the_builders_label() -> None:
    kc = kernelcache()
    job = manifests.compile_job(
        kc, arch="sm_90a", digest="d" * 16, attempt=0, owner=OWNER, config=CONFIG
    )
    labels = job["metadata"]["labels"]
    for term in manifests.selector(UID, manifests.COMPILE).split(","):
        key, value = term.split("=")
        assert labels[key] == value
    pod_terms = dict(t.split("=") for t in manifests.pod_selector(job).split(","))
    assert pod_terms == job["spec"]["template"]["metadata"]["labels"]


def test_peering_crds_and_object() -> None:
    cluster, namespaced = manifests.peering_crds()
    assert cluster["metadata"]["name"] == "clusterkopfpeerings.kopf.dev"
    assert cluster["spec"]["scope"] == "Cluster"
    assert namespaced["spec"]["names"]["kind"] == "KopfPeering"
    status = cluster["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["x-kubernetes-preserve-unknown-fields"] is True
    assert manifests.peering_object("kernelcache")["kind"] == "ClusterKopfPeering"
    assert manifests.peering_object("kc", "team")["metadata"]["namespace"] == "team"


# The config the builders read.


def test_config_reads_prefixed_variables() -> None:
    config = OperatorConfig.from_env(
        {
            "KERNELCACHE_OPERATOR_NAMESPACES": "team-a, team-b",
            "KERNELCACHE_OPERATOR_RESYNC_SECONDS": "5",
            "KERNELCACHE_OPERATOR_PEERING": "",
            "HOME": "/root",
        }
    )
    assert config.namespaces == ("team-a", "team-b")
    assert config.resync_seconds == 5.0
    assert config.peering == ""
    assert config.priority is None
    assert OperatorConfig.from_env({}) == OperatorConfig()


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"KERNELCACHE_OPERATOR_WORKERS": "many"}, "KERNELCACHE_OPERATOR_WORKERS: "),
        ({"KERNELCACHE_OPERATOR_MAX_ATTEMPS": "3"}, "MAX_ATTEMPS: not a setting"),
        ({"KERNELCACHE_OPERATOR_RUN_AS_USER": "0"}, "KERNELCACHE_OPERATOR_RUN_AS_USER: "),
        ({"KERNELCACHE_OPERATOR_JOB_TTL_SECONDS": "60"}, "must exceed retry_backoff_max"),
    ],
)
def test_config_errors_name_the_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OperatorConfig.from_env(environ)


def test_a_compile_jobs_deadline_counts_only_the_warmers_of_its_arch() -> None:
    warmers = kernelcache().spec.model_dump(by_alias=True, exclude_none=True)["warmers"]
    kc = kernelcache(
        warmers=[
            {**warmers[0], "gpuClasses": ["h200"], "timeoutSeconds": 100},
            {
                "type": "command",
                "command": ["warm"],
                "gpuClasses": ["rtx-pro-6000"],
                "timeoutSeconds": 7000,
            },
        ]
    )
    deadlines = {
        arch: manifests.compile_job(
            kc, arch=arch, digest="d" * 16, attempt=0, owner=OWNER, config=CONFIG
        )["spec"]["activeDeadlineSeconds"]
        - CONFIG.job_deadline_margin_seconds
        for arch in kc.spec.arches()
    }
    assert deadlines == {"sm_90a": 100, "sm_120a": 7000}


@pytest.mark.parametrize(
    ("volume", "source"),
    [
        (
            {"persistentVolumeClaim": {"claimName": "weights"}, "subPath": "qwen3"},
            {"persistentVolumeClaim": {"claimName": "weights"}},
        ),
        ({"configMap": {"name": "qwen3-config"}}, {"configMap": {"name": "qwen3-config"}}),
        (
            {"image": {"reference": "registry.example.com/qwen3:1", "pullPolicy": "IfNotPresent"}},
            {"image": {"reference": "registry.example.com/qwen3:1", "pullPolicy": "IfNotPresent"}},
        ),
    ],
)
def test_compile_job_mounts_the_model_read_only(volume: dict[str, Any], source: dict) -> None:
    kc = kernelcache(modelVolume={"mountPath": "/models/qwen3", **volume})
    job = manifests.compile_job(
        kc, arch="sm_90a", digest="d" * 16, attempt=0, owner=OWNER, config=CONFIG
    )
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {v["name"]: v for v in pod["volumes"]}["model"] == {"name": "model", **source}
    mount = {"name": "model", "mountPath": "/models/qwen3", "readOnly": True}
    if "subPath" in volume:
        mount["subPath"] = volume["subPath"]
    assert {m["name"]: m for m in container["volumeMounts"]}["model"] == mount


def test_compile_job_mounts_no_model_unless_asked() -> None:
    job = manifests.compile_job(
        kernelcache(), arch="sm_90a", digest="d" * 16, attempt=0, owner=OWNER, config=CONFIG
    )
    assert "model" not in {v["name"] for v in job["spec"]["template"]["spec"]["volumes"]}
