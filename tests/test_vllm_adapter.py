"""The vLLM releases the vllm toolchain supports, and every vLLM internal it binds.

Compatibility: each release of ``adapter.CHECKED_RELEASES`` (its Python sources, fetched by
``scripts/fetch-vllm-sources.py``, which ``make test`` runs) and the stand-in engine
(``tests/helpers/fake_vllm``) are read with ``ast`` and checked against the family's
declaration, one test per internal: a release that moves one fails the test naming it.

The range: a vLLM outside it is refused in one line naming the version and the range (exit
13) by the warm, by a serving start (when vLLM is imported) and reported by doctor; with
``vllmVersionCheck: warn`` it is tried with a warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kernelcache.contract import VLLM_VERSION_CHECK, VLLM_VERSION_CHECKS
from kernelcache.errors import ExitCode, NotInstalledError, SpecError
from kernelcache.spec import VllmWorkload, parse_kernelcache
from kernelcache.toolchains.vllm import adapter
from tests.conftest import REPO, run_kernelcache, scaled
from tests.helpers.vllm import FAKE_VLLM, fake_env, vllm_doc

SOURCES = REPO / ".cache" / "vllm-sources"
FAMILY = adapter.FAMILIES[0]
INTERNALS = {item.what: item for item in FAMILY.internals}


def release_tree(version: str) -> Path:
    """The release's sources; missing: a skip saying how to get them (under CI, a failure:
    ``make test`` fetches them there)."""
    tree = SOURCES / version
    if (tree / ".complete").is_file():
        return tree
    message = (
        f"vLLM {version}'s sources are not in {SOURCES} "
        "(python scripts/fetch-vllm-sources.py fetches them; make test runs it)"
    )
    if os.environ.get("CI"):
        pytest.fail(f"{message}; under CI that is a failure, not a skip")
    pytest.skip(message)


_checked: dict[Path, dict[str, str]] = {}


def problems_of(tree: Path) -> dict[str, str]:
    """What each internal the tree does not hold as declared holds instead (by name)."""
    if tree not in _checked:
        _checked[tree] = {p.internal.what: p.found for p in adapter.check_tree(tree, FAMILY)}
    return _checked[tree]


# ------------------------------------------------------------------- real releases


@pytest.mark.parametrize("what", sorted(INTERNALS))
@pytest.mark.parametrize("version", adapter.CHECKED_RELEASES)
def test_each_checked_release_binds_the_internal_as_the_family_declares(version, what):
    found = problems_of(release_tree(version)).get(what)
    assert found is None, f"vLLM {version}: {INTERNALS[what].where}: {found}"


def test_the_checked_releases_are_the_oldest_and_newest_of_the_range():
    assert adapter.CHECKED_RELEASES[0] == FAMILY.lowest == adapter.PROVEN_RELEASES[0]
    assert all(adapter.family_of(v) is FAMILY for v in adapter.CHECKED_RELEASES)
    assert adapter.family_of(adapter.CHECKED_RELEASES[-1].rpartition(".")[0] + ".99") is FAMILY


@pytest.mark.parametrize("what", sorted(INTERNALS))
def test_the_stand_in_engine_binds_the_internal_as_the_026_family(what):
    found = problems_of(FAKE_VLLM).get(what)
    assert found is None, f"tests/helpers/fake_vllm: {INTERNALS[what].where}: {found}"


# ------------------------------------------------------------------- the check finds a move


@pytest.fixture
def moved(tmp_path):
    """A copy of the stand-in engine, to move one internal in."""
    tree = tmp_path / "vllm-tree"
    shutil.copytree(FAKE_VLLM, tree, ignore=shutil.ignore_patterns("__pycache__", "bin"))
    return tree


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: {old!r} not found"
    path.write_text(text.replace(old, new))


def test_a_renamed_keyword_of_the_dummy_run_is_named(moved):
    edit(moved / "vllm/v1/worker/gpu_model_runner.py", "skip_eplb", "skip_expert_balance")
    assert problems_of(moved) == {
        "model runner _dummy_run": "GPUModelRunner._dummy_run in "
        "vllm.v1.worker.gpu_model_runner takes no skip_eplb"
    }


def test_a_removed_module_and_a_monitor_armed_elsewhere_are_named(moved):
    (moved / "vllm/v1/worker/startup_plan.py").unlink()
    edit(moved / "vllm/v1/worker/gpu_worker.py", "activate as activate_jit_monitor", "is_active")
    edit(moved / "vllm/v1/worker/gpu_worker.py", "activate_jit_monitor(mode=", "print(mode=")
    found = problems_of(moved)
    assert found["startup plan apply"] == "module vllm.v1.worker.startup_plan not found"
    assert "no longer uses activate" in found["worker arms the monitor"]
    assert "worker load_model" not in found


def test_a_field_gone_from_the_moe_config_and_a_reordered_signature_are_named(moved):
    layers = moved / "vllm/model_executor/layers/fused_moe/__init__.py"
    edit(layers, "    experts_per_token: int\n", "    top_k: int\n")
    edit(layers, "def forward(self, hidden_states: Any, router_logits: Any)",
         "def forward(self, router_logits: Any, hidden_states: Any)")  # fmt: skip
    found = problems_of(moved)
    assert found["MoE config"].endswith("has no experts_per_token")
    assert found["MoE layer forward"].endswith(
        "takes (router_logits, hidden_states) first, not (hidden_states, router_logits)"
    )


def test_a_variable_vllm_no_longer_reads_is_named(moved):
    edit(moved / "vllm/envs.py", '"VLLM_TUNED_CONFIG_FOLDER"', '"VLLM_MOE_CONFIG_FOLDER"')
    assert problems_of(moved) == {
        "vLLM's variables": "vllm.envs no longer names VLLM_TUNED_CONFIG_FOLDER"
    }


def test_one_model_runner_is_enough_but_none_is_named(moved):
    assert "model runner execute_model" not in problems_of(moved)  # the gpu/ one is absent
    shutil.rmtree(moved / "vllm/v1/worker")
    _checked.pop(moved, None)
    assert problems_of(moved)["model runner execute_model"].startswith(
        "none of vllm.v1.worker.gpu_model_runner, vllm.v1.worker.gpu.model_runner"
    )


# ------------------------------------------------------------------- the rooms' calls


def test_the_calls_the_rooms_make_through_the_adapter_on_the_stand_ins_objects(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE_VLLM))
    from vllm.forward_context import get_forward_context, set_forward_context
    from vllm.model_executor.layers.fused_moe import (
        FusedMoEConfig,
        MoERunner,
        UnquantizedFusedMoEMethod,
    )
    from vllm.model_executor.layers.fused_moe.fused_moe_modular_method import (
        FusedMoEModularMethod,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = GPUModelRunner(None)
    assert adapter.dummy_run_options(runner._dummy_run) == {"skip_eplb": True, "remove_lora": False}

    def gpu_runner_dummy_run(num_tokens, *args, skip_attn=False, skip_eplb=False, **kwargs):
        """The ``gpu/`` runner's: no ``remove_lora`` (passing it would reach **kwargs)."""

    assert adapter.dummy_run_options(gpu_runner_dummy_run) == {"skip_eplb": True}
    step = SchedulerOutput.make_empty()
    step.total_num_scheduled_tokens = 7
    assert adapter.scheduled_tokens(step) == 7
    layer = MoERunner("model.layers.0.mlp.experts", FusedMoEConfig(8, 2, 16, 32, "bfloat16"))
    assert isinstance(adapter.moe_quant_method(layer), UnquantizedFusedMoEMethod)
    experts = adapter.routed_experts(layer)
    assert experts.w2_weight.shape == (8, 16, 32)
    wrapped = FusedMoEModularMethod(experts.quant_method, moe_kernel=None)
    assert adapter.base_quant_method(wrapped) is experts.quant_method
    assert adapter.base_quant_method(experts.quant_method) is experts.quant_method
    with set_forward_context(None, None, num_tokens=4):
        adapter.set_moe_layer(get_forward_context(), 3)
        assert get_forward_context().moe_layer_index == 3
    assert adapter.moe_module().get_config_file_name(8, 32, None).startswith("E=8,N=32,")
    with adapter.override_config()({"BLOCK_SIZE_M": 16}):
        from vllm.model_executor.layers.fused_moe import get_config

        assert get_config() == {"BLOCK_SIZE_M": 16}
    monkeypatch.setenv("FAKE_VLLM_PLATFORM", "cpu")
    assert adapter.is_cuda() is False


