"""The vllm warmer and serving path without a GPU: spec, path factors, cache root, runtime.

The engine is ``tests/helpers/fake_vllm``: ``vllm serve`` as an API server and an engine core
process (forked, or spawned), vLLM's hook points (``Worker.compile_or_warm_up_model`` arming
``vllm.utils.jit_monitor`` at its end, ``GPUModelRunner.execute_model``/``_dummy_run``, the
startup plan in ``determine_available_memory``), one worker per tensor-parallel rank, and
vLLM's two failures as measured on an H200: a compile cache that names its own absolute root,
and a fused-MoE kernel first loaded at a prefill size warm-up did not run, which
``jit_monitor_mode="error"`` turns into a dead engine core. The same pipeline on the real
engine: ``tests/test_vllm_gpu.py`` and ``bench/vllm_coldstart.py``.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from kernelcache import stamp as stamps
from kernelcache.errors import SpecError
from kernelcache.spec import parse_kernelcache
from kernelcache.store import Store
from tests.conftest import publish_files, run_kernelcache, scaled
from tests.helpers.generations import make_stamp
from tests.helpers.vllm import (
    ARCH,
    FAKE_VLLM,
    KEY,
    MODEL,
    build,
    drive,
    fake_env,
    runtime_hook,
    verify,
    vllm_doc,
    workload,
)


@pytest.fixture(scope="module", autouse=True)
def hook():
    """vllm serve's processes load the runtime through its .pth hook, as in an installed image."""
    with runtime_hook():
        yield


# ------------------------------------------------------------------------------ the spec


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"promptLengths": [2046]}, "workload.promptLengths: 2046 + maxTokens 4 is more than"),
        ({"batchSizes": [8], "maxNumSeqs": 4}, "workload.batchSizes: 8 is more than maxNumSeqs"),
        ({"cacheRoot": "cache/vllm"}, "workload.cacheRoot: expected an absolute path"),
        ({"cacheRoot": "/"}, "workload.cacheRoot: expected an absolute path below / without"),
        ({"maxModelLen": None}, "workload.maxModelLen: required field is missing"),
        ({"tensorParallel": 2}, "workload.tensorParallel: unknown field"),
        ({"gpuMemoryUtilization": 1.5}, "workload.gpuMemoryUtilization: Input should be less"),
        ({"loadFormat": "pt"}, "workload.loadFormat: Input should be 'auto', 'safetensors'"),
    ],
)
def test_a_bad_vllm_workload_is_refused_naming_the_field(changes, message):
    doc = vllm_doc("/var/cache/vllm", **changes)
    fields = doc["spec"]["warmers"][0]["workload"]
    for name in [n for n, v in changes.items() if v is None]:
        del fields[name]
    with pytest.raises(SpecError) as caught:
        parse_kernelcache(doc, "kc.yaml")
    assert caught.value.message.startswith(f"kc.yaml: spec.warmers[0].{message}")


def test_a_vllm_warmer_takes_no_entry_points_and_one_cache_root_per_kernelcache():
    doc = vllm_doc("/var/cache/vllm")
    doc["spec"]["warmers"][0]["entryPoints"] = ["m:f"]
    with pytest.raises(SpecError, match=r"warmers\[0\]\.entryPoints: not allowed for a vllm"):
        parse_kernelcache(doc, "kc.yaml")
    doc = vllm_doc("/var/cache/vllm")
    other = {"type": "vllm", "workload": workload("/other", maxModelLen=4096)}
    doc["spec"]["warmers"].append(other)
    with pytest.raises(SpecError, match=r"warmers\[1\]\.workload\.cacheRoot: differs from"):
        parse_kernelcache(doc, "kc.yaml")


def test_the_example_is_a_valid_vllm_kernelcache():
    from kernelcache.spec import load_kernelcache

    example = Path(__file__).resolve().parent.parent / "examples" / "vllm-qwen3-moe.yaml"
    kc = load_kernelcache(example)
    assert kc.spec.vllm_cache_roots() == ["/var/cache/vllm"]
    assert kc.spec.warmers[0].vllm_workload().engine_args()["compilation_config"] == {"mode": 3}


def test_engine_args_are_vllms_own_and_leave_unset_ones_out():
    kc = parse_kernelcache(vllm_doc("/r", compilationConfig={"mode": 3}), "kc.yaml")
    args = kc.spec.warmers[0].vllm_workload().engine_args()
    assert args["model"] == str(MODEL) and args["max_num_batched_tokens"] == 512
    assert args["compilation_config"] == {"mode": 3}
    assert "max_num_seqs" not in args


# ------------------------------------------------------------------------------ path factors


