"""Property tests: hostile specs, hostile manifests and tampered signed manifests.

Every property runs derandomized, so CI sees the same examples on every run.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernelcache import store as store_mod
from kernelcache.controller import manifests, state
from kernelcache.controller.config import OperatorConfig
from kernelcache.errors import ManifestError, SpecError, UnsafePathError
from kernelcache.spec import KernelCache, parse_kernelcache
from kernelcache.store import MANIFEST_NAME, Manifest, Store

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "kernelcache.yaml"
VALID_SPEC: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
SOURCE = "fuzz.yaml"
TOP_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")
KEY = "default/demo/sm_90a"
NOW = datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
CONFIG = OperatorConfig()

PROPS = settings(
    derandomize=True,
    deadline=None,
    database=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------- strategies

WEIRD_TEXT = st.sampled_from(
    [
        "",
        " ",
        "\n",
        "a\nb",
        "\u2028",
        "\0",
        "x" * 100_000,
        "é✓🚀",
        "../..",
        "/etc/passwd",
        "sm_90a",
        "sm_999z",
        "NVIDIA H200",
        "-1",
        "1e309",
        "null",
        "true",
        "${HOME}",
        "a" * 254,
        "UPPER",
        "x:y",
    ]
)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([-1, 0, 2**31, 2**63, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    WEIRD_TEXT,
)

JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), WEIRD_TEXT), children, max_size=4),
    ),
    max_leaves=12,
)


def _deep(depth: int) -> Any:
    value: Any = "leaf"
    for i in range(depth):
        value = {"n": value} if i % 2 else [value]
    return value


def _containers(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (tuple of keys/indexes) that leads to a dict or a list inside obj."""
    found = []
    if isinstance(obj, dict):
        found.append(path)
        for k, v in obj.items():
            found.extend(_containers(v, (*path, k)))
    elif isinstance(obj, list):
        found.append(path)
        for i, v in enumerate(obj):
            found.extend(_containers(v, (*path, i)))
    return found


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        obj = obj[part]
    return obj


@st.composite
def mutate(draw: st.DrawFn, base: Any, values: st.SearchStrategy[Any]) -> Any:
    """Apply 1..4 random mutations (delete, replace, add unknown, nest deep) to a copy."""
    obj = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 4))):
        paths = _containers(obj)
        if not paths:
            break
        target = _at(obj, draw(st.sampled_from(paths)))
        op = draw(st.sampled_from(["delete", "set", "add", "deep", "wrap"]))
        if isinstance(target, dict):
            keys = list(target)
            if op == "delete" and keys:
                del target[draw(st.sampled_from(keys))]
            elif op in ("set", "deep", "wrap") and keys:
                key = draw(st.sampled_from(keys))
                if op == "set":
                    target[key] = draw(values)
                elif op == "deep":
                    target[key] = _deep(draw(st.integers(10, 200)))
                else:
                    target[key] = [target[key]]
            else:
                target[draw(st.one_of(st.text(max_size=10), WEIRD_TEXT))] = draw(values)
        else:  # a list
            if op == "delete" and target:
                del target[draw(st.integers(0, len(target) - 1))]
            elif op == "set" and target:
                target[draw(st.integers(0, len(target) - 1))] = draw(values)
            elif op == "deep":
                target.append(_deep(draw(st.integers(10, 200))))
            elif op == "wrap" and target:
                i = draw(st.integers(0, len(target) - 1))
                target[i] = {"wrapped": target[i]}
            else:
                target.append(draw(values))
    return obj


HOSTILE_SPECS = mutate(VALID_SPEC, JSON_VALUES)


# --------------------------------------------------------------------------- 1. specs


def _assert_spec_error(message: str) -> None:
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"{SOURCE}: "), message
    rest = message[len(SOURCE) + 2 :]
    # the path of the field at fault; an unknown top-level key is named as itself
    # a document too deep is named by the field path where it goes deep (documents.py)
    named = rest.startswith(TOP_FIELDS) or ": unknown field" in rest
    named = named or (re.match(r"[\w\[].*: nested deeper than \d+ levels$", rest) is not None)
    assert named, f"no field path named: {message!r}"


