"""vLLM start-up three ways, each a fresh process: cold, vLLM's own warm restart, and served
from a kernelcache generation on "another node".

1. cold: empty caches; ready time and vLLM's own breakdown (from its log lines);
2. warm restart: the same process again on the same directories (the anchor);
3. ``kernelcache warm`` with the vllm warmer builds a generation (the compile Job), the
   warm's cache root is removed, ``kernelcache verify --check-env --materialize`` (the
   init-container's command) materializes it into a fresh directory and puts vLLM's tree back
   at the fixed root, and the engine starts from it with ``jit_monitor_mode="error"``: ready
   time, torch.compile time, files written, compile events counted by kernelcache and by
   vLLM's monitor, a request sweep over the declared shapes, outputs against the cold run;
4. (``--strict``) the same with ``KERNELCACHE_STRICT=1``.

    python bench/vllm_coldstart.py --model DIR --work SCRATCH --out RESULT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
KEY = "default/vllm-bench"


def files_under(*roots: Path) -> dict[str, int]:
    return {
        str(p): p.stat().st_size
        for root in roots
        if root.is_dir()
        for p in root.rglob("*")
        if p.is_file()
    }


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    return proc.returncode


def engine(work: Path, name: str, env: dict[str, str], job: dict[str, Any], log: Path) -> dict:
    """One engine process (``kernelcache.toolchains.vllm``); ready counts from before its start."""
    job = {**job, "result": str(work / f"{name}.result.json")}
    job_path = work / f"{name}.job.json"
    job_path.write_text(json.dumps(job))
    started = time.time()
    env = {**env, "KERNELCACHE_STARTED_AT": repr(started)}
    engine_cmd = [sys.executable, "-m", "kernelcache.toolchains.vllm", str(job_path)]
    rc = run_logged(engine_cmd, env, log, 900)
    result_path = Path(job["result"])
    if not result_path.exists():
        return {"stage": name, "rc": rc, "failed": "no result (see the log)"}
    result: dict[str, Any] = json.loads(result_path.read_text())
    result.update(stage=name, rc=rc, wall_seconds=round(time.time() - started, 3))
    return result


def summary(result: dict[str, Any], cold: dict[str, Any] | None) -> dict[str, Any]:
    keys = (
        "rc", "failed", "import_seconds", "ready_seconds", "torch_compile_seconds",
        "first_generate_seconds", "sweep_seconds", "monitor_mode", "preload_seconds",
        "sweep_error", "compiled_by_toolchain", "new_files",
    )  # fmt: skip
    out = {k: result[k] for k in keys if k in result}
    out["jit_events"] = len(result.get("jit_events", []))
    out["jit_event_kernels"] = sorted({e["kernel"] for e in result.get("jit_events", [])})
    out["kernelcache_cold_compiles"] = sum(result.get("cold_compiles", {}).values())
    if cold is not None and "outputs" in result:
        out["outputs_identical_to_cold"] = result["outputs"] == cold.get("outputs")
    out["breakdown"] = [
        (t, line[:160])
        for t, line in result.get("log", [])
        if any(word in line for word in _BREAKDOWN)
    ]
    return out


_BREAKDOWN = (
    "Resolved architecture", "Loading weights took", "Model loading took", "Dynamo bytecode",
    "Compiling a graph", "Directly load", "torch.compile took", "Memory profiling",
    "Graph capturing finished", "init engine", "JIT monitor activated", "kernelcache:",
    "Available KV cache", "profiling",
)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="model dir (config.json)")
    parser.add_argument("--work", type=Path, required=True, help="scratch dir (emptied)")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("--log", type=Path, help="every process's output (default: beside out)")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--strict", action="store_true", help="also serve with strict mode")
    parser.add_argument("--skip-anchors", action="store_true", help="no cold/warm-restart runs")
    args = parser.parse_args()
    work = args.work.absolute()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = args.log or args.out.with_suffix(".log")
    log.write_text("")
    from kernelcache.toolchains.vllm import ENGINE_ENV, engine_job

    base = {**os.environ, **ENGINE_ENV}
    workload = {**WORKLOAD, "model": str(args.model.absolute())}

    job = engine_job(workload)
    engine_args, sweep = job["engine"], job["sweep"]
    report: dict[str, Any] = {}
    results: dict[str, Any] = {
        "workload": workload, "started": time.strftime("%FT%TZ"), "report": report
    }  # fmt: skip

    def save() -> None:  # after every stage: a run cut short still says what it measured
        args.out.write_text(json.dumps(results, indent=1, default=str))

    # 1-2. vLLM on its own: cold, then its own warm restart on the same directories.
    anchor = {**base, "VLLM_CACHE_ROOT": str(work / "anchor-root")}
    plain = {"engine": engine_args, "sweep": sweep, "runtime": "none", "preload": []}
    cold = None
    if not args.skip_anchors:
        cold = engine(work, "cold", anchor, plain, log)
        warm = engine(work, "warm_restart", anchor, plain, log)
        report["cold"], report["warm_restart"] = summary(cold, None), summary(warm, cold)
        results["cold"] = cold
        save()

    # 3. The compile Job: kernelcache warm with the vllm warmer.
    root = work / "vllm-root"  # the fixed path of compile Job and serving pod alike
    spec = {
        "apiVersion": "kernelcache.dev/v1alpha1",
        "kind": "KernelCache",
        "metadata": {"name": KEY.split("/")[1]},
        "spec": {
            "model": "qwen3-moe-tiny",
            "engine": {"image": "kernelcache-vllm:bench"},
            "gpuClasses": [{"name": "h200", "arch": args.arch, "gpuProduct": "NVIDIA H200"}],
            "warmers": [{"type": "vllm", "workload": {**workload, "cacheRoot": str(root)}}],
        },
    }
    spec_path = work / "kernelcache.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    store = work / "store"
    kc = [sys.executable, "-m", "kernelcache"]
    t = time.time()
    rc = run_logged([*kc, "warm", "-f", str(spec_path), "--store", str(store), "--arch", args.arch],
                    base, log, 1800)  # fmt: skip
    build = {"rc": rc, "seconds": round(time.time() - t, 3)}
    manifest_path = next(store.glob("*/*/*/*/MANIFEST.json"), None) if store.is_dir() else None
    if manifest_path is not None:
        manifest = json.loads(manifest_path.read_text())
        warmer = manifest["report"]["warmers"][0]
        build.update(
            files=len(manifest["files"]),
            bytes=sum(f["size"] for f in manifest["files"]),
            stamp_vllm={k: v for k, v in manifest["stamp"]["factors"].items() if "vllm" in k},
            warmer={k: v for k, v in warmer.items() if k != "cache_key_factors"},
            cache_key_factors=warmer.get("cache_key_factors"),
        )
    report["build"] = build
    save()

    # 4. Another node, in effect: the warm's root is gone; the init-container's command puts
    # the generation back into a fresh directory and vLLM's tree at the fixed root.
    shutil.rmtree(root, ignore_errors=True)
    pod = work / "pod"
    serve_env = {**base, "VLLM_CACHE_ROOT": str(root), "KERNELCACHE_ARCH": args.arch}
    t = time.time()
    rc = run_logged([*kc, "verify", "--store", str(store), "--key", f"{KEY}/{args.arch}",
                     "--check-env", "--materialize", str(pod)], serve_env, log, 600)  # fmt: skip
    report["verify"] = {"rc": rc, "seconds": round(time.time() - t, 3)}
    served_env = {**serve_env, "KERNELCACHE_ENV_FILE": str(pod / "kernelcache.env")}
    served_job = {**plain, "runtime": "serving",
                  "engine": {**engine_args, "jit_monitor_mode": "error"}}  # fmt: skip
    for name, extra in [("served", {}), *([("served_strict", {"KERNELCACHE_STRICT": "1"})]
                                          if args.strict else [])]:  # fmt: skip
        before = files_under(root, pod)
        served = engine(work, name, {**served_env, **extra}, served_job, log)
        after = files_under(root, pod)
        served["new_files"] = len([p for p in after if p not in before])
        report[name] = summary(served, cold)
        results[name] = {k: v for k, v in served.items() if k != "outputs"}
        save()

    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
