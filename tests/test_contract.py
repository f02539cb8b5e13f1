"""The names the components share: declared once, read once, parsed strictly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernelcache import contract, envfile
from kernelcache.contract import CacheKey, Settings
from kernelcache.errors import SpecError, StorageError

SRC = Path(__file__).resolve().parent.parent / "src" / "kernelcache"
# The operator's own configuration, one variable per OperatorConfig field.
OPERATOR_PREFIX = "KERNELCACHE_OPERATOR_"


def test_every_kernelcache_variable_the_code_names_is_declared() -> None:
    declared = {v.name for v in contract.VARIABLES}
    named = {
        (name, path.relative_to(SRC).as_posix())
        for path in SRC.rglob("*.py")
        for name in re.findall(r"KERNELCACHE_[A-Z0-9_]*[A-Z0-9]", path.read_text())
        if not name.startswith(OPERATOR_PREFIX) and name + "_" != OPERATOR_PREFIX
    }
    assert sorted(n for n in named if n[0] not in declared) == []


def test_each_variable_is_documented_and_named_once() -> None:
    names = [v.name for v in contract.VARIABLES]
    assert len(names) == len(set(names))
    assert all(v.doc and "\n" not in v.doc for v in contract.VARIABLES)


@pytest.mark.parametrize(
    "variable",
    [v for v in contract.VARIABLES if v.parse not in (contract._text, contract._path)],
    ids=lambda v: v.name,
)
def test_a_malformed_value_is_one_line_naming_the_variable(variable: contract.Variable) -> None:
    with pytest.raises(SpecError) as raised:
        Settings.from_env({variable.name: "-1.5x"})
    (line,) = raised.value.message.splitlines()
    assert line.startswith(f"{variable.name}='-1.5x'") and ("expected" in line or "not" in line)


def test_unset_and_empty_are_the_defaults() -> None:
    assert Settings.from_env({}) == Settings() == Settings.from_env({"KERNELCACHE_STRICT": ""})
    assert Settings.from_env({"KERNELCACHE_STRICT": "1", "KERNELCACHE_POLL_S": "2"}) == Settings(
        strict=True, poll_seconds=2.0
    )


def test_the_cache_key_formats_and_parses_one_way() -> None:
    key = CacheKey("llm", "qwen", "sm_90a")
    assert str(key) == "llm/qwen/sm_90a" and key.cache == "llm/qwen"
    assert CacheKey.parse(str(key)) == key
    for bad in ("llm/qwen", "llm/qwen/sm_90a/x", "llm//sm_90a"):
        with pytest.raises(SpecError, match="must be namespace/name/arch"):
            CacheKey.parse(bad)


def test_the_image_reference_pins_the_digest_when_given() -> None:
    assert contract.image_reference("vllm/x:1", None) == "vllm/x:1"
    assert contract.image_reference("vllm/x:1", "sha256:ab") == "vllm/x:1@sha256:ab"


def test_the_env_file_carries_what_the_runtime_reads(tmp_path: Path) -> None:
    values = {
        contract.DIR: str(tmp_path / "g 1"),
        contract.NAME: "llm/qwen",
        contract.ARCH: "sm_90a",
    }
    envfile.write(tmp_path, values, {"generation": "g1"})
    env = {contract.ENV_FILE_PATH.name: str(tmp_path / contract.ENV_FILE), "KERNELCACHE_ARCH": "x"}
    envfile.apply(env)
    settings = Settings.from_env(env)
    assert settings.generation_dir == tmp_path / "g 1" and settings.name == "llm/qwen"
    assert settings.arch == "x"  # the container's own value wins
    envfile.remove(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    envfile.apply(env)  # permissive: a missing file is served without a generation
    with pytest.raises(StorageError, match="cannot read"):
        envfile.apply({**env, contract.STRICT.name: "1"})
