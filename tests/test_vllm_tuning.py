"""Fused-MoE configs tuned on the compile Job's GPU (``toolchains.vllm.tuning``), off the GPU.

The search is tested on a cost it must find the best of, a clock it must stop by, configs
that cannot run and a winner that is not faster when timed again. The whole path runs on the
stand-in engine (``tests/helpers/fake_vllm``), whose MoE forward takes time by how far its
config is from the best one for its token count (``FAKE_VLLM_MOE_MS``): a build on a GPU
product vLLM ships no table for tunes one, keeps it in the generation as that product's
tuning, enumerates coverage with it, and serving reads it. The same on the H200:
``bench/vllm_moe_tuning.py``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from kernelcache.errors import SpecError
from kernelcache.spec import parse_kernelcache
from kernelcache.toolchains.vllm import tuning
from tests.conftest import run_kernelcache
from tests.helpers.vllm import (
    FAKE_VLLM,
    MODEL,
    build,
    drive,
    fake_env,
    runtime_hook,
    verify,
    vllm_doc,
)

H100 = "NVIDIA H100 80GB HBM3"  # a GPU product the stand-in ships no table for
H100_TABLE = "E=32,N=512,device_name=NVIDIA_H100_80GB_HBM3.json"


@pytest.fixture(scope="module", autouse=True)
def hook():
    with runtime_hook():
        yield


@pytest.fixture
def fake_moe(monkeypatch):
    """The stand-in's fused-MoE modules in this process, its config tables read afresh."""
    monkeypatch.syspath_prepend(str(FAKE_VLLM))
    from vllm.model_executor.layers import fused_moe
    from vllm.model_executor.layers.fused_moe import fused_moe as tables

    tables.get_moe_configs.cache_clear()
    yield fused_moe
    tables.get_moe_configs.cache_clear()


# ------------------------------------------------------------------------------ the search


def cost_measure(fused_moe, clock_step: list[float] | None = None):
    """Seconds per forward as the stand-in's cost: 1 + steps from the best config."""

    def measure(config, tokens):
        if clock_step is not None:
            clock_step[0] += 1.0
        return fused_moe.cost(tokens, config) / 1000

    return measure


def default_for(fused_moe):
    from vllm.model_executor.layers.fused_moe.fused_moe import get_default_config

    def baseline(tokens):
        config = get_default_config(tokens, 32, 512, 1024, 4, None)
        return {k: v for k, v in config.items() if k in tuning.SPACE}

    return baseline


def test_the_search_finds_each_buckets_best_config_from_vllms_default(fake_moe):
    sizes = tuning.buckets(512)
    assert sizes == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512]
    measure = cost_measure(fake_moe)
    baseline = default_for(fake_moe)
    results = tuning.search(measure, sizes, baseline, lambda n: [], tuning.Budget(3600))
    for bucket in results:
        assert bucket.config == fake_moe.best_for(bucket.tokens), bucket
        assert bucket.tuned_ms == fake_moe.cost(bucket.tokens, bucket.config)
        assert bucket.baseline_ms == fake_moe.cost(bucket.tokens, baseline(bucket.tokens))
        assert bucket.stopped == "converged" and bucket.rejected == 0
    # The default is off by steps at every bucket here: each got faster, by what it measured.
    assert all(b.gain and b.gain > 0 for b in results)
    written = tuning.table(results, "3.6.0")
    assert written["triton_version"] == "3.6.0" and set(written) - {"triton_version"} == {
        str(n) for n in sizes
    }


def test_the_search_stops_at_its_budget_and_keeps_the_best_so_far(fake_moe):
    ticks = [0.0]
    budget = tuning.Budget(12, clock=lambda: ticks[0])
    sizes = [1, 64]
    results = tuning.search(
        cost_measure(fake_moe, ticks), sizes, default_for(fake_moe), lambda n: [], budget
    )
    # 6 s each; a bucket stops within its share (a measure is 1 s, plus the timing again).
    assert [b.stopped for b in results] == ["budget", "budget"]
    assert all(b.tried <= 7 for b in results)
    for bucket in results:
        assert bucket.tuned_ms <= bucket.baseline_ms
    assert budget.left() == 0