def test_path_factors_are_measured_again_or_carried_where_the_stamp_is_checked(monkeypatch):
    paths = {"vllm/cache_root": "/var/cache/vllm", "vllm/model": "/models/q"}
    built = stamps.collect(arch=ARCH, gpu_product="NVIDIA H200", distributions=(), paths=paths)
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/var/cache/vllm")
    assert stamps.explain(built, stamps.environment_stamp(built)) == []
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/elsewhere")
    diffs = stamps.explain(built, stamps.environment_stamp(built))
    assert [d.describe() for d in diffs] == ["vllm/cache_root: /var/cache/vllm != /elsewhere"]
    with pytest.raises(SpecError, match="vllm/weights: not a path factor"):
        stamps.collect(arch=ARCH, distributions=(), paths={"vllm/weights": "/w"})


# ------------------------------------------------------------------------------ one warm, shared


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A generation built by ``kernelcache build`` with the vllm warmer; the warm's root gone."""
    tmp = tmp_path_factory.mktemp("vllm")
    return build(tmp, vllm_doc(tmp / "vllm-root"), fake_env())


def test_the_warm_reports_passes_until_a_fresh_engine_meets_no_jit(built):
    manifest = json.loads(built["manifest"].read_text())
    report = manifest["report"]["warmers"][0]
    first, enumerating, last = report["passes"]
    # The cold pass: vLLM's own warm-up leaves the sweep's prefills and attention to the first
    # requests (JIT events after ready).
    assert not first["serving"] and first["jit_events"]
    assert first["cold_compiles"]["triton/fused_moe_kernel"] > 0
    # Set up as serving, the next pass ran every batch shape at every token count through the
    # engine's own steps before the monitor armed: its sweep met nothing; the last pass
    # replayed that coverage, as serving does, and compiled nothing.
    assert enumerating["serving"] and enumerating["jit_events"] == []
    assert enumerating["coverage_seconds"] > 0
    assert last["serving"] and last["jit_events"] == [] and last["cold_compiles"] == {}
    assert last["coverage_seconds"] is not None
    # Every kernel the MoE layer can load for 1..512 tokens (the stand-in's table gives 9
    # token counts of their own, 2 kernels each), and both attention kernels, each recorded
    # with the batch that loaded it first or as vLLM's warm-up's.
    assert report["coverage"]["fused_moe"].startswith("18 kernels: ")
    assert report["coverage"]["attention"].startswith("2 kernels: 2 first loaded by the ")
    assert "gaps" not in report["coverage"]
    # The cold pass's events' token counts run before the monitor arms from then on.
    assert report["preload_sizes"] == sorted({e["tokens"] for e in first["jit_events"]})
    assert report["coverage"]["fused_moe tables"] == (
        "E=32,N=512,device_name=NVIDIA_H200.json: not tuned (vLLM ships "
        "E=32,N=512,device_name=NVIDIA_H200.json (mode auto))"
    )
    # Each pass was vllm serve: the monitor armed in the engine core, not the API server.
    for one in report["passes"]:
        assert [p["server"] for p in one["processes"] if p["armed"]] == [False]
    assert first["outputs_digest"] == last["outputs_digest"]
    factors = next(iter(report["cache_key_factors"].values()))
    assert factors == {"model": str(MODEL), "dtype": "auto"}  # vLLM's own, as written
    stamp = manifest["stamp"]["factors"]
    assert stamp["vllm/cache_root"] == str(built["root"])
    assert stamp["vllm/model"] == str(MODEL)
    assert stamp["vllm/install"] == str(FAKE_VLLM)
    paths = {f["path"] for f in manifest["files"]}
    assert {"vllm-warmup/sizes.json", "vllm-warmup/coverage.json"} <= paths
    assert any(p.endswith("cache_key_factors.json") for p in paths)
    assert not any(p.endswith(".kernelcache-vllm-root") for p in paths)
    # vLLM's startup plan, recorded by the compile Job, kept as GPU-product tuning.
    assert [p for p in paths if p.startswith("vllm/startup_plan/")] == [
        f"vllm/startup_plan/{name}" for name in report["startup_plans"]
    ] and len(report["startup_plans"]) == 1
    assert first["startup_plan"]["plans"] == 0 and last["startup_plan"]["applied"] is True


def test_verify_refuses_another_cache_root_naming_the_factor(built, tmp_path):
    proc = verify(built, tmp_path / "pod", fake_env(VLLM_CACHE_ROOT=str(tmp_path / "moved")))
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"kernelcache: error: stamp mismatch: vllm/cache_root: {built['root']} != "
        f"{tmp_path / 'moved'} (VLLM_CACHE_ROOT; vLLM's compile cache holds absolute paths: "
        f"set VLLM_CACHE_ROOT={built['root']} in the pod, as in the compile Job)"
    ]
    assert not (tmp_path / "pod" / "kernelcache.env").exists()


def test_verify_refuses_a_root_that_holds_someone_elses_files(built, tmp_path):
    built["root"].mkdir()
    (built["root"].parent / "vllm-root" / "notes.txt").write_text("mine")
    try:
        proc = verify(built, tmp_path / "pod", fake_env(VLLM_CACHE_ROOT=str(built["root"])))
        assert proc.returncode == 10, proc.stderr
        assert "is not empty and not kernelcache's (holds notes.txt" in proc.stderr
        assert (built["root"] / "notes.txt").read_text() == "mine"
    finally:
        shutil.rmtree(built["root"])


