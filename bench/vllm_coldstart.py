"""``vllm serve`` start-up, each start a fresh API server and engine core: the compile Job,
served starts from a kernelcache generation, and vLLM's own steady warm restarts.

Stages, in order (each one's summary saved as it ends; ``--resume`` skips those saved):

1. ``build``: ``kernelcache warm`` with the vllm warmer (every pass is ``vllm serve``); its
   first pass is the cold start, whose tokens everything is compared with;
2. ``verify``: the warm's cache root removed (another node, in effect), ``kernelcache verify
   --check-env --materialize`` (the init-container's command) into a fresh directory;
3. ``served_strict``: served with ``KERNELCACHE_STRICT=1`` (vLLM's monitor in ``error`` mode
   and, with FlashInfer, ``FLASHINFER_DISABLE_JIT=1``), the declared sweep and one outside it;
4. ``served_real``: the same generation (warmed with ``loadFormat: dummy``) serving real
   safetensors weights with ``load_format=auto`` (``--real-weights``); with ``--load-format
   auto`` every start, the compile Job's too, loads the real weights instead;
5. ``served_less_memory``: another process holds GPU memory, so vLLM's startup plan does not
   fit: vLLM profiles, the start succeeds, kernelcache says so;
6. the anchors, interleaved with served starts: ``anchor_first`` (vLLM alone, its own cache
   root, writes its startup plan), ``anchor_1`` (its first restart, an outlier), then
   ``served_1``, ``anchor_2``, ``plan_1``, ``served_2``, ``anchor_3``, ``plan_2``: vLLM's
   steady warm restart without (``anchor_2``, ``anchor_3``) and with (``plan_N``) its
   startup plan, on the same node. With FlashInfer, vLLM alone gets the
   generation's prebuilt modules as FlashInfer's own ``flashinfer_jit_cache`` package (its
   best case: no nvcc, no ninja).

Medians of ready and ready-minus-import (import alone is 10-15 s and noisy) go into
``summary``; ``--budget-seconds`` stops before a stage that would not fit (``--resume``
continues).

Before the stages, ``import``: where a bare ``import`` of vLLM's API server spends its time
(``python -X importtime``), the part of every start no cache reaches.

    python bench/vllm_coldstart.py --model DIR --work SCRATCH --out RESULT.json [--flashinfer]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

WORKLOAD: dict[str, Any] = {
    "loadFormat": "dummy",
    "dtype": "bfloat16",
    "maxModelLen": 2048,
    "maxNumBatchedTokens": 2048,
    "gpuMemoryUtilization": 0.5,
    "skipTokenizerInit": True,
    "promptLengths": [7, 100, 1000, 2000],
    "batchSizes": [1, 3, 16, 64],
    "maxTokens": 8,
}
OUTSIDE = {"prompt_lengths": [1, 33, 777, 1500], "batch_sizes": [2, 5, 48], "max_tokens": 8}
KEY = "default/vllm-bench"
# Seconds a stage may take at most, for --budget-seconds.
STAGE_SECONDS = {"build": 900, "anchor_first": 240}
# anchor_1 is vLLM's first restart after its cold start, an outlier (it writes what a warm
# start adds under torch_aot_compile): the steady restarts are anchor_2 and anchor_3.
ANCHORS = [
    "anchor_first", "anchor_1", "served_1", "anchor_2", "plan_1", "served_2", "anchor_3",
    "plan_2",
]  # fmt: skip


def files_under(*roots: Path) -> set[str]:
    return {str(p) for root in roots if root.is_dir() for p in root.rglob("*") if p.is_file()}


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    return proc.returncode


def engine(work: Path, name: str, env: dict[str, str], job: dict[str, Any], log: Path) -> dict:
    """One ``vllm serve`` (``kernelcache.toolchains.vllm``); ready counts from before its start."""
    job = {**job, "result": str(work / f"{name}.result.json")}
    job_path = work / f"{name}.job.json"
    job_path.write_text(json.dumps(job))
    started = time.time()
    env = {**env, "KERNELCACHE_STARTED_AT": repr(started)}
    rc = run_logged([sys.executable, "-m", "kernelcache.toolchains.vllm", str(job_path)], env,
                    log, 900)  # fmt: skip
    result_path = Path(job["result"])
    if not result_path.exists():
        return {"stage": name, "rc": rc, "failed": "no result (see the log)"}
    result: dict[str, Any] = json.loads(result_path.read_text())
    result.update(stage=name, rc=rc, wall_seconds=round(time.time() - started, 3))
    return result


_BREAKDOWN = (
    "Resolved architecture", "Loading weights took", "Model loading took", "Dynamo bytecode",
    "Compiling a graph", "Directly load", "torch.compile took", "Memory profiling",
    "Graph capturing finished", "init engine", "JIT monitor activated", "kernelcache:",
    "Available KV cache", "startup plan", "Startup plan", "FlashInfer", "flashinfer",
    "Using AttentionBackend", "backend", "MissingJITCacheError", "Error", "error", "spawn",
    "multiprocessing",
)  # fmt: skip


def summary(result: dict[str, Any], cold: dict[str, list] | None) -> dict[str, Any]:
    keys = (
        "rc", "failed", "import_seconds", "ready_seconds", "torch_compile_seconds",
        "coverage_seconds",
        "first_generate_seconds", "sweep_seconds", "monitor_mode", "preload_seconds",
        "sweep_error", "compiled_by_toolchain", "new_files", "startup_plan", "processes",
        "flashinfer_modules", "flashinfer_builds", "server_exit",
    )  # fmt: skip
    out = {k: result[k] for k in keys if k in result}
    if result.get("ready_seconds") and result.get("import_seconds"):
        out["ready_minus_import"] = round(result["ready_seconds"] - result["import_seconds"], 3)
    out["jit_events"] = len(result.get("jit_events", []))
    out["jit_event_kernels"] = sorted({e["kernel"] for e in result.get("jit_events", [])})
    out["kernelcache_cold_compiles"] = sum(result.get("cold_compiles", {}).values())
    outputs = result.get("outputs") or {}
    if cold is not None and outputs:
        shared = sorted(set(outputs) & set(cold))
        out["outputs_compared"] = len(shared)
        out["outputs_identical_to_cold"] = all(outputs[k] == cold[k] for k in shared)
        out["differs_from_vllm_alone_first"] = [k for k in shared if outputs[k] != cold[k]]
    out["breakdown"] = [
        (t, line[:200]) for t, line in result.get("log", []) if any(w in line for w in _BREAKDOWN)
    ][:80]
    return out


def versions() -> dict[str, str]:
    """The engine's and its compilers' versions, recorded beside the figures."""
    from importlib import metadata

    found = {"python": sys.version.split()[0]}
    for name in ("vllm", "torch", "triton", "flashinfer-python", "kernelcache"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def jit_cache_package(target: Path, aot: Path) -> Path:
    """FlashInfer's own ``flashinfer_jit_cache`` package, pointing at prebuilt modules: how
    vLLM alone runs FlashInfer with no JIT (the anchors' best case)."""
    package = target / "flashinfer_jit_cache"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        "from importlib.metadata import version as _v\n"
        "__version__ = _v('flashinfer-python') + '+prebuilt'\n"
        f"def get_jit_cache_dir():\n    return {str(aot)!r}\n"
    )
    return target


