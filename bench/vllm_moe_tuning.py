"""Fused-MoE configs tuned in the compile Job against vLLM's shipped or default ones, on the
GPU: MoE-layer latency per batch bucket and ``vllm serve`` tokens per second, side by side.

Per model (``--model NAME=DIR:MODE[:LAYERS]``, MODE the spec's ``moeTuning.mode``, LAYERS
the model's shapes at fewer layers):

1. ``<name>_build``: ``kernelcache warm`` with the vllm warmer and ``moeTuning`` (mode,
   ``--budget``): the tuning pass, the pass that enumerates coverage with the tuned table,
   the pass set up as serving. The tuning's report holds, per bucket, the baseline (vLLM's
   shipped entry, else its default) and the winner timed in alternation through the same
   layer forward: the MoE-layer figures.
2. ``<name>_tuned`` and ``<name>_baseline``: ``vllm serve`` on the build's cache root, with
   ``VLLM_TUNED_CONFIG_FOLDER`` at the generation's tables and without it; the throughput
   sweep twice (the second is the one reported: the first includes the baseline's own JIT).

    python bench/vllm_moe_tuning.py --model qwen3=bench/qwen3-30b-a3b:always \\
        --model olmoe=bench/olmoe-1b-7b:auto --work SCRATCH --out RESULT.json [--resume]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_coldstart import engine, run_logged, versions

WORKLOAD: dict[str, Any] = {
    "loadFormat": "dummy",
    "dtype": "bfloat16",
    "maxModelLen": 2048,
    "maxNumBatchedTokens": 2048,
    "gpuMemoryUtilization": 0.6,
    "skipTokenizerInit": True,
    "promptLengths": [7, 100, 1000],
    "batchSizes": [1, 16],
    "maxTokens": 8,
}
THROUGHPUT = {"prompt_lengths": [256], "batch_sizes": [1, 8, 64, 256], "max_tokens": 64}


def tokens_per_second(result: dict[str, Any]) -> dict[str, float]:
    """Generated tokens per second per shape, from the last time each shape ran."""
    found = {}
    for shape, seconds in (result.get("shape_seconds") or {}).items():
        batch = int(shape.split("x")[1])
        found[shape] = round(batch * THROUGHPUT["max_tokens"] / seconds[-1], 1)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="NAME=DIR:MODE[:LAYERS]")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=int, default=150, help="moeTuning.budgetSeconds")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.resume and (
        args.out.exists()) else {}  # fmt: skip
    work = args.work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".log")
    from kernelcache.toolchains.vllm.passes import ENGINE_ENV, engine_job

    base = {**os.environ, **ENGINE_ENV, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    stages: dict[str, Any] = results.setdefault("stages", {})
    results.update(versions=versions(), budget_seconds=args.budget, throughput=THROUGHPUT)
    results.setdefault("started", time.strftime("%FT%TZ"))

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=1, default=str))

    for entry in args.model:
        name, _, rest = entry.partition("=")
        model_dir, mode, *layers = rest.split(":")
        model = Path(model_dir).absolute()
        config = json.loads((model / "config.json").read_text())
        if layers:  # the model's shapes at fewer layers: the same MoE layer, a shorter start
            config.update(num_hidden_layers=int(layers[0]), max_window_layers=int(layers[0]))
            model = work / name / "model"
            model.mkdir(parents=True, exist_ok=True)
            (model / "config.json").write_text(json.dumps(config, indent=1))
        results.setdefault("models", {})[name] = {"mode": mode, "config": config}
        root, store = work / name / "vllm-root", work / name / "store"
        workload = {**WORKLOAD, "model": str(model), "cacheRoot": str(root),
                    "moeTuning": {"mode": mode, "budgetSeconds": args.budget}}  # fmt: skip
        if f"{name}_build" not in stages:
            spec = {
                "apiVersion": "kernelcache.dev/v1alpha1",
                "kind": "KernelCache",
                "metadata": {"name": f"moe-{name}"},
                "spec": {
                    "model": name,
                    "engine": {"image": "kernelcache-vllm:bench"},
                    "gpuClasses": [{"name": "h200", "arch": args.arch,
                                    "gpuProduct": "NVIDIA H200"}],
                    "warmers": [{"type": "vllm", "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"},
                                 "workload": workload}],
                },
            }  # fmt: skip
            (work / name).mkdir(parents=True, exist_ok=True)
            spec_path = work / name / "kernelcache.yaml"
            spec_path.write_text(yaml.safe_dump(spec))
            began = time.time()
            warm = [sys.executable, "-m", "kernelcache", "warm", "-f", str(spec_path)]
            rc = run_logged([*warm, "--store", str(store), "--arch", args.arch], base, log, 3000)
            build: dict[str, Any] = {"rc": rc, "seconds": round(time.time() - began, 1)}
            manifest_path = next(store.glob("*/*/*/*/MANIFEST.json"), None)
            if manifest_path is not None:
                warmer = json.loads(manifest_path.read_text())["report"]["warmers"][0]
                build["moe_tuning"] = warmer.get("moe_tuning")
                build["coverage"] = warmer.get("coverage")
                build["generation"] = str(manifest_path.parent)
                build["passes"] = [
                    {k: p.get(k) for k in ("serving", "ready_seconds", "coverage_seconds",
                                           "jit_events", "cold_compiles")}
                    for p in warmer["passes"]
                ]  # fmt: skip
            stages[f"{name}_build"] = build
            save()
            if rc != 0:
                return 1
        generation = Path(stages[f"{name}_build"]["generation"])
        job = engine_job(workload)
        served = {"engine": job["engine"], "sweep": THROUGHPUT, "more_sweeps": [THROUGHPUT],
                  "runtime": "none", "preload": []}  # fmt: skip
        for variant in ("tuned", "baseline"):
            stage = f"{name}_{variant}"
            if stage in stages:
                continue
            env = {**base, "VLLM_CACHE_ROOT": str(root)}
            env.pop("VLLM_TUNED_CONFIG_FOLDER", None)
            if variant == "tuned":
                env["VLLM_TUNED_CONFIG_FOLDER"] = str(generation / "files" / "vllm-moe")
            result = engine(work / name, stage, env, served, log)
            stages[stage] = {
                "rc": result.get("rc"),
                "ready_seconds": result.get("ready_seconds"),
                "sweep_error": result.get("sweep_error"),
                "shape_seconds": result.get("shape_seconds"),
                "tokens_per_second": tokens_per_second(result),
                "jit_events": len(result.get("jit_events", [])),
            }
            save()
        tuned, baseline = stages[f"{name}_tuned"], stages[f"{name}_baseline"]
        buckets = [b for s in (stages[f"{name}_build"].get("moe_tuning") or {}).get("shapes", [])
                   for b in s.get("buckets", [])]  # fmt: skip
        results["models"][name]["summary"] = {
            "layer_gain_median": statistics.median(b["gain"] for b in buckets) if buckets else None,
            "tokens_per_second_ratio": {
                shape: round(tps / baseline["tokens_per_second"][shape], 3)
                for shape, tps in tuned["tokens_per_second"].items()
                if baseline["tokens_per_second"].get(shape)
            },
        }
        save()
    results["done"] = time.strftime("%FT%TZ")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