def served_env(built, pod, **extra):
    return fake_env(
        VLLM_CACHE_ROOT=str(built["root"]), KERNELCACHE_ENV_FILE=str(pod / "kernelcache.env"),
        **extra,
    )  # fmt: skip


ERROR_MODE = {"model": str(MODEL), "max_num_batched_tokens": 512, "jit_monitor_mode": "error"}
# Shapes outside the declared sweep: token counts its prefills and decodes never had.
OUTSIDE = {"prompt_lengths": [1, 33, 77, 250, 511], "batch_sizes": [2, 5, 7], "max_tokens": 3}


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_served_from_the_generation_the_sweep_meets_no_jit_in_error_mode(built, tmp_path, method):
    pod = tmp_path / "pod"
    proc = verify(built, pod, fake_env(VLLM_CACHE_ROOT=str(built["root"])))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((pod / "kernelcache-verify.json").read_text())
    assert report["vllm_cache_root"] == str(built["root"]) and report["vllm_files"] > 0
    # vLLM's engine core forked by the API server, or spawned (a fresh interpreter whose
    # .pth hook installs the runtime again): the hooks run where the model runs.
    serving = served_env(built, pod, VLLM_WORKER_MULTIPROC_METHOD=method)
    rc, served, log = drive(tmp_path, "served", serving, runtime="serving", engine=ERROR_MODE)
    assert rc == 0 and served["sweep_error"] is None, log
    assert served["jit_events"] == [] and served["monitor_mode"] == "error"
    assert served["coverage_seconds"] is not None and served["cold_compiles"] == {}
    [engine] = [p for p in served["processes"] if p["armed"]]
    assert engine["pid"] != served["server_pid"] and not engine["server"]
    assert [p["server"] for p in served["processes"] if not p["armed"]] == [True]
    assert 0 < served["import_seconds"] < served["ready_seconds"]
    recorded = json.loads(built["manifest"].read_text())["report"]["warmers"][0]
    assert served["preload_sizes"] == recorded["preload_sizes"]
    # The same engine on the same restored cache, without kernelcache's runtime: vLLM's
    # own warm-up leaves the prefill kernels to the first request, and error mode kills it.
    rc, plain, _ = drive(tmp_path, "plain", serving, engine=ERROR_MODE)
    assert rc == 1 and "JIT compilation during inference: " in plain["sweep_error"]
    # Strict: the coverage check before ready, and the engine's own monitor mode after it.
    strict = {**serving, "KERNELCACHE_STRICT": "1"}
    rc, result, log = drive(tmp_path, "strict", strict, runtime="serving", more_sweeps=[OUTSIDE])
    assert rc == 0 and result["monitor_mode"] == "warn" and result["jit_events"] == [], log
    assert result["cold_compiles"] == {} and result["sweep_error"] is None
    # Outputs are the cold engine's, the warm's first pass.
    from kernelcache.toolchains.vllm.engine import differing_outputs, outputs_digest

    cold = recorded["passes"][0]
    assert outputs_digest(served["outputs"]) == cold["outputs_digest"]
    assert differing_outputs(served["outputs"], cold["output_digests"]) == []
    # A shape that answers otherwise is named, and only that one.
    shape = sorted(served["outputs"])[0]
    changed = {**served["outputs"], shape: [[0] * 4]}
    assert differing_outputs(changed, cold["output_digests"]) == [shape]


# ------------------------------------------------------------------------------ coverage


def _mla_model(tmp: Path) -> Path:
    """The tiny model with DeepSeek's attention (MLA) and two shared experts."""
    config = json.loads((MODEL / "config.json").read_text())
    model = tmp / "mla-shared"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({**config, "kv_lora_rank": 512, "n_shared_experts": 2})
    )
    return model