def holding_gpu_memory(gib: float, flag: Path) -> subprocess.Popen:
    """A co-tenant: a process that holds ``gib`` GiB of GPU memory until killed."""
    code = (
        "import torch, time, sys; x = torch.empty(int(float(sys.argv[1]) * 2**30), "
        "dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); "
        "open(sys.argv[2], 'w').close(); time.sleep(3600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(gib), str(flag)])
    deadline = time.monotonic() + 120
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc


def import_profile(env: dict[str, str]) -> dict[str, Any]:
    """``python -X importtime`` of vLLM's API server module: its total and the modules that
    take longest with what they import (cumulative microseconds)."""
    t = time.time()
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import vllm.entrypoints.openai.api_server"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    top = [name for name in rows if not name[1].startswith("   ")]  # the top-level imports
    return {
        "rc": proc.returncode,
        "seconds": round(time.time() - t, 3),
        "modules": len(rows),
        "top_level": sorted(top, reverse=True)[:20],
        "largest": sorted(rows, reverse=True)[:40],
    }


def medians(stages: dict[str, Any]) -> dict[str, Any]:
    groups = {
        "served": ("served_strict", "served_1", "served_2"),  # the same strict start, 3 times
        "anchor": ("anchor_2", "anchor_3"),  # vLLM's steady warm restart, no startup plan
        "plan": ("plan_1", "plan_2"),  # vLLM's warm restart with its own startup plan
    }

    def of(names: tuple[str, ...], field: str) -> dict[str, Any]:
        values = [stages[n][field] for n in names if n in stages and stages[n].get(field)]
        return {"n": len(values), "median": round(statistics.median(values), 3)} if values else {}

    found: dict[str, Any] = {
        group: {f: of(names, f) for f in ("ready_seconds", "ready_minus_import")}
        for group, names in groups.items()
    }
    served = found["served"]["ready_seconds"].get("median")
    for anchor in ("anchor", "plan"):
        theirs = found[anchor]["ready_seconds"].get("median")
        if served and theirs:
            found[f"served_over_{anchor}_ready"] = round(served / theirs, 3)
        mine = found["served"]["ready_minus_import"].get("median")
        other = found[anchor]["ready_minus_import"].get("median")
        if mine and other:
            found[f"served_over_{anchor}_ready_minus_import"] = round(mine / other, 3)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="model dir (config.json)")
    parser.add_argument("--work", type=Path, required=True, help="scratch dir")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("--log", type=Path, help="every process's output (default: beside out)")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--flashinfer", action="store_true", help="FLASHINFER backend+sampler")
    parser.add_argument("--sampler-only", action="store_true", help="FlashInfer sampler only")
    parser.add_argument("--real-weights", action="store_true", help="the model dir has them")
    parser.add_argument("--load-format", default="dummy", choices=["dummy", "auto"],
                        help="auto: every start loads the model dir's weights")  # fmt: skip
    parser.add_argument("--skip", action="append", default=[], help="a stage not to run")
    parser.add_argument("--resume", action="store_true", help="skip the stages already saved")
    parser.add_argument("--budget-seconds", type=float, default=0, help="0: no limit")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=WORKLOAD["maxNumBatchedTokens"])  # fmt: skip
    parser.add_argument("--moe-tuning", default="auto", choices=["off", "auto", "always"])
    parser.add_argument("--moe-tuning-budget", type=int, default=600, help="seconds")
    parser.add_argument("--hold-gib", type=float, default=4.0, help="served_less_memory")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=WORKLOAD["gpuMemoryUtilization"]
    )
    args = parser.parse_args()
    begun = time.monotonic()
    work = args.work.absolute()
    results: dict[str, Any] = {}
    if args.resume and args.out.exists():
        results = json.loads(args.out.read_text())
    else:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    log = args.log or args.out.with_suffix(".log")
    from kernelcache.toolchains.vllm.engine import (
        differing_outputs,
        output_digests,
        outputs_digest,
    )
    from kernelcache.toolchains.vllm.passes import ENGINE_ENV, engine_job

    base = {**os.environ, **ENGINE_ENV}
    workload = {
        **WORKLOAD,
        "model": str(args.model.absolute()),
        "loadFormat": args.load_format,
        "gpuMemoryUtilization": args.gpu_memory_utilization,
        "maxNumBatchedTokens": args.max_num_batched_tokens,
        "moeTuning": {"mode": args.moe_tuning, "budgetSeconds": args.moe_tuning_budget},
    }
    stages_skipped = set(args.skip)
    env_extra: dict[str, str] = {}
    if args.flashinfer or args.sampler_only:
        if not args.sampler_only:
            workload["attentionBackend"] = "FLASHINFER"
        env_extra["VLLM_USE_FLASHINFER_SAMPLER"] = "1"
    else:
        env_extra["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    base.update(env_extra)
    job = engine_job(workload)
    engine_args, sweep = job["engine"], job["sweep"]
    stages: dict[str, Any] = results.setdefault("stages", {})
    results.update(workload=workload, env=env_extra, started=results.get("started") or
                   time.strftime("%FT%TZ"), model_config=json.loads(
                       (args.model / "config.json").read_text()), versions=versions())  # fmt: skip
    cold_path = work / "cold-outputs.json"

    def save() -> None:  # after every stage: a run cut short still says what it measured
        results["summary"] = medians(stages)
        args.out.write_text(json.dumps(results, indent=1, default=str))

    def fits(name: str) -> bool:
        if name in stages_skipped:
            return False
        need = STAGE_SECONDS.get(name, 120)
        left = args.budget_seconds - (time.monotonic() - begun)
        if args.budget_seconds and left < need:
            results["stopped_before"] = name
            save()
            return False
        return True

    root = work / "vllm-root"  # the fixed path of compile Job and serving pod alike
    store, pod = work / "store", work / "pod"
    kc = [sys.executable, "-m", "kernelcache"]
    plain = {"engine": engine_args, "sweep": sweep, "runtime": "none", "preload": []}

    if "import" not in stages and fits("import"):
        stages["import"] = import_profile(base)
        save()

    # 1. The compile Job.
    if "build" not in stages:
        if not fits("build"):
            return 0
        spec = {
            "apiVersion": "kernelcache.dev/v1alpha1",
            "kind": "KernelCache",
            "metadata": {"name": KEY.split("/")[1]},
            "spec": {
                "model": "qwen3-moe-tiny",
                "engine": {"image": "kernelcache-vllm:bench"},
                "gpuClasses": [{"name": "h200", "arch": args.arch, "gpuProduct": "NVIDIA H200"}],
                "warmers": [{"type": "vllm", "env": env_extra,
                             "workload": {**workload, "cacheRoot": str(root)}}],
            },
        }  # fmt: skip
        spec_path = work / "kernelcache.yaml"
        spec_path.write_text(yaml.safe_dump(spec))
        t = time.time()
        rc = run_logged([*kc, "warm", "-f", str(spec_path), "--store", str(store), "--arch",
                         args.arch], base, log, 3000)  # fmt: skip
        build: dict[str, Any] = {"rc": rc, "seconds": round(time.time() - t, 3)}
        manifest_path = next(store.glob("*/*/*/*/MANIFEST.json"), None)
        if manifest_path is not None:
            manifest = json.loads(manifest_path.read_text())
            warmer = manifest["report"]["warmers"][0]
            build.update(
                files=len(manifest["files"]),
                bytes=sum(f["size"] for f in manifest["files"]),
                dirs=manifest["report"].get("dirs"),
                stamp_vllm={k: v for k, v in manifest["stamp"]["factors"].items() if "vllm" in k},
                warmer={k: v for k, v in warmer.items() if k != "cache_key_factors"},
                cache_key_factors=warmer.get("cache_key_factors"),
            )
        stages["build"] = build
        save()
        if rc != 0:
            return 1
    passes = stages["build"]["warmer"]["passes"]
    cold = next(p for p in passes if not p.get("tuning_ended"))  # the engine that tuned ends
    cold_digest = cold["outputs_digest"]
    cold_digests = cold.get("output_digests", {})

    def compared(out: dict[str, Any], outputs: dict[str, Any]) -> dict[str, Any]:
        """Shape by shape against the compile Job's cold pass (and, in ``summary``, against
        vLLM alone's first start): which shapes answered otherwise."""
        out["output_digests"] = output_digests(outputs)
        out["differs_from_cold_pass"] = differing_outputs(outputs, cold_digests)
        return out

    # 2. Another node, in effect: the warm's root is gone; the init-container's command.
    serve_env = {**base, "VLLM_CACHE_ROOT": str(root), "KERNELCACHE_ARCH": args.arch}
    if "verify" not in stages:
        shutil.rmtree(root, ignore_errors=True)
        t = time.time()
        rc = run_logged([*kc, "verify", "--store", str(store), "--key", f"{KEY}/{args.arch}",
                         "--check-env", "--materialize", str(pod)], serve_env, log,
                        600)  # fmt: skip
        report_path = pod / "kernelcache-verify.json"
        stages["verify"] = {
            "rc": rc,
            "seconds": round(time.time() - t, 3),
            "report": json.loads(report_path.read_text()) if report_path.exists() else None,
        }
        save()
        if rc != 0:
            return 1
    served_env = {**serve_env, "KERNELCACHE_ENV_FILE": str(pod / "kernelcache.env")}
    strict_env = {**served_env, "KERNELCACHE_STRICT": "1"}
    served_job = {**plain, "runtime": "serving",
                  "engine": {**engine_args, "jit_monitor_mode": "error"}}  # fmt: skip
    cold = json.loads(cold_path.read_text()) if cold_path.exists() else None

    def served(name: str, env: dict[str, str], job: dict[str, Any]) -> dict[str, Any]:
        before = files_under(root, pod)
        result = engine(work, name, env, job, log)
        result["new_files"] = len(files_under(root, pod) - before)
        out = compared(summary(result, cold), result.get("outputs") or {})
        declared = {f"{n}x{b}" for n in sweep["prompt_lengths"] for b in sweep["batch_sizes"]}
        got = {k: v for k, v in (result.get("outputs") or {}).items() if k in declared}
        if len(got) == len(declared):
            out["declared_outputs_digest_is_cold_pass"] = outputs_digest(got) == cold_digest
        stages[name] = out
        save()
        return result

    # 3. Served, strict: error mode, FLASHINFER_DISABLE_JIT; the sweep and one outside it.
    if "served_strict" not in stages and fits("served_strict"):
        served("served_strict", strict_env, {**served_job, "more_sweeps": [OUTSIDE]})
    # 4. Real weights from the model directory, from the generation warmed with dummy ones.
    real_weights = args.real_weights and args.load_format == "dummy"
    if real_weights and "served_real" not in stages and fits("served_real"):
        real = {**served_job, "engine": {**served_job["engine"], "load_format": "auto"}}
        served("served_real", strict_env, real)
    # 5. A co-tenant holds GPU memory: the startup plan does not fit.
    if "served_less_memory" not in stages and fits("served_less_memory"):
        holder = holding_gpu_memory(args.hold_gib, work / "holding")
        try:
            served("served_less_memory", strict_env, served_job)
            stages["served_less_memory"]["held_gib"] = args.hold_gib
        finally:
            holder.kill()
            holder.wait()

    # 6. vLLM's own restarts on one node, interleaved with served starts.
    anchor_root, anchor_env = (
        work / "anchor-root",
        {**base, "VLLM_CACHE_ROOT": str(work / "anchor-root")},
    )
    if args.flashinfer or args.sampler_only:
        aot = Path(json.loads((pod / "kernelcache-verify.json").read_text())["dir"])
        package = jit_cache_package(work / "jit-cache", aot / "files" / "flashinfer" / "aot")
        anchor_env["PYTHONPATH"] = os.pathsep.join([str(package), base.get("PYTHONPATH", "")])
        anchor_env["FLASHINFER_DISABLE_JIT"] = "1"
    for name in ANCHORS:
        if name in stages or name in stages_skipped:
            continue
        if not fits(name):
            return 0
        if name.startswith("served_"):
            served(name, strict_env, served_job)
            continue
        plan = "0" if name.startswith("anchor_") and name != "anchor_first" else "1"
        env = {**anchor_env, "VLLM_ENABLE_STARTUP_PLAN": plan}
        if name == "anchor_first":
            shutil.rmtree(anchor_root, ignore_errors=True)
        result = engine(work, name, env, plain, log)
        if name == "anchor_first" and result.get("outputs"):
            cold_path.write_text(json.dumps(result["outputs"]))
            cold = result["outputs"]
            stages[name] = summary(result, None)
            got = result["outputs"]
            stages[name]["outputs_digest_is_cold_pass"] = outputs_digest(got) == cold_digest
        else:
            stages[name] = summary(result, cold)
        compared(stages[name], result.get("outputs") or {})
        save()
    # The served starts before the anchors are compared with vLLM's tokens now.
    results["done"] = True
    save()
    print(json.dumps(results["summary"], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