# ------------------------------------------------------------------- the range


@pytest.mark.parametrize(
    ("version", "inside"),
    [
        ("0.26.0", True),
        ("0.30.0", True),
        ("0.34.0", True),
        ("0.34.1.dev3+g1234abc", True),
        ("0.26.0+cu129", True),
        ("0.35.0.dev12+gabc", False),
        ("0.25.1", False),
        ("0.26.0rc1", False),
        ("0.35.0rc1", False),
        ("0.35.0", False),
        ("1.0.0", False),
        ("not-a-version", False),
    ],
)
def test_the_range_holds_the_checked_releases_and_nothing_past_them(version, inside):
    assert (adapter.family_of(version) is not None) is inside
    assert (adapter.outside(version) is None) is inside


def test_outside_the_range_is_refused_naming_version_and_range_or_warned_about():
    with pytest.raises(NotInstalledError) as refused:
        adapter.check_version("0.35.0", "refuse", "vllm warmer")
    message = refused.value.message
    assert message.startswith("vllm warmer: vLLM 0.35.0 is outside the range")
    assert adapter.SUPPORTED in message and "vllmVersionCheck: warn" in message
    assert "\n" not in message and refused.value.code == ExitCode.NOT_INSTALLED
    said = adapter.check_version("0.35.0", "warn", "vllm serving")
    assert said is not None and "trying it anyway" in said and "0.35.0" in said
    assert adapter.check_version("0.26.0", "refuse", "vllm warmer") is None
    assert adapter.check_version(None, "refuse", "vllm warmer") is None