@pytest.mark.parametrize("kind", ["qwen3-moe", "mla-shared-experts"])
def test_coverage_enumerates_every_batch_the_scheduler_can_form(monkeypatch, tmp_path, kind):
    """In the engine's own objects (the stand-in's): every batch shape at every token count
    through the worker's steps. Whatever batches the scheduler forms from any prompts (chunked
    prefill, continued chunks beside new prompts, decodes), their kernels are in the
    enumerated set; the set is the same on every build; no request is left in the engine,
    and a model with shared experts serves after it (a layer called from outside would not)."""
    monkeypatch.syspath_prepend(str(FAKE_VLLM))
    from vllm.entrypoints.cli.main import steps
    from vllm.model_executor.layers import fused_moe
    from vllm.v1.worker.gpu_worker import Worker

    from kernelcache.toolchains.vllm import coverage

    model = MODEL if kind == "qwen3-moe" else _mla_model(tmp_path)

    from triton import knobs

    def enumerated(bound: int) -> tuple[coverage.Coverage, Worker]:
        fused_moe.LOADED.clear()  # a fresh process: nothing loaded yet
        monkeypatch.setattr(knobs.compilation, "listener", None)
        monkeypatch.setattr(coverage, "loads", coverage.Loads())
        coverage.loads.install()
        worker = Worker(str(model), Path("/nonexistent"), "bfloat16", max_num_batched_tokens=bound)
        worker.load_model()
        return coverage.enumerate_forwards(worker, worker.vllm_config), worker

    monkeypatch.setenv("TRITON_CACHE_DIR", str(Path(tempfile.mkdtemp())))
    (again, _), (first, worker) = enumerated(300), enumerated(300)
    assert first.families == again.families and first.shapes == again.shapes
    assert worker.model_runner.requests == {}  # every request it ran was finished
    recorded = {s.kernel for s in first.specializations()}
    loaded = set(fused_moe.LOADED)
    rng = random.Random(7)
    for _ in range(20):
        prompts = [[1] * rng.randint(1, 700) for _ in range(rng.randint(1, 6))]
        for step in steps(prompts, rng.randint(1, 4), 300):
            worker.model_runner.execute_model(step)
    assert set(fused_moe.LOADED) == loaded  # served batches met nothing new
    assert {k.partition("[")[0] for k in loaded} <= recorded | {"fused_moe_kernel"}
    if kind == "mla-shared-experts":
        assert "mask_empty_context_kernel" in recorded
        assert first.specializations("attention")
    # Each kernel is recorded with the batch that loaded it first.
    for spec in first.specializations():
        assert spec.shape in coverage.SHAPES and 1 <= spec.tokens <= 300
    assert first.engine["max_num_batched_tokens"] == 300
    assert first.representatives()


def test_inspect_and_explain_show_coverage_per_family(built):
    proc = run_kernelcache("inspect", "--store", str(built["store"]))
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if " coverage: " in line]
    said = "\n".join(lines)
    assert f"{KEY} coverage: attention: 2 kernels: 2 first loaded by the enumerated " in said
    assert f"{KEY} coverage: fused_moe: 18 kernels: " in said
    assert f"{KEY} coverage: sampler: not enumerated: " in said
    from kernelcache.toolchains.vllm import coverage_diffs

    report = json.loads(built["manifest"].read_text())["report"]
    fewer = json.loads(json.dumps(report))
    fewer["warmers"][0]["coverage"]["fused_moe"] = "2 kernels: 2 first loaded by the enumerated"
    [diff] = coverage_diffs(report, fewer)
    assert diff.startswith("fused_moe: 18 kernels") and diff.endswith(
        "!= 2 kernels: 2 first loaded by the enumerated"
    )
    assert coverage_diffs(report, report) == []


def test_a_start_whose_generation_lacks_a_specialization_fails_before_ready(built, tmp_path):
    pod = tmp_path / "pod"
    assert verify(built, pod, fake_env(VLLM_CACHE_ROOT=str(built["root"]))).returncode == 0
    files = next(pod.glob("*/files"))
    recorded = json.loads((files / "vllm-warmup" / "coverage.json").read_text())
    spec = next(s for s in recorded["families"]["fused_moe"]["specializations"] if s["shape"])
    entry = base64.b32encode(bytes.fromhex(spec["hash"])).decode().rstrip("=")
    shutil.rmtree(files / "triton" / entry)
    serving = served_env(built, pod, KERNELCACHE_STRICT="1")
    rc, result, log = drive(tmp_path, "lacking", serving, runtime="serving")
    assert rc == 1 and result["ready_seconds"] is None, log
    assert (
        f"vllm coverage: fused_moe: fused_moe_kernel for a {spec['shape']} batch of "
        f"{spec['tokens']} tokens had to be compiled: the generation lacks it"
    ) in log
    # Not strict: the same line as a warning, and the engine serves (it compiled the kernel).
    shutil.rmtree(files / "triton" / entry)
    rc, result, log = drive(tmp_path, "warned", served_env(built, pod), runtime="serving")
    assert rc == 0 and result["sweep_error"] is None, log
    assert "had to be compiled: the generation lacks it; the engine compiles what is" in log


def test_a_start_configured_otherwise_than_the_coverage_fails_naming_the_setting(built, tmp_path):
    pod = tmp_path / "pod"
    assert verify(built, pod, fake_env(VLLM_CACHE_ROOT=str(built["root"]))).returncode == 0
    serving = served_env(built, pod, KERNELCACHE_STRICT="1")
    more = {"model": str(MODEL), "max_num_batched_tokens": 1024}
    rc, result, log = drive(tmp_path, "more", serving, runtime="serving", engine=more)
    assert rc == 1 and result["ready_seconds"] is None, log
    assert (
        "vllm coverage: the engine's configuration is not the one the generation enumerated "
        "(max_num_batched_tokens: 512 != 1024): rebuild the KernelCache with this configuration"
    ) in log