def test_a_config_that_cannot_run_is_rejected_and_never_chosen(fake_moe):
    def measure(config, tokens):
        if config["BLOCK_SIZE_N"] == 128:  # out of shared memory, say
            return None
        return fake_moe.cost(tokens, config) / 1000

    [bucket] = tuning.search(
        measure, [16], default_for(fake_moe), lambda n: [], tuning.Budget(3600)
    )
    assert bucket.rejected > 0 and bucket.config["BLOCK_SIZE_N"] != 128
    assert bucket.tuned_ms < bucket.baseline_ms


def test_a_winner_not_faster_when_timed_again_leaves_the_baseline(fake_moe):
    """Noise: a candidate that measured fast once but not when timed against the baseline."""
    baseline = default_for(fake_moe)
    measured: set[tuple] = set()

    def measure(config, tokens):
        if config == baseline(tokens):
            return 1.0
        lucky = tuning.key(config) not in measured
        measured.add(tuning.key(config))
        return 0.5 if lucky else 2.0  # its first sample was luck

    [bucket] = tuning.search(measure, [8], baseline, lambda n: [], tuning.Budget(3600))
    assert bucket.config == baseline(8) and bucket.tuned_ms == bucket.baseline_ms == 1000.0


def test_seeds_and_the_last_buckets_winner_are_tried_first(fake_moe):
    seen = []

    def measure(config, tokens):
        seen.append(dict(config))
        return fake_moe.cost(tokens, config) / 1000

    best = fake_moe.best_for(4)
    tuning.search(measure, [4], default_for(fake_moe), lambda n: [best], tuning.Budget(3600))
    assert seen[1] == best  # the baseline, then the seed


# ------------------------------------------------------------------------------ in the engine


def engine(monkeypatch, tmp_path, bound=64, **env):
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path / "tuned"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from vllm.v1.worker.gpu_worker import Worker

    worker = Worker(str(MODEL), Path("/nonexistent"), "bfloat16", max_num_batched_tokens=bound)
    worker.load_model()
    return worker.vllm_config


@pytest.mark.parametrize(
    ("gpu", "mode", "env", "why"),
    [
        ("NVIDIA H200", "auto", {}, "vLLM ships E=32,N=512,device_name=NVIDIA_H200.json (mode"),
        (H100, "auto", {"FAKE_VLLM_PLATFORM": "cpu"}, "no GPU: a table is measured on the GPU"),
    ],
)
def test_a_shape_not_tuned_says_why_and_writes_nothing(
    fake_moe, monkeypatch, tmp_path, gpu, mode, env, why
):
    config = engine(monkeypatch, tmp_path, FAKE_VLLM_GPU=gpu, **env)
    report = tuning.tune(config, mode, 60)
    [shape] = report.shapes
    assert shape["tuned"] is False and shape["why"].startswith(why)
    assert not (tmp_path / "tuned").exists()


def test_tensor_parallel_above_one_is_named_not_tuned(fake_moe, monkeypatch, tmp_path):
    config = engine(monkeypatch, tmp_path, FAKE_VLLM_GPU=H100)
    config.parallel_config.tensor_parallel_size = 2
    [shape] = tuning.tune(config, "always", 60).shapes
    assert shape["why"] == "tensor parallel 2: tuning runs at tensor parallel 1"


def test_always_tunes_against_the_shipped_table_and_vllm_then_reads_the_tuned_one(
    fake_moe, monkeypatch, tmp_path
):
    generation_cache = tmp_path / "triton"
    config = engine(
        monkeypatch, tmp_path, FAKE_VLLM_GPU="NVIDIA H200", FAKE_VLLM_MOE_MS="0.5",
        TRITON_CACHE_DIR=str(generation_cache),
    )  # fmt: skip
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    fake_moe.LOADED.clear()  # every candidate is a first load: compiled, somewhere

    shipped = try_get_optimal_moe_config((32, 1024, 1024), (32, 1024, 512), 4, None, 8)
    report = tuning.tune(config, "always", 120)
    [shape] = report.shapes
    assert shape["tuned"] and shape["baseline"] == "shipped" and report.device == "NVIDIA_H200"
    table = json.loads((tmp_path / "tuned" / shape["file"]).read_text())
    assert sorted(int(k) for k in table if k.isdigit()) == tuning.buckets(64)
    # vLLM's cached tables were dropped: the engine now runs the tuned entry, not the shipped.
    now = try_get_optimal_moe_config((32, 1024, 1024), (32, 1024, 512), 4, None, 8)
    assert now == table["8"] and now != shipped
    assert fake_moe.cost(8, now) < fake_moe.cost(8, shipped)
    # The candidates compiled into a scratch cache, not the generation's; a kernel loaded
    # outside the tuning lands there.
    assert len(fake_moe.LOADED) > 2
    assert not list(generation_cache.glob("**/*.cubin"))
    fake_moe.load("probe_kernel[after tuning]")
    assert [p.name for p in generation_cache.glob("**/*.cubin")] == ["probe_kernel.cubin"]


