"""KernelCache models, loader messages and the generated CRD."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kernelcache.crd import API_DOCS_PATH, CRD_PATH, api_reference, crd_manifest, crd_yaml, main
from kernelcache.errors import ExitCode, SpecError
from kernelcache.spec import KernelCache, load_kernelcache, parse_kernelcache
from tests.conftest import scaled

from .conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "kernelcache.yaml"
COMMITTED_CRD = ROOT / CRD_PATH


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def openapi_schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def schema_nodes(node: dict[str, Any], path: str = "$"):
    """Every schema node of a structural schema, with a readable path."""
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from schema_nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}{{}}")


# --- the example ----------------------------------------------------------------------------


def test_example_loads():
    kc = load_kernelcache(EXAMPLE)
    assert (kc.metadata.name, kc.metadata.namespace) == ("demo", "default")
    assert kc.spec.model == "example/elementwise-and-tiled"
    assert kc.spec.engine.image == "ghcr.io/kernelcache/examples:0.1.0"
    h200, pro = kc.spec.gpu_classes
    assert (h200.name, h200.arch, h200.gpu_product, h200.sm_count) == (
        "h200",
        "sm_90a",
        "NVIDIA H200",
        132,
    )
    assert h200.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert h200.tolerations[0].key == "nvidia.com/gpu"
    assert h200.tolerations[0].effect == "NoSchedule"
    assert (pro.name, pro.arch, pro.sm_count) == ("rtx-pro-6000", "sm_120a", 188)
    (warmer,) = kc.spec.warmers
    assert warmer.type == "cute-dsl"
    assert warmer.entry_points == ["demo_kernels:warm"]
    assert warmer.workload["sizes"] == [[128, 256], [1024, 1024]]
    assert warmer.timeout_seconds == 3600
    assert kc.spec.storage.pvc is not None
    assert kc.spec.storage.pvc.size == "20Gi"
    assert kc.spec.retention.generations == 2
    assert kc.spec.verification.policy == "strict"
    assert kc.spec.arches() == ["sm_120a", "sm_90a"]


def test_defaults_fill_omitted_sections():
    obj = example()
    for key in ("storage", "retention", "verification"):
        del obj["spec"][key]
    del obj["metadata"]["namespace"]
    spec = parse_kernelcache(obj, "obj").spec
    assert spec.storage.existing_claim is None
    assert spec.storage.pvc is not None
    assert (spec.storage.pvc.size, spec.storage.pvc.access_modes) == ("50Gi", ["ReadWriteMany"])
    assert (spec.retention.generations, spec.retention.delete_data_on_delete) == (2, False)
    assert (spec.verification.policy, spec.verification.signing.enabled) == ("strict", False)
    assert parse_kernelcache(obj, "obj").metadata.namespace == "default"


def test_arches_are_unique_and_sorted():
    obj = example()
    obj["spec"]["gpuClasses"].append({"name": "h100", "arch": "sm_90a"})
    obj["spec"]["gpuClasses"].append({"name": "l40s", "arch": "sm_89"})
    assert parse_kernelcache(obj, "obj").spec.arches() == ["sm_120a", "sm_89", "sm_90a"]


def test_live_object_with_server_fields_and_status_round_trips():
    """The operator parses objects as the API server returns them and writes status back."""
    obj = example()
    obj["metadata"].update(uid="0f6b", resourceVersion="42", generation=3)
    obj["status"] = {
        "phase": "Degraded",
        "observedGeneration": 3,
        "readyArches": "1/2",
        "arches": [
            {"arch": "sm_90a", "phase": "Ready", "bytes": 1024, "compileSeconds": 12},
            {"arch": "sm_120a", "phase": "Failed", "message": "warmer timed out"},
        ],
        "conditions": [{"type": "Ready", "status": "False", "reason": "ArchFailed"}],
        "fieldFromNewerOperator": True,
    }
    kc = parse_kernelcache(obj, "obj")
    assert kc.status is not None
    assert kc.status.arches[0].compile_seconds == 12.0
    assert kc.metadata.model_extra == {"uid": "0f6b", "resourceVersion": "42", "generation": 3}
    dumped = kc.model_dump(by_alias=True, exclude_none=True)
    assert parse_kernelcache(dumped, "dumped") == kc


def test_snake_case_names_are_accepted_in_python():
    kc = KernelCache.model_validate(
        {
            "api_version": "kernelcache.dev/v1alpha1",
            "kind": "KernelCache",
            "metadata": {"name": "x"},
            "spec": {
                "model": "m",
                "engine": {"image": "i"},
                "gpu_classes": [{"name": "a", "arch": "sm_89"}],
                "warmers": [{"type": "command", "command": ["warm"]}],
            },
        }
    )
    assert kc.spec.gpu_classes[0].arch == "sm_89"


# --- bad inputs -----------------------------------------------------------------------------


def _parent(obj: Any, path: str) -> tuple[Any, str]:
    """The container holding the dotted `path` (digits index lists) and the last key."""
    *parents, last = path.split(".")
    for key in parents:
        obj = obj[int(key)] if key.isdigit() else obj[key]
    return obj, last


def _set(obj: dict[str, Any], path: str, value: Any) -> None:
    parent, key = _parent(obj, path)
    parent[key] = value


def _del(obj: dict[str, Any], path: str) -> None:
    parent, key = _parent(obj, path)
    del parent[key]


BAD_OBJECTS = {
    "bad arch": (
        lambda o: _set(o, "spec.gpuClasses.0.arch", "sm90"),
        "spec.gpuClasses[0].arch: expected an SM arch",
    ),
    "missing engine image": (
        lambda o: _del(o, "spec.engine.image"),
        "spec.engine.image: required field is missing",
    ),
    "unknown field": (
        lambda o: _set(o, "spec.gpuClass", []),
        "spec.gpuClass: unknown field",
    ),
    "empty warmers": (
        lambda o: _set(o, "spec.warmers", []),
        "spec.warmers: needs at least 1 item(s), got 0",
    ),
    "cute-dsl without entryPoints": (
        lambda o: _del(o, "spec.warmers.0.entryPoints"),
        "spec.warmers[0].entryPoints: required for a cute-dsl warmer",
    ),
    "cute-dsl with a command": (
        lambda o: _set(o, "spec.warmers.0.command", ["warm"]),
        "spec.warmers[0].command: not allowed for a cute-dsl warmer",
    ),
    "command warmer without command": (
        lambda o: _set(o, "spec.warmers.0.type", "command"),
        "spec.warmers[0].command: required for a command warmer",
    ),
    "command warmer with entryPoints": (
        lambda o: o["spec"]["warmers"][0].update(type="command", command=["warm"]),
        "spec.warmers[0].entryPoints: not allowed for a command warmer",
    ),
    "bad entry point": (
        lambda o: _set(o, "spec.warmers.0.entryPoints", ["demo_kernels.warm"]),
        "spec.warmers[0].entryPoints[0]: expected an entry point of the form module:function",
    ),
    "existingClaim and pvc": (
        lambda o: _set(o, "spec.storage.existingClaim", "cache"),
        "spec.storage: set exactly one of existingClaim or pvc",
    ),
    "storage with neither": (
        lambda o: _set(o, "spec.storage", {}),
        "spec.storage: set exactly one of existingClaim or pvc",
    ),
    "signing without secretName": (
        lambda o: _set(o, "spec.verification.signing", {"enabled": True}),
        "spec.verification.signing.secretName: required when enabled is true",
    ),
    "bad quantity": (
        lambda o: _set(o, "spec.storage.pvc.size", "20 GB"),
        "spec.storage.pvc.size: expected a Kubernetes quantity such as 20Gi or 500m, got '20 GB'",
    ),
    "duplicate class names": (
        lambda o: _set(o, "spec.gpuClasses.1.name", "h200"),
        "spec.gpuClasses[1].name: duplicate of gpuClasses[0].name",
    ),
    "duplicate warmers": (
        lambda o: o["spec"]["warmers"].append(copy.deepcopy(o["spec"]["warmers"][0])),
        "spec.warmers[1].entryPoints: duplicate of warmers[0]",
    ),
    "a warmer naming a GPU class that does not exist": (
        lambda o: _set(o, "spec.warmers.0.gpuClasses", ["h200", "h20"]),
        "spec.warmers[0].gpuClasses[1]: no GPU class named 'h20' (gpuClasses: h200, ",
    ),
    "a GPU class no warmer compiles for": (
        lambda o: _set(o, "spec.warmers.0.gpuClasses", ["h200"]),
        "spec.gpuClasses[1]: no warmer compiles for ",
    ),
    "bad digest": (
        lambda o: _set(o, "spec.engine.imageDigest", "sha256:abc"),
        "spec.engine.imageDigest: expected an image digest",
    ),
    "string for an integer": (
        lambda o: _set(o, "spec.gpuClasses.0.smCount", "132"),
        "spec.gpuClasses[0].smCount: Input should be a valid integer, got '132'",
    ),
    "non-string map value": (
        lambda o: _set(o, "spec.gpuClasses.0.nodeSelector", {"nvidia.com/gpu.present": True}),
        'spec.gpuClasses[0].nodeSelector["nvidia.com/gpu.present"]: Input should be a valid '
        "string, got True",
    ),
    "retention above the cap": (
        lambda o: _set(o, "spec.retention.generations", 21),
        "spec.retention.generations: Input should be less than or equal to 20, got 21",
    ),
    "wrong apiVersion": (
        lambda o: _set(o, "apiVersion", "kernelcache.dev/v1"),
        "apiVersion: Input should be 'kernelcache.dev/v1alpha1'",
    ),
    "bad name": (
        lambda o: _set(o, "metadata.name", "Demo"),
        "metadata.name: expected a DNS-1123 name",
    ),
}


@pytest.mark.parametrize("case", BAD_OBJECTS, ids=list(BAD_OBJECTS))
def test_bad_object_names_the_field(case: str, tmp_path: Path):
    mutate, expected = BAD_OBJECTS[case]
    obj = example()
    mutate(obj)
    path = tmp_path / "kc.yaml"
    path.write_text(yaml.safe_dump(obj))
    with pytest.raises(SpecError) as info:
        load_kernelcache(path)
    assert info.value.message.startswith(f"{path}: {expected}")
    assert "\n" not in info.value.message
    assert info.value.code == ExitCode.USAGE


def test_several_errors_report_the_first_and_a_count():
    obj = example()
    obj["spec"]["gpuClasses"][0]["arch"] = "sm90"
    obj["spec"]["gpuClasses"][1]["arch"] = "sm120"
    del obj["spec"]["engine"]
    with pytest.raises(SpecError) as info:
        parse_kernelcache(obj, "live/demo")
    message = info.value.message
    assert message.startswith("live/demo: spec.engine: required field is missing")
    # The others named: a reader fixes all three without running it three times.
    assert message.endswith("(and 2 more: spec.gpuClasses[0].arch, spec.gpuClasses[1].arch)")
    assert len(info.value.details) == 3


BAD_FILES = {
    "yaml syntax error": (
        "apiVersion: kernelcache.dev/v1alpha1\nkind: KernelCache\nspec:\n  model: [a\n",
        r"line \d+, column \d+: YAML syntax error: ",
    ),
    "multi-document": (
        EXAMPLE.read_text() + "\n---\n" + EXAMPLE.read_text(),
        "expected exactly one YAML document, found 2",
    ),
    "empty file": ("# nothing here\n", "expected exactly one YAML document, found 0"),
    "not a mapping": ("- a\n- b\n", "expected a KernelCache mapping, got list"),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=list(BAD_FILES))
def test_bad_file_is_one_line(case: str, tmp_path: Path):
    text, expected = BAD_FILES[case]
    path = tmp_path / "kc.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=f"^{path}: {expected}") as info:
        load_kernelcache(path)
    assert "\n" not in info.value.message


def test_yaml_error_names_the_line(tmp_path: Path):
    path = tmp_path / "kc.yaml"
    path.write_text("apiVersion: kernelcache.dev/v1alpha1\nkind: KernelCache\n  oops: 1\n")
    with pytest.raises(SpecError, match=rf"^{path}: line 3, column \d+: YAML syntax error"):
        load_kernelcache(path)


def test_missing_file(tmp_path: Path):
    path = tmp_path / "absent.yaml"
    with pytest.raises(SpecError, match=f"^{path}: cannot read: No such file or directory$"):
        load_kernelcache(path)


# --- the CRD --------------------------------------------------------------------------------


def test_committed_crd_is_generated_from_the_models():
    assert yaml.safe_load(COMMITTED_CRD.read_text()) == crd_manifest()
    assert COMMITTED_CRD.read_text() == crd_yaml()
    assert crd_yaml().startswith("# Generated from kernelcache.spec; do not edit.")


def test_check_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["--check", str(COMMITTED_CRD)]) == 0
    stale = tmp_path / "crd.yaml"
    stale.write_text(crd_yaml().replace("minItems: 1", "minItems: 2", 1))
    assert main(["--check", str(stale)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{stale}: line " in err
    assert "python -m kernelcache.crd >" in err


def test_crd_module_runs_as_make_crds_runs_it(tmp_path: Path):
    """``python -m kernelcache.crd`` in a fresh process, as the Makefile's crds target runs
    it: the CRD and the API reference it prints are the committed ones, and --check of a
    stale copy exits 1 with one line."""
    for flags, committed in (([], COMMITTED_CRD), (["--api-docs"], ROOT / API_DOCS_PATH)):
        proc = subprocess.run(
            [sys.executable, "-m", "kernelcache.crd", *flags],
            env=subprocess_env(), capture_output=True, text=True, timeout=scaled(120), check=False,
        )  # fmt: skip
        assert (proc.returncode, proc.stderr) == (0, "")
        assert proc.stdout == committed.read_text()
    stale = tmp_path / "api.md"
    stale.write_text("# stale\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache.crd", "--api-docs", "--check", str(stale)],
        env=subprocess_env(), capture_output=True, text=True, timeout=scaled(120), check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == (
        f"{stale}: line 1 differs from the generated API reference; "
        f"regenerate with: python -m kernelcache.crd --api-docs > {stale}\n"
    )


def test_crd_identity():
    crd = crd_manifest()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "kernelcaches.kernelcache.dev"
    assert spec["group"] == "kernelcache.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["shortNames"] == ["kc"]
    assert spec["names"]["categories"] == ["kernelcache"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    columns = {
        c["name"]: (c["type"], c["jsonPath"], c.get("priority", 0))
        for c in version["additionalPrinterColumns"]
    }
    assert columns == {
        "Model": ("string", ".spec.model", 0),
        "Serving": ("string", ".status.servingArches", 0),
        "Ready": ("string", ".status.readyArches", 0),
        "Phase": ("string", ".status.phase", 0),
        "Age": ("date", ".metadata.creationTimestamp", 0),
        "Arches": ("string", ".status.arches[*].arch", 1),
        "Generations": ("string", ".status.arches[*].generation", 1),
        "Stamps": ("string", ".status.arches[*].stampDigest", 1),
        "Message": ("string", '.status.conditions[?(@.type=="Degraded")].message', 1),
    }


def test_crd_schema_is_structural():
    schema = openapi_schema()
    assert schema["properties"]["metadata"] == {"type": "object"}
    forbidden = {"$ref", "$defs", "anyOf", "allOf", "oneOf", "not", "title", "const"}
    int_or_string = [{"type": "integer"}, {"type": "string"}]
    for path, node in schema_nodes(schema):
        if node.get("x-kubernetes-int-or-string"):  # the one anyOf Kubernetes allows, untyped
            assert node.pop("anyOf") == int_or_string and "type" not in node, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert not forbidden & set(node), path
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties", {}) not in (True, False), path
        if "default" in node:
            jsonschema.Draft4Validator(node).validate(node["default"])


def test_crd_keeps_constraints():
    spec = openapi_schema()["properties"]["spec"]["properties"]
    gpu_class = spec["gpuClasses"]["items"]["properties"]
    assert spec["gpuClasses"]["minItems"] == 1
    assert gpu_class["arch"]["pattern"] == "^sm_[0-9]{2,3}[af]?$"
    assert gpu_class["smCount"]["minimum"] == 1
    assert gpu_class["nodeSelector"] == {
        "type": "object",
        "additionalProperties": {"type": "string"},
        "description": "Labels of the nodes of this class (the compile Job's nodeSelector).",
    }
    warmer = spec["warmers"]["items"]["properties"]
    assert warmer["type"]["enum"] == [
        "cute-dsl",
        "triton",
        "torch-compile",
        "flashinfer",
        "b12x",
        "vllm",
        "command",
    ]
    assert gpu_class["compileOn"]["enum"] == ["target", "any-gpu", "cpu"]
    assert warmer["timeoutSeconds"]["default"] == 3600
    assert warmer["workload"]["x-kubernetes-preserve-unknown-fields"] is True
    assert spec["storage"]["default"] == {"pvc": {"size": "50Gi", "accessModes": ["ReadWriteMany"]}}
    assert spec["retention"]["properties"]["generations"]["maximum"] == 20


def test_example_validates_against_the_crd_schema():
    validator = jsonschema.Draft4Validator(openapi_schema())
    validator.validate(example())
    bad = example()
    bad["spec"]["gpuClasses"][0]["arch"] = "sm90"
    # An empty warmers list is the webhook's to refuse (it is allowed with spec.source).
    bad["spec"]["warmers"][0]["timeoutSeconds"] = 0
    errors = {"/".join(map(str, e.absolute_path)) for e in validator.iter_errors(bad)}
    assert errors == {"spec/gpuClasses/0/arch", "spec/warmers/0/timeoutSeconds"}


def _fields(node: dict, path: str) -> list[tuple[str, dict]]:
    """Every property of a structural schema, with its path, depth first."""
    found = []
    for name, child in node.get("properties", {}).items():
        found.append((f"{path}.{name}", child))
        found += _fields(child, f"{path}.{name}")
    if "items" in node:
        found += _fields(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += _fields(node["additionalProperties"], f"{path}{{}}")
    return found


def test_every_crd_field_has_a_description():
    root = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    fields = _fields(root, "kc")
    assert len(fields) > 60
    # metadata is the API server's ObjectMeta, explained by the server, with no constraints.
    assert [path for path, node in fields if not node.get("description")] == ["kc.metadata"]


def test_committed_api_reference_is_generated_from_the_models():
    committed = (ROOT / API_DOCS_PATH).read_text()
    assert committed == api_reference(), "regenerate with: make crds"
    for path, _node in _fields(
        crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], ""
    ):
        assert f"| `{path.rsplit('.', 1)[1].removesuffix('[]')}`" in committed, path
    assert "| `hiddenSize` (required) | integer (>= 128; multiple of 128) |" in committed


def example_kernelcaches() -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """(file name, KernelCache, the file's other objects) of every KernelCache in examples/."""
    found = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        found += [(path.name, d, docs) for d in docs if d.get("kind") == "KernelCache"]
    return found


@pytest.mark.parametrize(("name", "doc", "others"), example_kernelcaches(), ids=lambda v: v)
def test_every_example_kernelcache_loads_and_validates_against_the_crd(name, doc, others):
    kc = parse_kernelcache(doc, name)
    jsonschema.Draft4Validator(openapi_schema()).validate(doc)
    model = kc.spec.model_volume
    if model is not None and model.config_map is not None:  # shipped in the same file
        shipped = {d["metadata"]["name"] for d in others if d.get("kind") == "ConfigMap"}
        assert model.config_map.name in shipped
    if model is not None:  # the warmers' model paths lie on the mount
        for warmer in kc.spec.warmers:
            if warmer.type == "vllm":
                assert warmer.vllm_workload().model.startswith(model.mount_path)


ONE_SOURCE = "set exactly one of persistentVolumeClaim, configMap or image"


@pytest.mark.parametrize(
    ("volume", "message"),
    [
        ({"mountPath": "/models/m"}, ONE_SOURCE),
        (
            {"mountPath": "/m", "configMap": {"name": "c"}, "image": {"reference": "r/m:1"}},
            ONE_SOURCE,
        ),
        ({"mountPath": "models", "configMap": {"name": "c"}}, "modelVolume.mountPath"),
        ({"mountPath": "/m", "persistentVolumeClaim": {"claimName": "Bad_Name"}}, "claimName"),
        # What the API server refuses in the compile Job: each named here first.
        ({"mountPath": "/", "configMap": {"name": "c"}}, r"modelVolume\.mountPath: expected an"),
        ({"mountPath": "/models/../etc", "configMap": {"name": "c"}}, "modelVolume.mountPath"),
        ({"mountPath": "/m", "subPath": "../../etc", "configMap": {"name": "c"}}, "subPath"),
        ({"mountPath": "/m", "subPath": "a/../../b", "configMap": {"name": "c"}}, "subPath"),
        ({"mountPath": "/m", "subPath": "/etc", "configMap": {"name": "c"}}, "subPath"),
    ],
)
def test_a_bad_model_volume_names_its_field(volume: dict[str, Any], message: str):
    doc = example()
    doc["spec"]["modelVolume"] = volume
    with pytest.raises(SpecError, match=message):
        parse_kernelcache(doc, "kc.yaml")
    if message != ONE_SOURCE:  # the API server refuses them too
        assert list(jsonschema.Draft4Validator(openapi_schema()).iter_errors(doc))


def test_the_model_is_not_mounted_where_vllm_writes_its_cache():
    doc = yaml.safe_load((ROOT / "examples" / "vllm-qwen3-moe.yaml").read_text())
    doc["spec"]["modelVolume"]["mountPath"] = "/var/cache/vllm"
    with pytest.raises(SpecError, match=r"modelVolume\.mountPath: is a vllm warmer's cacheRoot"):
        parse_kernelcache(doc, "kc.yaml")


def test_a_misspelled_workload_field_is_matched_against_the_workload():
    doc = yaml.safe_load((ROOT / "examples" / "vllm-qwen3-moe.yaml").read_text())
    workload = next(w for w in doc["spec"]["warmers"] if w["type"] == "vllm")["workload"]
    workload["maxModelLength"] = workload.pop("maxModelLen")
    with pytest.raises(
        SpecError, match=r"maxModelLength: unknown field \(did you mean maxModelLen"
    ):
        parse_kernelcache(doc, "kc.yaml")