def test_the_spec_and_the_environment_take_the_same_values():
    field = VllmWorkload.model_fields["vllm_version_check"]
    assert tuple(field.annotation.__args__) == VLLM_VERSION_CHECKS
    assert VLLM_VERSION_CHECK.read({VLLM_VERSION_CHECK.name: "warn"}) == "warn"
    with pytest.raises(SpecError, match="KERNELCACHE_VLLM_VERSION_CHECK='maybe'"):
        VLLM_VERSION_CHECK.read({VLLM_VERSION_CHECK.name: "maybe"})
    doc = vllm_doc("/var/cache/vllm", vllmVersionCheck="maybe")
    with pytest.raises(SpecError, match=r"workload\.vllmVersionCheck"):
        parse_kernelcache(doc, "kc.yaml")


def test_the_webhook_gives_serving_pods_the_specs_choice():
    from kernelcache.controller.webhook import serving_env

    plain = parse_kernelcache(vllm_doc("/c"), "kc.yaml")
    names = {e["name"]: e["value"] for e in serving_env(plain)}
    assert VLLM_VERSION_CHECK.name not in names  # refuse: the default, not written out
    warn = parse_kernelcache(vllm_doc("/c", vllmVersionCheck="warn"), "kc.yaml")
    assert {e["name"]: e["value"] for e in serving_env(warn)}[VLLM_VERSION_CHECK.name] == "warn"


# ------------------------------------------------------------------- end to end


def installed_as(tmp_path: Path, version: str, **overrides: str) -> dict[str, str]:
    """The stand-in engine installed as vLLM ``version`` (its metadata on the path)."""
    site = tmp_path / f"site-{version}"
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    env = fake_env(**overrides)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    return env


