"""The b12x warmer on a Qwen3-MoE-like config: serial vs parallel compiles, artifacts, loads.

For each MoE config (NVFP4, top-8, hidden 2048, MoE intermediate 768; 128 and 256 experts) and
an RTX PRO 6000 target (sm_120a, 188 SMs), over batch sizes 1..8 and the static/dynamic
buckets up to 4,096 routed rows:

1. ``kernelcache warm`` with one compile worker, then in a fresh store with one per CPU:
   the whole warm's wall time each way, and the kernels' own compile seconds;
2. the count and bytes of what the generation holds (FlashInfer's ``.o`` files and the
   direct-micro kernels in the CuTe-DSL disk layer);
3. a fresh serving process (``tests/helpers/b12x_serve.py``: the runtime installed, the
   wrapper driven through FlashInfer's own lookup) that must compile nothing: the load time
   per kernel. The kernels are for sm_120a; on another GPU they are loaded, not launched.

    python bench/b12x_warm.py --json out.json [--experts 128 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SERVE = REPO / "tests" / "helpers" / "b12x_serve.py"
ARCH, SM_COUNT = "sm_120a", 188
BATCH_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256, 512]  # 512 x top-8 = 4,096 rows


def workload(experts: int, workers: int) -> dict[str, Any]:
    return {
        "experts": experts,
        "topK": 8,
        "hiddenSize": 2048,
        "intermediateSize": 768,
        "maxNumTokens": 4096,
        "batchSizes": BATCH_SIZES,
        "compileWorkers": workers,
    }


def env(**extra: str) -> dict[str, str]:
    merged = dict(os.environ, PYTHONUNBUFFERED="1")
    merged["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), merged.get("PYTHONPATH", "")])
    merged.update(extra)
    return merged


def warm(work: Path, experts: int, workers: int) -> tuple[float, dict[str, Any], Path]:
    """One warm into a fresh store; (wall seconds, the b12x report, the store)."""
    store = work / f"store-{experts}-{workers}"
    spec = work / f"kc-{experts}-{workers}.json"
    spec.write_text(
        json.dumps(
            {
                "apiVersion": "kernelcache.dev/v1alpha1",
                "kind": "KernelCache",
                "metadata": {"name": f"qwen3-moe-e{experts}", "namespace": "bench"},
                "spec": {
                    "model": "bench/qwen3-moe-nvfp4",
                    "engine": {"image": "bench"},
                    "gpuClasses": [{"name": "rtx-pro-6000", "arch": ARCH, "smCount": SM_COUNT}],
                    "warmers": [{"type": "b12x", "workload": workload(experts, workers)}],
                },
            }
        )
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "warm", "-f", str(spec), "--store", str(store),
         "--arch", ARCH],
        env=env(), capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"warm failed:\n{proc.stderr[-3000:]}")
    (manifest,) = store.glob(f"bench/qwen3-moe-e{experts}/{ARCH}/*/MANIFEST.json")
    (report,) = json.loads(manifest.read_text())["report"]["warmers"]
    return wall, report, manifest.parent


def serve(generation: Path, experts: int, work: Path) -> dict[str, Any]:
    log = work / f"build-log-{experts}.jsonl"
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(SERVE), json.dumps(workload(experts, 1)), str(SM_COUNT)],
        env=env(
            KERNELCACHE_DIR=str(generation),
            KERNELCACHE_STRICT="1",
            CUTE_DSL_ARCH=ARCH,
            FLASHINFER_CUDA_ARCH_LIST="12.0f",
            FLASHINFER_JIT_BUILD_LOG=str(log),
            # The node it plays: the stamp check would see this GPU's SM count otherwise.
            KERNELCACHE_SM_COUNT=str(SM_COUNT),
        ),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"serve failed:\n{proc.stderr[-3000:]}")
    served: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    served["wall_seconds"] = time.perf_counter() - start
    return served


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--experts", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    results: dict[str, Any] = {"machine": platform.node(), "cpus": os.cpu_count(), "configs": {}}
    with tempfile.TemporaryDirectory(prefix="kc-b12x-") as tmp:
        for experts in args.experts:
            serial_wall, serial, _ = warm(Path(tmp), experts, 1)
            parallel_wall, parallel, generation = warm(Path(tmp), experts, args.workers)
            assert sorted(serial["kernels"]) == sorted(parallel["kernels"])
            served = serve(generation, experts, Path(tmp))
            loads = sorted(k["ms"] for k in served["loaded"])
            row = {
                "kernels": len(parallel["kernels"]),
                "direct_micro": len(parallel["direct_micro"]),
                "files": parallel["files"],
                "bytes": parallel["bytes"],
                "serial_warm_seconds": serial_wall,
                "parallel_warm_seconds": parallel_wall,
                "workers": parallel["workers"],
                "kernel_compile_seconds": serial["compile_seconds"],
                "serve_compiles": served["compiles"],
                "serve_builds": served["builds"],
                "load_ms": loads,
                "direct_micro_hits": served["cache_hits"],
            }
            results["configs"][f"E={experts}"] = row
            print(
                f"E={experts}: {row['kernels']} kernels + {row['direct_micro']} direct micro, "
                f"{row['bytes'] / 1e6:.1f} MB; warm serial {serial_wall:.1f} s, "
                f"{row['workers']} workers {parallel_wall:.1f} s; serve: "
                f"{len(served['builds'])} builds, loads {loads[0]:.1f}-{loads[-1]:.1f} ms "
                f"(median {loads[len(loads) // 2]:.1f})",
                flush=True,
            )
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
