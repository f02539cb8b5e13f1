"""What keying a CuTe-DSL kernel by its traced IR costs a serving process, per kernel.

Every lookup of the disk layer traces the kernel (the DSL's front end, up to its
trace-finalize hook), prints the traced module without locations and hashes it; a hit then
loads the object. This measures, each side in fresh processes:

- cold: a miss per kernel, compile and export (the trace is part of it, reported apart);
- serve: strict hits, ``--runs`` fresh processes; per kernel the trace (the call to its key),
  the part of it that is kernelcache's own keying (printing, hashing, the factors: the
  pipeline built and normalised, its functions checked) and the load. A strict lookup is the
  trace and the key (``serve_lookup_ms``: the spread over every lookup after a process's
  first is reported beside the median).

The example kernels of ``examples/demo_kernels.py`` always; the Hopper TMA/WGMMA GEMM of
``examples/hopper_gemm.py`` too when a GPU is visible or with ``--hopper`` (sm_90a only).
``--profile`` adds where a serve process's trace time goes (by the DSL functions spanning each
phase, under cProfile: use its figures as shares, not as times). Prints JSON.

    python bench/cute_trace_cost.py [--arch sm_90a] [--runs 3] [--hopper] [--profile]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEMO = {"sizes": [[128, 256], [1024, 1024]], "dtypes": ["float32", "float16"],
        "tiles": [[32, 32], [64, 64]]}  # fmt: skip
HOPPER = {"shapes": [[2048, 2048, 2048], [4096, 4096, 4096], [1024, 8192, 2048]]}


def child(phase: str, root: str, hopper: bool, profile: bool) -> None:
    """One fresh process: every kernel through the disk layer at ``root``."""
    sys.path.insert(0, str(REPO / "examples"))
    start = time.perf_counter()
    import demo_kernels

    from kernelcache.runtime import cute as layer

    kernels = list(demo_kernels.specializations(DEMO))
    if hopper:
        import hopper_gemm

        kernels += list(hopper_gemm.specializations(HOPPER))
    imported = time.perf_counter() - start
    keying = [0.0]
    of = layer.Traced.of

    def timed_of(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return of(*args)
        finally:
            keying[0] += time.perf_counter() - t0

    layer.Traced.of = timed_of
    cache = layer.CuteDiskCache(root, strict=phase == "serve")
    profiler = None
    if profile and phase == "serve":
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    rows = []
    for name, fn, args in kernels:
        before = (cache.stats.trace_seconds, cache.stats.load_seconds, keying[0])
        t0 = time.perf_counter()
        cache.compile(fn, *args)
        total = time.perf_counter() - t0
        trace = cache.stats.trace_seconds - before[0]
        rows.append(
            {
                "kernel": name,
                "total_s": total,
                "trace_s": trace,
                "keying_s": keying[0] - before[2],
                "load_s": cache.stats.load_seconds - before[1],
                "compile_s": total - trace if phase == "cold" else 0.0,
            }
        )
    report: dict[str, Any] = {
        "phase": phase,
        "import_s": imported,
        "rows": rows,
        "hits": cache.stats.hits,
        "misses": cache.stats.misses,
    }
    if profiler is not None:
        profiler.disable()
        report["profile"] = {k: v / len(rows) for k, v in _phases(profiler).items()}
    print(json.dumps(report))


# Where a lookup's trace goes, by the DSL function (nvidia-cutlass-dsl 4.8) that spans it.
PHASES = {
    "preprocess (AST rewrite of the jit function)": "_preprocess_and_replace_code",
    "arguments to MLIR types": "generate_mlir_function_types",
    "MLIR context and module set-up": "generate_mlir",
    "tracing the function body (building the ops)": "build_ir_module",
    "kernelcache keying (print without locations, hash, factors)": "of",
    "load_module (a hit)": "load_module",
}


def _phases(profiler: Any) -> dict[str, float]:
    """Seconds per kernel spent under each of ``PHASES`` (cumulative, so nested phases
    overlap: the set-up is ``generate_mlir`` less the phases inside it)."""
    import pstats

    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    spans: dict[str, float] = {}
    for (file, _, name), (_, _, _, cumulative, _) in stats.items():
        for label, function in PHASES.items():
            if name == function and ("cutlass" in file or "kernelcache" in file):
                spans[label] = spans.get(label, 0.0) + cumulative
    return spans


def run(phase: str, root: Path, arch: str, hopper: bool, profile: bool) -> dict[str, Any]:
    env = {**os.environ, "CUTE_DSL_ARCH": arch}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, "--child", phase, "--root", str(root)]
    cmd += ["--hopper"] * hopper + ["--profile"] * profile
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"{phase} process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gpu_name() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else None


def summary(cold: dict[str, Any], serves: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kernel: the cold compile, and the median over serve runs of trace, keying, load."""
    kernels = []
    for index, row in enumerate(cold["rows"]):
        served = [s["rows"][index] for s in serves]

        def median(field: str, rows: list[dict[str, Any]] = served) -> float:
            return round(statistics.median(r[field] for r in rows) * 1000, 3)

        kernels.append(
            {
                "kernel": row["kernel"],
                "cold_compile_ms": round(row["compile_s"] * 1000, 3),
                "cold_trace_ms": round(row["trace_s"] * 1000, 3),
                "serve_trace_ms": median("trace_s"),
                "serve_keying_ms": median("keying_s"),
                "serve_load_ms": median("load_s"),
                "serve_total_ms": median("total_s"),
                "serve_lookup_ms": median("trace_s"),
            }
        )
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--runs", type=int, default=3, help="fresh serving processes")
    parser.add_argument("--hopper", action="store_true", help="the Hopper GEMM without a GPU")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.root, args.hopper, args.profile)
        return
    gpu = gpu_name()
    hopper = (args.hopper or gpu is not None) and args.arch == "sm_90a"
    with tempfile.TemporaryDirectory(prefix="kc-trace-cost-") as tmp:
        root = Path(tmp) / "cute-dsl"
        cold = run("cold", root, args.arch, hopper, False)
        serves = [run("serve", root, args.arch, hopper, args.profile) for _ in range(args.runs)]
    if any(s["misses"] or s["hits"] != len(cold["rows"]) for s in serves):
        sys.exit("a serving process did not load every kernel from the cache")
    kernels = summary(cold, serves)
    traces = [k["serve_trace_ms"] for k in kernels[1:]] or [kernels[0]["serve_trace_ms"]]
    lookups = [r["trace_s"] * 1000 for s in serves for r in s["rows"][1:]] or traces
    report = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "gpu": gpu, "python": platform.python_version()},
        "arch": args.arch,
        "runs": args.runs,
        "kernels": kernels,
        "serve_import_ms": round(statistics.median(s["import_s"] for s in serves) * 1000, 1),
        "median": {
            "cold_compile_ms": statistics.median(k["cold_compile_ms"] for k in kernels),
            "serve_trace_ms_after_first": statistics.median(traces),
            "serve_lookup_ms_range_after_first": [round(min(lookups), 1), round(max(lookups), 1)],
            "serve_first_trace_ms": kernels[0]["serve_trace_ms"],
            "serve_keying_ms": statistics.median(k["serve_keying_ms"] for k in kernels),
            "serve_load_ms": statistics.median(k["serve_load_ms"] for k in kernels),
        },
    }  # fmt: skip
    if args.profile:
        report["profile_ms_per_kernel"] = {
            k: round(statistics.median(s["profile"].get(k, 0.0) for s in serves) * 1000, 2)
            for k in PHASES
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