def test_the_warm_refuses_a_vllm_outside_the_range_before_anything_runs(tmp_path):
    root = tmp_path / "vllm-root"
    (tmp_path / "kc.yaml").write_text(yaml.safe_dump(vllm_doc(root)))
    proc = run_kernelcache(
        "build", "-f", str(tmp_path / "kc.yaml"), "--store", str(tmp_path / "store"),
        **installed_as(tmp_path, "0.25.1"),
    )  # fmt: skip
    assert proc.returncode == ExitCode.NOT_INSTALLED, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("kernelcache: error: sm_90a: vllm warmer: vLLM 0.25.1 is outside")
    assert adapter.SUPPORTED in lines[-1] and "Traceback" not in proc.stderr
    assert not root.exists()  # nothing was warmed: the root was never claimed


def test_the_warm_tries_it_with_a_warning_when_the_spec_says_warn(tmp_path):
    doc = vllm_doc(tmp_path / "vllm-root", vllmVersionCheck="warn")
    (tmp_path / "kc.yaml").write_text(yaml.safe_dump(doc))
    proc = run_kernelcache(
        "build", "-f", str(tmp_path / "kc.yaml"), "--store", str(tmp_path / "store"),
        "--dry-run", **installed_as(tmp_path, "0.35.0"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "vLLM 0.35.0 is outside the range" in proc.stderr
    assert "trying it anyway (vllmVersionCheck: warn)" in proc.stderr


def test_a_whole_warm_on_a_release_outside_the_range_runs_when_the_spec_says_warn(tmp_path):
    from tests.helpers.vllm import build, runtime_hook

    doc = vllm_doc(tmp_path / "vllm-root", vllmVersionCheck="warn")
    with runtime_hook():
        built = build(tmp_path, doc, installed_as(tmp_path, "0.35.0"))
    assert "vLLM 0.35.0 is outside the range" in built["log"]
    assert "trying it anyway (vllmVersionCheck: warn)" in built["log"]
    assert built["manifest"].is_file()


SERVING = "import kernelcache.runtime as r; r.install(); import vllm; print('vllm imported')"


def test_a_serving_start_refuses_it_when_vllm_is_imported_and_warns_when_asked(tmp_path):
    env = installed_as(tmp_path, "0.35.0", KERNELCACHE_RUNTIME="1")
    refused = subprocess.run(
        [sys.executable, "-c", SERVING], env=env, capture_output=True, text=True,
        timeout=scaled(120),
    )  # fmt: skip
    assert refused.returncode == ExitCode.NOT_INSTALLED, refused.stderr
    assert "vllm imported" not in refused.stdout
    assert refused.stderr.strip().splitlines() == [
        f"kernelcache: vllm serving: vLLM 0.35.0 is outside the range the vllm toolchain "
        f"supports ({adapter.SUPPORTED}; proven on a GPU: 0.26.0): install a vLLM in the "
        "range, or set vllmVersionCheck: warn in the vllm warmer's workload to try this one"
    ]
    warned = subprocess.run(
        [sys.executable, "-c", SERVING], env={**env, VLLM_VERSION_CHECK.name: "warn"},
        capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
    assert warned.returncode == 0, warned.stderr
    assert "vllm imported" in warned.stdout and "trying it anyway" in warned.stderr


def test_doctor_reports_the_installed_vllm_against_the_range(tmp_path):
    (tmp_path / "kc.yaml").write_text(yaml.safe_dump(vllm_doc(tmp_path / "root")))
    outside = run_kernelcache(
        "doctor", "-f", str(tmp_path / "kc.yaml"), "--arch", "sm_90a",
        **installed_as(tmp_path, "0.25.1"),
    )  # fmt: skip
    assert outside.returncode == ExitCode.NOT_INSTALLED, outside.stdout + outside.stderr
    assert "vLLM 0.25.1 is outside the range" in outside.stdout.replace("\n", " ")
    inside = run_kernelcache(
        "doctor", "-f", str(tmp_path / "kc.yaml"), "--arch", "sm_90a", "--json",
        **installed_as(tmp_path, "0.26.0"),
    )  # fmt: skip
    rows = {row["check"]: row for row in yaml.safe_load(inside.stdout)["checks"]}
    assert rows["range/vllm"]["status"] == "ok", rows["range/vllm"]
    assert "vllm==0.26.0 is in the supported range" in rows["range/vllm"]["detail"]