def test_strict_after_ready_serves_a_compile_and_counts_it(built, tmp_path):
    """Strict refuses a missing kernel before ready; after, a compile is served, counted and
    named (killing an engine with requests in flight helps no one) unless the engine itself
    was given vLLM's error mode."""
    pod = tmp_path / "pod"
    assert verify(built, pod, fake_env(VLLM_CACHE_ROOT=str(built["root"]))).returncode == 0
    serving = served_env(built, pod, KERNELCACHE_STRICT="1", FAKE_VLLM_SAMPLER_KERNEL="1")
    rc, result, log = drive(tmp_path, "after", serving, runtime="serving")
    assert rc == 0 and result["sweep_error"] is None, log
    assert result["cold_compiles"] == {"triton/sampler_kernel": 1}
    assert [e["kernel"] for e in result["jit_events"]] == ["sampler_kernel[top_p=True]"]
    rc, result, log = drive(tmp_path, "error", serving, runtime="serving", engine=ERROR_MODE)
    assert rc == 1 and "JIT compilation during inference: sampler_kernel" in result["sweep_error"]


def test_a_build_warms_what_serving_learned_before_the_monitor_arms(tmp_path):
    """``--learned``: the record's token counts run before the monitor arms from the first
    pass on, are recorded for serving's preload, and make a generation of their own."""
    root, store = tmp_path / "vllm-root", tmp_path / "store"
    (tmp_path / "kc.yaml").write_text(yaml.safe_dump(vllm_doc(root)))
    record = {
        "kind": "KernelCacheLearned",
        "keys": [
            {"toolchain": "vllm", "kernel": "fused_moe_kernel", "tokens": 41, "count": 3},
            {"toolchain": "vllm", "kernel": "fused_moe_kernel", "tokens": 9},
            {"toolchain": "triton", "kernel": "sampler_kernel", "key": "ab12"},
        ],
    }
    (tmp_path / "learned.json").write_text(json.dumps(record))
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "build", "-f", str(tmp_path / "kc.yaml"),
         "--store", str(store), "--learned", str(tmp_path / "learned.json")],
        env=fake_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(next(store.glob("default/vq/*/*/MANIFEST.json")).read_text())
    report = manifest["report"]["warmers"][0]
    assert {9, 41} <= set(report["preload_sizes"])
    assert report["passes"][0]["preload_sizes"] == [9, 41]  # run before the monitor armed
    assert manifest["stamp"]["factors"]["extra/learned_sizes"] == "9,41"
    files = next(store.glob("default/vq/*/*/files"))
    assert {9, 41} <= set(json.loads((files / "vllm-warmup/sizes.json").read_text())["sizes"])


def test_a_bad_learned_record_is_one_line_before_anything_warms(tmp_path):
    (tmp_path / "kc.yaml").write_text(yaml.safe_dump(vllm_doc(tmp_path / "root")))
    (tmp_path / "learned.json").write_text('{"keys": [{"toolchain": "vllm", "tokens": 3}]}')
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "build", "-f", str(tmp_path / "kc.yaml"),
         "--store", str(tmp_path / "store"), "--learned", str(tmp_path / "learned.json")],
        env=fake_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and not (tmp_path / "store").exists()
    assert proc.stderr.strip().splitlines() == [
        f"kernelcache: error: --learned {tmp_path / 'learned.json'}: keys[0].kernel: Field required"
    ]


def test_what_the_engine_core_compiled_after_ready_is_in_the_pods_learned_record(built, tmp_path):
    """The engine core compiles the sampler after ready; its key reaches the record that the
    pod's metrics server serves (``runtime.learning``: shared beside the port)."""
    pod = tmp_path / "pod"
    assert verify(built, pod, fake_env(VLLM_CACHE_ROOT=str(built["root"]))).returncode == 0
    port, temp = _free_port(), tmp_path / "temp"
    temp.mkdir()
    serving = served_env(
        built, pod, FAKE_VLLM_SAMPLER_KERNEL="1", KERNELCACHE_METRICS_PORT=str(port),
        TMPDIR=str(temp),
    )  # fmt: skip
    rc, result, log = drive(tmp_path, "learned", serving, runtime="serving")
    assert rc == 0 and result["sweep_error"] is None, log
    from kernelcache import learned

    records = [
        learned.parse(p.read_bytes(), p.name)[0]
        for p in (temp / f"kernelcache-learned-{port}").glob("*.json")
    ]
    met = {(k.toolchain, k.kernel) for keys in records for k in keys}
    assert ("vllm", "sampler_kernel[top_p=True]") in met and ("triton", "sampler_kernel") in met
    assert all(k.key for keys in records for k in keys if k.toolchain == "triton")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_strict_serving_refuses_an_incomplete_cache_root_before_the_engine(built, tmp_path):
    pod = tmp_path / "pod"
    assert verify(built, pod, fake_env(VLLM_CACHE_ROOT=str(built["root"]))).returncode == 0
    victim = next(p for p in built["root"].rglob("*") if p.name == "vllm_compile_cache.py")
    victim.unlink()
    serving = served_env(built, pod, KERNELCACHE_STRICT="1")
    rc, result, log = drive(tmp_path, "strict", serving, runtime="serving")
    assert rc == 1 and result["server_exit"] == 10 and result["processes"] == [], log
    assert (
        f"kernelcache: {built['root']}: the vLLM cache root lacks 1 of the generation's files, "
        f"e.g. vllm/{victim.relative_to(built['root'])} (kernelcache verify --materialize puts "
        "them there)"
    ) in log.splitlines()