# ------------------------------------------------------------------------------ the spec


@pytest.mark.parametrize(
    ("tuning_spec", "message"),
    [
        ({"mode": "sometimes"}, "workload.moeTuning.mode: Input should be 'auto', 'always'"),
        ({"budgetSeconds": 5}, "workload.moeTuning.budgetSeconds: Input should be greater"),
        ({"budget": 60}, "workload.moeTuning.budget: unknown field"),
    ],
)
def test_a_bad_moe_tuning_is_refused_naming_the_field(tuning_spec, message):
    doc = vllm_doc("/var/cache/vllm", moeTuning=tuning_spec)
    with pytest.raises(SpecError) as caught:
        parse_kernelcache(doc, "kc.yaml")
    assert caught.value.message.startswith(f"kc.yaml: spec.warmers[0].{message}")


def test_a_warmer_env_cannot_point_vllm_at_other_tables(tmp_path):
    doc = vllm_doc("/var/cache/vllm")
    doc["spec"]["warmers"][0]["env"] = {"VLLM_TUNED_CONFIG_FOLDER": "/mine"}
    (tmp_path / "kc.yaml").write_text(yaml.safe_dump(doc))
    proc = run_kernelcache(
        "build", "--dry-run", "-f", str(tmp_path / "kc.yaml"), "--store", str(tmp_path / "s")
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"kernelcache: error: {tmp_path / 'kc.yaml'}: spec.warmers[0].env."
        "VLLM_TUNED_CONFIG_FOLDER: kernelcache points it at the generation's files/vllm-moe; "
        "remove it from env"
    ]


# ------------------------------------------------------------------------------ a build