def _pure_reconcile(obj: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The API-free part of a reconcile: validation, then status and every manifest built."""
    try:
        kc = parse_kernelcache(obj, SOURCE)
    except SpecError as exc:
        return state.invalid_status({}, exc.message, 1, NOW), exc.message
    digest = manifests.spec_digest(kc)
    owner = manifests.owner_reference({"metadata": {"name": kc.metadata.name, "uid": "u-1"}})
    if kc.spec.storage.pvc is not None:
        manifests.claim(kc, owner["uid"])
    manifests.spec_configmap(kc, owner, digest)
    policy = state.RetryPolicy(
        CONFIG.max_attempts, CONFIG.retry_backoff_seconds, CONFIG.retry_backoff_max_seconds
    )
    plans = []
    for arch in kc.spec.arches():
        plan = state.plan_arch(arch, [], None, False, None, policy, NOW)
        if plan.create_attempt is not None:
            job = manifests.compile_job(
                kc,
                arch=arch,
                digest=digest,
                attempt=plan.create_attempt,
                owner=owner,
                config=CONFIG,
            )
            json.dumps(job, allow_nan=False)  # what is sent to the API server must be JSON
        plans.append(plan)
    return state.summarize(plans, 1, {}, NOW), None


def test_example_spec_is_valid() -> None:
    assert isinstance(parse_kernelcache(copy.deepcopy(VALID_SPEC), SOURCE), KernelCache)
    status, error = _pure_reconcile(copy.deepcopy(VALID_SPEC))
    assert error is None
    assert status["phase"] != "Failed"


@PROPS
@given(HOSTILE_SPECS)
def test_hostile_spec_parses_or_names_field(obj: dict[str, Any]) -> None:
    try:
        kc = parse_kernelcache(obj, SOURCE)
    except SpecError as exc:
        assert exc.message == str(exc)
        _assert_spec_error(exc.message)
    else:
        assert isinstance(kc, KernelCache)


@PROPS
@given(JSON_VALUES)
def test_non_mapping_or_random_object_is_a_spec_error(obj: Any) -> None:
    try:
        parse_kernelcache(obj, SOURCE)
    except SpecError as exc:
        assert len(exc.message.splitlines()) == 1, exc.message
        assert exc.message.startswith(f"{SOURCE}: "), exc.message


@settings(PROPS, max_examples=200)
@given(HOSTILE_SPECS)
def test_hostile_spec_reconciles_to_failed_status_never_raises(obj: dict[str, Any]) -> None:
    status, error = _pure_reconcile(obj)
    if error is None:
        assert status["phase"] != "Failed" or status["arches"]
        return
    assert status["phase"] == "Failed"
    messages = {c["type"]: c["message"] for c in status["conditions"]}
    assert messages["Ready"] == error
    assert messages["Degraded"] == error
    _assert_spec_error(error)


# --------------------------------------------------------------------------- 2. manifests


@pytest.fixture(scope="module")
def signed_generation(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, bytes]:
    """A tiny signed generation: (generation dir, public key file, MANIFEST.json bytes)."""
    root = tmp_path_factory.mktemp("props")
    private, public = store_mod.generate_keypair(root / "keys")
    store = Store(root / "store")
    with store.writer(KEY) as writer:
        staging = writer.staging()
        (staging / "triton" / "abc").mkdir(parents=True)
        (staging / "triton" / "abc" / "k.cubin").write_bytes(b"\x7fELF kernel")
        (staging / "cute.o").write_bytes(b"object")
        writer.publish(staging, {"digest": "d" * 64, "arch": "sm_90a"}, {"n": 2}, private)
    gen = store.current(KEY)
    assert gen is not None
    data = (gen / MANIFEST_NAME).read_bytes()
    assert store_mod.verify(gen, public_key=public).ok
    return gen, public, data


@pytest.fixture(scope="module")
def valid_manifest(signed_generation: tuple[Path, Path, bytes]) -> dict[str, Any]:
    manifest = json.loads(signed_generation[2])
    Manifest.parse(signed_generation[2], "MANIFEST.json")  # the starting point is valid
    return manifest


SEGMENTS = st.one_of(
    st.sampled_from(["..", ".", "", "a", "x y", "\\", "a\\b", "é", "\0", "./x", "/", "🚀", "~"]),
    st.text(max_size=6),
)
PATHS = st.one_of(
    st.builds(
        lambda lead, segs: lead + "/".join(segs),
        st.sampled_from(["", "", "/", "./", "../", "\\", "C:\\"]),
        st.lists(SEGMENTS, min_size=0, max_size=4),
    ),
    st.text(max_size=12),
)


def _check_parse(data: bytes) -> None:
    try:
        manifest = Manifest.parse(data, "MANIFEST.json")
    except (ManifestError, UnsafePathError) as exc:
        assert len(exc.message.splitlines()) == 1, exc.message
        assert exc.message.startswith("MANIFEST.json: "), exc.message
        return
    for entry in manifest.files:
        p = entry.path
        assert p, p
        assert not p.startswith("/"), p
        assert "\\" not in p and "\0" not in p, p
        segments = p.split("/")
        assert ".." not in segments and "" not in segments and "." not in segments, p


@PROPS
@given(st.binary(max_size=512))
def test_manifest_parse_arbitrary_bytes(data: bytes) -> None:
    _check_parse(data)


@settings(PROPS, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_manifest_parse_hostile_paths(valid_manifest: dict[str, Any], data: st.DataObject) -> None:
    manifest = copy.deepcopy(valid_manifest)
    digest = manifest["files"][0]["digest"]
    paths = data.draw(st.lists(PATHS, min_size=1, max_size=4))
    manifest["files"] = [{"path": p, "size": 1, "digest": digest} for p in paths]
    if data.draw(st.booleans()):
        manifest["files"].extend(valid_manifest["files"])
    if data.draw(st.booleans()):
        manifest = data.draw(mutate(manifest, JSON_VALUES))
    try:
        text = json.dumps(manifest, ensure_ascii=data.draw(st.booleans()))
    except ValueError:
        return
    _check_parse(text.encode("utf-8", "surrogatepass"))


# Object keys without line breaks: keys holding one are covered on their own by
# test_manifest_unknown_key_with_line_break_is_one_line below (found by this fuzzing).
NO_BREAK_VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.text(max_size=8).filter(lambda k: len(f"x{k}x".splitlines()) == 1),
            children,
            max_size=4,
        ),
    ),
    max_leaves=12,
)


@st.composite
def mutate_manifest(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    obj = draw(mutate(base, NO_BREAK_VALUES))
    bad = [(c, k) for c, k in _keys(obj) if len(f"x{k}x".splitlines()) != 1]
    for container, key in bad:
        container["".join(key.splitlines())] = container.pop(key)
    return obj


def _keys(obj: Any) -> list[tuple[dict[str, Any], str]]:
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            found.append((obj, k))
            found.extend(_keys(v))
    elif isinstance(obj, list):
        for v in obj:
            found.extend(_keys(v))
    return found


@settings(PROPS, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_manifest_parse_mutated_fields(valid_manifest: dict[str, Any], data: st.DataObject) -> None:
    manifest = data.draw(mutate_manifest(valid_manifest))
    text = json.dumps(manifest)  # NaN/Infinity are emitted, and must be refused
    _check_parse(text.encode())


@pytest.mark.parametrize("key", ["\r", "\n", "a\u2028b"])
def test_manifest_unknown_key_with_line_break_is_one_line(
    valid_manifest: dict[str, Any], key: str
) -> None:
    manifest = {**valid_manifest, key: None}
    _check_parse(json.dumps(manifest).encode())


# --------------------------------------------------------------------------- 3. signatures


@settings(PROPS, max_examples=200, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_tampered_signed_manifest_never_verifies(
    signed_generation: tuple[Path, Path, bytes], data: st.DataObject
) -> None:
    gen, public, original = signed_generation
    index = data.draw(st.integers(0, len(original) - 1))
    flip = data.draw(st.integers(1, 255))
    tampered = bytearray(original)
    tampered[index] ^= flip
    path = gen / MANIFEST_NAME
    try:
        path.write_bytes(bytes(tampered))
        result = store_mod.verify(gen, public_key=public)
        assert not result.ok, (index, flip)
        assert result.problems
    finally:
        path.write_bytes(original)
    assert store_mod.verify(gen, public_key=public, digests=False).ok


def test_tampered_copy_is_refused_too(
    signed_generation: tuple[Path, Path, bytes], tmp_path: Path
) -> None:
    """A copied generation whose manifest is rewritten (re-serialised) loses its signature."""
    gen, public, original = signed_generation
    copy_dir = tmp_path / "copy"
    shutil.copytree(gen, copy_dir)
    try:
        doc = json.loads(original)
        doc["report"]["n"] = 3
        (copy_dir / MANIFEST_NAME).write_text(json.dumps(doc, sort_keys=True, indent=1) + "\n")
        assert not store_mod.verify(copy_dir, public_key=public).ok
    finally:
        shutil.rmtree(copy_dir)