def test_the_engines_model_is_held_to_the_generations(built, tmp_path):
    pod = tmp_path / "pod"
    assert verify(built, pod, fake_env(VLLM_CACHE_ROOT=str(built["root"]))).returncode == 0
    serving = served_env(built, pod, KERNELCACHE_STRICT="1")
    other = {"model": "/models/another", "max_num_batched_tokens": 512}
    rc, result, log = drive(tmp_path, "other", serving, runtime="serving", engine=other)
    assert rc != 0 and result["ready_seconds"] is None
    assert f"stamp mismatch: vllm/model: {MODEL} != /models/another" in log


def test_a_warm_whose_engine_core_runs_without_kernelcaches_hooks_fails_saying_so(tmp_path):
    """An image where kernelcache is not installed in vLLM's interpreter (no .pth hook): the
    engine core counts nothing, so a pass that saw no JIT proves nothing.

    An interpreter of its own (a venv whose site directory holds no .pth hook; the packages
    come on PYTHONPATH, where ``site`` runs no .pth file): the shared environment's
    site-packages may hold another test's hook at any moment."""
    import sysconfig

    venv = tmp_path / "venv"
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    env = fake_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], sysconfig.get_path("purelib")])
    (tmp_path / "kc.yaml").write_text(yaml.safe_dump(vllm_doc(tmp_path / "root")))
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "kernelcache", "build", "-f",
         str(tmp_path / "kc.yaml"), "--store", str(tmp_path / "store")],
        env=env, capture_output=True, text=True, timeout=scaled(600),
    )  # fmt: skip
    assert proc.returncode == 11, proc.stderr
    assert "kernelcache's hooks did not run in vLLM's engine core process" in proc.stderr
    assert not list((tmp_path / "store").glob("default/vq/*/*/MANIFEST.json"))


# ------------------------------------------------------------------------------ startup plan


def test_the_startup_plan_serves_its_gpu_product_only_and_less_memory_profiles(built, tmp_path):
    recorded = json.loads(built["manifest"].read_text())["report"]["warmers"][0]
    [plan] = recorded["startup_plans"]
    # Another GPU product: the plan is tuning of another GPU, refused (strict policy) or
    # left out of the copy (permissive), like autotune results.
    other = fake_env(VLLM_CACHE_ROOT=str(built["root"]), KERNELCACHE_GPU_PRODUCT="NVIDIA H100")
    proc = verify(built, tmp_path / "h100", other)
    assert proc.returncode == 4, proc.stderr
    assert "gpu_product: NVIDIA H200 != NVIDIA H100" in proc.stderr
    assert f"vllm/startup_plan/{plan}" in proc.stderr
    proc = verify(built, tmp_path / "h100", other, "--policy", "permissive")
    assert proc.returncode == 0, proc.stderr
    assert not (built["root"] / "startup_plan" / plan).exists()
    rc, result, log = drive(
        tmp_path, "h100", served_env(built, tmp_path / "h100", FAKE_VLLM_GPU="NVIDIA H100"),
        runtime="serving",
    )  # fmt: skip
    assert rc == 0 and result["startup_plan"]["plans"] == 0, log
    # The same product, a node that never ran the engine: vLLM applies the compile Job's plan.
    pod = tmp_path / "pod"
    assert verify(built, pod, fake_env(VLLM_CACHE_ROOT=str(built["root"]))).returncode == 0
    rc, applied, log = drive(tmp_path, "applied", served_env(built, pod), runtime="serving")
    assert rc == 0 and applied["startup_plan"]["applied"] is True, log
    assert "Memory profiling takes" not in log
    # Less free memory than the plan recorded: vLLM profiles; the start succeeds, and says so.
    rc, fallback, log = drive(
        tmp_path, "less", served_env(built, pod, FAKE_VLLM_FREE_GIB="100"), runtime="serving"
    )
    assert rc == 0 and fallback["sweep_error"] is None and fallback["jit_events"] == [], log
    assert fallback["startup_plan"]["applied"] is False and "Memory profiling takes" in log
    assert (
        "kernelcache: vLLM's startup plan from the generation was not applied (this GPU has "
        "100.00 GiB free, the plan recorded 139.29 GiB): vLLM profiles memory instead"
    ) in log


# ------------------------------------------------------------------------------ tensor parallel