@pytest.fixture(scope="module")
def tuned_build(tmp_path_factory):
    """A build on a GPU product with no shipped table for the model's MoE shape, of a model
    with shared experts and MLA attention (DeepSeek's design): a MoE layer the tuning runs
    from outside the model keeps its shared experts' output, which the next forward of the
    model refuses, as vLLM's does."""
    tmp = tmp_path_factory.mktemp("tuned")
    model = tmp / "deepseek-like"
    model.mkdir()
    config = json.loads((MODEL / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps({**config, "kv_lora_rank": 512, "n_shared_experts": 2})
    )
    doc = vllm_doc(tmp / "vllm-root", maxNumBatchedTokens=64, promptLengths=[5, 40],
                   moeTuning={"budgetSeconds": 120}, model=str(model))  # fmt: skip
    doc["spec"]["gpuClasses"][0]["gpuProduct"] = H100
    env = fake_env(FAKE_VLLM_GPU=H100, KERNELCACHE_GPU_PRODUCT=H100, FAKE_VLLM_MOE_MS="0.5")
    return {**build(tmp, doc, env), "model": model}


def test_a_build_tunes_keeps_the_table_as_tuning_and_enumerates_with_it(
    tuned_build, fake_moe, monkeypatch
):
    manifest = json.loads(tuned_build["manifest"].read_text())
    report = manifest["report"]["warmers"][0]
    [shape] = report["moe_tuning"]["shapes"]
    assert shape["tuned"] and shape["baseline"] == "default" and shape["file"] == H100_TABLE
    assert [b["tokens"] for b in shape["buckets"]] == tuning.buckets(64)
    assert all(b["tuned_ms"] <= b["baseline_ms"] for b in shape["buckets"])
    assert any(b["gain"] > 0.3 for b in shape["buckets"])
    assert report["coverage"]["fused_moe tables"].startswith(
        f"{H100_TABLE}: tuned against vLLM's default table, "
    )
    # Progress per bucket in the Job's log, as it went.
    assert "kernelcache: MoE tuning E=32,N=512 [1/9] 1 tokens: " in tuned_build["log"]
    assert "kernelcache: MoE tuning E=32,N=512 [9/9] 64 tokens: " in tuned_build["log"]
    # The engine that tuned ended there (its shared experts held what the tuning left), and
    # a fresh one compiled; the next, set up as serving, enumerated the coverage with the
    # table; the last, set up as serving, met nothing.
    passes = report["passes"]
    assert [(p["serving"], p["tuning_ended"]) for p in passes] == [
        (False, True),
        (False, False),
        (True, False),
        (True, False),
    ]
    assert "the engine that tuned the MoE tables ends here" in tuned_build["log"]
    assert passes[-1]["jit_events"] == [] and passes[-1]["cold_compiles"] == {}
    paths = {f["path"] for f in manifest["files"]}
    assert f"vllm-moe/{H100_TABLE}" in paths
    assert manifest["stamp"]["factors"]["gpu_product"] == H100
    files = tuned_build["manifest"].parent / "files"
    coverage = json.loads((files / "vllm-warmup" / "coverage.json").read_text())
    assert coverage["engine"]["moe_config_device"] == "NVIDIA_H100_80GB_HBM3"
    assert list(coverage["engine"]["moe_tuned_configs"]) == [H100_TABLE]
    # The enumerated kernels are exactly those the engine loads with the tuned table.
    monkeypatch.setenv("FAKE_VLLM_GPU", H100)
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(files / "vllm-moe"))
    layer = fake_moe.FusedMoEConfig(32, 4, 1024, 512, None)

    def hashes(counts):
        met = {k for tokens in counts for k in fake_moe.kernels_for(tokens, layer)}
        return {hashlib.sha256(k.encode()).hexdigest()[:32] for k in met}

    recorded = {s["hash"] for s in coverage["families"]["fused_moe"]["specializations"]}
    assert "mask_empty_context_kernel" in {
        s["kernel"] for s in coverage["families"]["attention"]["specializations"]
    }
    met = hashes(range(1, 65))
    assert recorded == met
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER")
    fake_moe.fused_moe.get_moe_configs.cache_clear()
    assert hashes(range(1, 65)).isdisjoint(met)  # the default tiles are other kernels


def test_serving_reads_the_tuned_table_and_a_start_without_it_fails_before_ready(
    tuned_build, tmp_path
):
    built = tuned_build
    pod = tmp_path / "pod"
    env = {**built["env"], "VLLM_CACHE_ROOT": str(built["root"])}
    proc = verify(built, pod, env)
    assert proc.returncode == 0, proc.stderr
    serving = {**env, "KERNELCACHE_ENV_FILE": str(pod / "kernelcache.env"),
               "KERNELCACHE_STRICT": "1"}  # fmt: skip
    engine = {"model": str(built["model"]), "max_num_batched_tokens": 64}
    plan = {"prompt_lengths": [5, 40], "batch_sizes": [1, 3], "max_tokens": 4}
    rc, served, log = drive(tmp_path, "served", serving, runtime="serving", engine=engine,
                            sweep=plan)  # fmt: skip
    assert rc == 0 and served["jit_events"] == [] and served["cold_compiles"] == {}, log
    assert served["coverage_seconds"] is not None
    # Another product's node: the init-container refuses the table (strict), naming why.
    proc = verify(built, tmp_path / "other", {**env, "KERNELCACHE_GPU_PRODUCT": "NVIDIA H200"})
    assert proc.returncode == 4 and "gpu_product" in proc.stderr, proc.stderr
    # The table gone from the pod's copy: vLLM would run its default tiles, so the start
    # fails before ready, naming what differs.
    [table] = pod.glob(f"*/files/vllm-moe/{H100_TABLE}")
    table.unlink()
    rc, result, log = drive(tmp_path, "untuned", serving, runtime="serving", engine=engine,
                            sweep=plan)  # fmt: skip
    assert rc == 1 and result["ready_seconds"] is None, log
    assert "vllm coverage: the engine's configuration is not the one the generation " in log
    assert f"(moe_tuned_configs: {{'{H100_TABLE}': " in log