def test_a_tensor_parallel_warm_keeps_and_places_every_ranks_cache(tmp_path):
    """TP=2 on the stand-in engine only (no two-GPU machine measured it): one compile cache
    per rank (rank_0_0, rank_1_0) and one startup plan per rank, all placed back."""
    root, store = tmp_path / "root", tmp_path / "store"
    (tmp_path / "kc.yaml").write_text(yaml.safe_dump(vllm_doc(root, tensorParallelSize=2)))
    proc = run_kernelcache(
        "build", "-f", str(tmp_path / "kc.yaml"), "--store", str(store),
        PYTHONPATH=fake_env()["PYTHONPATH"], PATH=fake_env()["PATH"],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(next(store.glob("default/vq/*/*/MANIFEST.json")).read_text())
    ranks = {p.split("/")[3] for f in manifest["files"] if (p := f["path"]).count("rank_")}
    assert ranks == {"rank_0_0", "rank_1_0"}
    assert len(manifest["report"]["warmers"][0]["startup_plans"]) == 2
    shutil.rmtree(root)
    built = {"store": store, "root": root}
    assert verify(built, tmp_path / "pod", fake_env(VLLM_CACHE_ROOT=str(root))).returncode == 0
    assert {p.name for p in (root / "torch_compile_cache" / "abc123").iterdir()} == ranks
    engine = {**ERROR_MODE, "tensor_parallel_size": 2}
    rc, served, log = drive(
        tmp_path, "tp2", served_env(built, tmp_path / "pod"), runtime="serving", engine=engine
    )
    assert rc == 0 and served["jit_events"] == [] and served["torch_compile_seconds"] < 0.1, log
    assert served["startup_plan"]["applied"] is True


# ------------------------------------------------------------------------------ FlashInfer


def flashinfer_generation(tmp_path, modules, present):
    """A vllm generation whose warm recorded FlashInfer ``modules``; ``present`` laid out."""
    files = {f"flashinfer/aot/{m}/{m}.so": b"\x7fELF" + m.encode() for m in present}
    report = {"warmers": [{"warmer": "vllm m", "flashinfer_modules": modules}]}
    stamp = make_stamp()
    stamp["factors"]["arch"] = ARCH
    publish_files(Store(tmp_path / "store"), KEY, files, stamp, report)
    return {"store": tmp_path / "store"}


def test_the_init_container_refuses_a_generation_missing_a_flashinfer_module_the_warm_loaded(
    tmp_path,
):
    modules = ["batch_prefill_with_kv_cache_dtype_q_bf16", "sampling"]
    generation = flashinfer_generation(tmp_path, modules, present=["sampling"])
    proc = verify(generation, tmp_path / "pod", fake_env(), "--policy", "permissive")
    assert proc.returncode == 10, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "FlashInfer module batch_prefill_with_kv_cache_dtype_q_bf16 that the warm loaded" in line
    assert not (tmp_path / "pod" / "kernelcache.env").exists()
    complete = flashinfer_generation(tmp_path / "b", modules, present=modules)
    proc = verify(complete, tmp_path / "pod", fake_env(), "--policy", "permissive")
    assert proc.returncode == 0, proc.stderr
    assert (
        json.loads((tmp_path / "pod" / "kernelcache-verify.json").read_text())["flashinfer_modules"]
        == 2
    )


def test_the_warm_fails_when_flashinfer_loaded_a_module_it_did_not_build(tmp_path):
    from kernelcache.errors import WarmError
    from kernelcache.toolchains.vllm.passes import keep_flashinfer_modules

    jit = tmp_path / "flashinfer" / ".cache" / "flashinfer" / "0.6.14" / "90a" / "cached_ops"
    (jit / "sampling").mkdir(parents=True)
    (jit / "sampling" / "sampling.so").write_bytes(b"\x7fELF")
    assert keep_flashinfer_modules(tmp_path, ["sampling"]) == ["sampling"]
    assert (tmp_path / "flashinfer" / "aot" / "sampling" / "sampling.so").is_file()
    with pytest.raises(WarmError, match="module norm was loaded but no library of it was built"):
        keep_flashinfer_modules(tmp_path, ["norm", "sampling"])


def test_flashinfer_builds_and_loads_are_seen_where_flashinfer_has_no_build_log():
    """FlashInfer 0.6.x logs no builds: its ``JitSpec`` is where a build shows."""
    from kernelcache.runtime import metrics
    from kernelcache.toolchains import flashinfer

    class JitSpec:
        def __init__(self, name, seconds, aot):
            self.name, self.seconds, self.is_aot = name, seconds, aot

        def build(self, verbose, need_lock=True):
            time.sleep(self.seconds)

        def build_and_load(self):
            if not self.is_aot:
                self.build(False)
            return self.name

    module = type("core", (), {"JitSpec": JitSpec})
    flashinfer.watch_jit(module, noop_threshold=0.05)
    before = sum(v for (t, _), v in metrics.cold_compiles().items() if t == "flashinfer")
    assert JitSpec("sampling", 0.06, False).build_and_load() == "sampling"
    JitSpec("norm", 0.0, False).build_and_load()  # ninja found it up to date
    JitSpec("decode", 0.0, True).build_and_load()  # prebuilt
    after = sum(v for (t, _), v in metrics.cold_compiles().items() if t == "flashinfer")
    assert after - before == 1 and [b["name"] for b in flashinfer.loads.builds] == ["sampling"]
    assert flashinfer.loads.modules == {"sampling": "jit", "norm": "jit", "decode": "aot"}


def test_explain_names_vllms_own_cache_key_factors(built, tmp_path):
    (tmp_path / "kc.yaml").write_text(yaml.safe_dump(vllm_doc(tmp_path / "root", dtype="float16")))
    proc = run_kernelcache(
        "build", "-f", str(tmp_path / "kc.yaml"), "--store", str(tmp_path / "store"),
        PYTHONPATH=fake_env()["PYTHONPATH"],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    other = next((tmp_path / "store").glob("default/vq/*/*/MANIFEST.json"))
    proc = run_kernelcache("explain", str(built["manifest"]), str(other))
    assert proc.returncode == 4, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("vllm cache_key_factors: dtype: auto != float16 (torch_compile")
    assert any(line.startswith("workload: ") for line in lines)


def test_compile_job_and_serving_pod_mount_the_cache_root_writable():
    pytest.importorskip("kopf", reason="needs kernelcache[operator]")
    from kernelcache.controller.config import OperatorConfig
    from kernelcache.controller.manifests import compile_job
    from kernelcache.controller.webhook import apply_ops, mutate_pod

    doc = vllm_doc("/var/cache/vllm")
    kc = parse_kernelcache(doc, "kc")
    config = OperatorConfig(init_image="kernelcache-init:1")
    job = compile_job(
        kc, arch=ARCH, digest="d" * 12, attempt=0, owner={"uid": "u", "name": "vq"}, config=config
    )
    pod_spec = job["spec"]["template"]["spec"]
    [mount] = [m for m in pod_spec["containers"][0]["volumeMounts"] if m["name"] == "vllm-root-0"]
    assert mount == {"name": "vllm-root-0", "mountPath": "/var/cache/vllm"}
    assert {"name": "vllm-root-0", "emptyDir": {}} in pod_spec["volumes"]
    pod = {
        "metadata": {
            "name": "p",
            "namespace": "default",
            "labels": {"kernelcache.dev/cache": "vq"},
        },
        "spec": {"containers": [{"name": "vllm", "image": doc["spec"]["engine"]["image"]}]},
    }
    mutated = apply_ops(pod, mutate_pod(pod, doc, config))
    init, serving = mutated["spec"]["initContainers"][0], mutated["spec"]["containers"][0]
    wanted = {"name": "kernelcache-vllm-0", "mountPath": "/var/cache/vllm"}
    assert wanted in init["volumeMounts"] and wanted in serving["volumeMounts"]
    assert {"name": "VLLM_CACHE_ROOT", "value": "/var/cache/vllm"} in serving["env"]
    assert {"name": "kernelcache-vllm-0", "emptyDir": {}} in mutated["spec"]["volumes"]


def test_what_the_warm_still_meets_after_ready_is_a_named_gap_not_a_lost_build(tmp_path):
    """A kernel every request loads after ready (the stand-in's sampler) that no batch before
    ready can load: the build publishes all the same, naming it in the generation, in
    inspect and in the result the operator reads; strict serving with requireFullCoverage
    refuses the generation before ready, in one line; without it, serves and says so."""
    env = fake_env(FAKE_VLLM_SAMPLER_KERNEL="1")
    built = build(tmp_path, vllm_doc(tmp_path / "vllm-root", requireFullCoverage=True), env)
    report = json.loads(built["manifest"].read_text())["report"]["warmers"][0]
    [gap] = report["coverage_gaps"]
    assert gap.startswith("sampler: sampler_kernel[top_p=True] (outside a forward)"), gap
    assert len(report["passes"]) == 3 and report["passes"][-1]["jit_events"]
    proc = run_kernelcache("inspect", "--store", str(built["store"]))
    assert f"{KEY} coverage: gaps: 1 kernel(s) still loaded after ready: {gap}" in proc.stdout
    pod = tmp_path / "pod"
    assert verify(built, pod, fake_env(VLLM_CACHE_ROOT=str(built["root"]))).returncode == 0
    strict = served_env(built, pod, KERNELCACHE_STRICT="1", FAKE_VLLM_SAMPLER_KERNEL="1")
    rc, result, log = drive(tmp_path, "strict", strict, runtime="serving")
    assert rc == 1 and result["ready_seconds"] is None, log
    assert (
        "vllm coverage: the generation names 1 kernel(s) the warm still met after ready (e.g. "
        f"{gap}) and the KernelCache demands full coverage"
    ) in log
    relaxed = served_env(built, pod, FAKE_VLLM_SAMPLER_KERNEL="1")
    rc, result, log = drive(tmp_path, "relaxed", relaxed, runtime="serving")
    assert rc == 0 and result["sweep_error"] is None, log
    assert "the KernelCache demands full coverage; the engine compiles what is missing" in log
