"""Serving cold start: fresh processes with and without a warmed generation, per toolchain.

For the four GEMMs of a transformer block as Hopper CuTe-DSL kernels (TMA + WGMMA), a Triton
matmul autotuned over 8 configs and a torch.compile max-autotune transformer block, each on a
GPU:

1. ``kernelcache warm`` builds a generation with that toolchain's warmer and
   ``kernelcache verify --materialize`` copies it out, as the init-container would;
2. a cold fresh process (empty caches) and a warm one (``KERNELCACHE_DIR`` = the materialized
   generation, ``kernelcache.runtime.install()``) each run the same code to a first result
   checked against torch, counted by the runtime's compile metrics.

Reported per toolchain: kernel-ready seconds (the first call to its synchronized result: the
compile or load and the autotune or its saved result that a first request waits for), the
runtime's once-per-process ``install()`` seconds, compile events counted by the runtime, and
the whole process wall time. Targets: zero compile events warm; kernel-ready speed-up >= 100x
for CuTe-DSL, >= 10x for Triton, >= 8x for torch.compile.

    python bench/serving_coldstart.py --json out.json [--plot out.png]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
ARCH = "sm_90a"

CASES: dict[str, dict[str, Any]] = {
    # The four GEMMs of the torch case's transformer block (8 x 512 tokens, hidden 1024,
    # MLP 4096) as linear layers: QKV, attention out, MLP up, MLP down; one kernel per shape.
    "cute-dsl": {
        "entry": "hopper_gemm:warm",
        "workload": {
            "shapes": [
                [4096, 3072, 1024],
                [4096, 1024, 1024],
                [4096, 4096, 1024],
                [4096, 1024, 4096],
            ]
        },
    },
    "triton": {
        "entry": "triton_kernels:warm",
        "workload": {"shapes": [[2048, 2048, 2048]], "dtypes": ["float16"]},
    },
    "torch-compile": {
        "entry": "torch_models:warm",
        "workload": {
            "model": "block",
            "batch_sizes": [8],
            "seq": 512,
            "features": 1024,
            "hidden": 4096,
            "heads": 8,
            "dtype": "bfloat16",
        },
    },
}
TARGETS = {"cute-dsl": 100.0, "triton": 10.0, "torch-compile": 8.0}


# How often the runtime looks for compiles made by other processes (inductor's workers).
POLL_SECONDS = 0.1


def env_for(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUTE_DSL_ARCH=ARCH)
    env["KERNELCACHE_POLL_S"] = str(POLL_SECONDS)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(EXAMPLES), str(REPO / "src"), env.get("PYTHONPATH", "")]
    )
    env.update(extra)
    return env


def spec_text(toolchain: str) -> str:
    case = CASES[toolchain]
    return json.dumps(
        {
            "apiVersion": "kernelcache.dev/v1alpha1",
            "kind": "KernelCache",
            "metadata": {"name": toolchain.replace("-", ""), "namespace": "bench"},
            "spec": {
                "model": "bench/serving-coldstart",
                "engine": {"image": "bench"},
                "gpuClasses": [{"name": "h200", "arch": ARCH}],
                "warmers": [
                    {
                        "type": toolchain,
                        "entryPoints": [case["entry"]],
                        "workload": case["workload"],
                    }
                ],
            },
        }
    )


def kernelcache(*args: str) -> None:
    cmd = [sys.executable, "-m", "kernelcache", *args]
    proc = subprocess.run(cmd, env=env_for({}), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:1])} failed: {proc.stderr.strip()}")


def build_generation(toolchain: str, work: Path) -> tuple[Path, float]:
    """Warm, publish, verify and materialize one toolchain's generation."""
    spec = work / f"{toolchain}.yaml"
    spec.write_text(spec_text(toolchain))
    store, target = work / "store", work / f"serve-{toolchain}"
    target.mkdir()
    start = time.perf_counter()
    kernelcache("warm", "-f", str(spec), "--store", str(store), "--arch", ARCH)
    built = time.perf_counter() - start
    key = f"bench/{toolchain.replace('-', '')}/{ARCH}"
    kernelcache("verify", "--store", str(store), "--key", key, "--materialize", str(target))
    (generation,) = [p for p in target.iterdir() if p.is_dir()]
    return generation, built


def serve(toolchain: str, generation: Path | None, work: Path) -> dict[str, Any]:
    """One fresh serving process; cold ones get empty cache dirs of their own."""
    if generation is None:
        empty = Path(tempfile.mkdtemp(dir=work, prefix=f"cold-{toolchain}-"))
        extra = {
            "TRITON_CACHE_DIR": str(empty / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(empty / "inductor"),
            "KERNELCACHE_CUTE_DSL_DIR": str(empty / "cute-dsl"),
            "FLASHINFER_WORKSPACE_BASE": str(empty / "flashinfer"),
        }
    else:
        extra = {"KERNELCACHE_DIR": str(generation)}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", toolchain],
        env=env_for(extra),
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{toolchain} serve failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = wall
    result["runtime_log"] = [line for line in proc.stderr.splitlines() if "kernelcache" in line]
    return result


def child(toolchain: str) -> None:
    """The serving process: the runtime's install, then the first call timed to its result.

    Timed first: ``runtime.install()`` (reading and stamp-checking the generation, pointing
    the caches: once per process), before the toolchains are imported, as the runtime asks.
    Then, before the next clock: the CUDA context, cuBLAS, the toolchain's imports, Triton's
    set-up and the inputs (the same with or without a cache). Timed: the first call (compile
    or load, autotune or its saved result, the launch) up to its synchronized result: what
    the first request waits for. It is checked against torch after.
    """
    from kernelcache import runtime
    from kernelcache.runtime import metrics

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the runtime's own account
    start = time.perf_counter()
    runtime.install()
    installed = time.perf_counter()
    import torch

    torch.cuda.init()
    x = torch.ones(64, 64, device="cuda")
    (x @ x).sum().item()
    call, check = FIRST_CALLS[toolchain](CASES[toolchain]["workload"])
    ready = time.perf_counter()
    result = call()
    torch.cuda.synchronize()
    done = time.perf_counter()
    check(result)
    time.sleep(3 * POLL_SECONDS)  # the runtime counts another process's compile a poll late
    counted = metrics.cold_compiles()
    print(
        json.dumps(
            {
                "install_seconds": installed - start,
                "first_call_seconds": done - ready,
                "compile_events": sum(counted.values()),
                "compiled": sorted(f"{toolchain}:{kernel}" for toolchain, kernel in counted),
            }
        )
    )


Call = tuple[Callable[[], Any], Callable[[Any], None]]


def cute_first_call(workload: dict[str, Any]) -> Call:
    """The block's GEMMs through ``cute.compile`` (the disk layer once installed), one launch
    each: the first request through the layer needs every one of them."""
    import cutlass.cute as cute
    import hopper_gemm
    import torch
    from cutlass.cute.runtime import from_dlpack

    gemms = []
    for _, fn, args in hopper_gemm.specializations(workload):
        (m, k), (n, _) = args[0].shape, args[1].shape
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        views = [from_dlpack(t, assumed_align=16) for t in (a, w, c)]
        gemms.append((fn, args, views, (a, w, c)))

    def call() -> Any:
        for fn, args, views, _ in gemms:
            cute.compile(fn, *args)(*views)
        return [tensors for *_, tensors in gemms]

    def check(result: Any) -> None:
        for a, w, c in result:
            torch.testing.assert_close(c, a @ w.T, atol=0.25, rtol=2e-2)

    return call, check


def triton_first_call(workload: dict[str, Any]) -> Call:
    """The autotuned matmul's first call: tune (or read the saved choice), compile or load."""
    import torch
    import triton_kernels

    triton_set_up()
    ((m, n, k),) = workload["shapes"]
    dtype = triton_kernels.DTYPES[workload["dtypes"][0]]
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)

    def check(result: Any) -> None:
        torch.testing.assert_close(result, a @ b, atol=0.5, rtol=2e-2)

    return (lambda: triton_kernels.matmul(a, b)), check


def triton_set_up() -> None:
    """Triton's once-per-process costs, the same with or without a cache: its CUDA driver,
    and the key of its own build (a hash of the 400 MB ``libtriton.so``, taken by the first
    compile or cache lookup in every process)."""
    import triton
    from triton.runtime.cache import triton_key

    triton.runtime.driver.active.get_current_target()
    triton_key()


def torch_first_call(workload: dict[str, Any]) -> Call:
    """torch.compile max-autotune of a transformer block and its first call."""
    import torch
    import torch._inductor.compile_fx  # imported by any compile, cache or not
    import torch_models

    triton_set_up()

    model, dtype = torch_models.model_for(workload, "cuda")
    (batch,) = workload["batch_sizes"]
    x = torch_models.input_for(workload, batch, "cuda")

    def call() -> Any:
        with torch.no_grad():
            return torch_models.compile_model(model, "cuda")(x)

    def check(result: Any) -> None:
        with torch.no_grad():
            torch.testing.assert_close(result, model(x), **torch_models.TOLERANCE[dtype])

    return call, check


FIRST_CALLS: dict[str, Callable[[dict[str, Any]], Call]] = {
    "cute-dsl": cute_first_call,
    "triton": triton_first_call,
    "torch-compile": torch_first_call,
}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    cold = [results[n]["cold"]["first_call_seconds"] for n in names]
    warm = [results[n]["warm"]["first_call_seconds"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], cold, width=0.4, label="cold (no cache)")
    ax.bar([x + 0.2 for x in xs], warm, width=0.4, label="warm (kernelcache generation)")
    ax.set_xticks(list(xs), names)
    ax.set_yscale("log")
    ax.set_ylim(top=max(cold) * 4)  # room for the labels above the tallest bar
    ax.set_ylabel("first call to result, seconds (log)")
    for x, (c, w) in enumerate(zip(cold, warm, strict=True)):
        ax.annotate(f"{c / w:.0f}x", (x, max(c, w)), ha="center", va="bottom")
    ax.legend()
    ax.set_title("Serving cold start on one H200: kernel-ready time per toolchain")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG bar chart here")
    parser.add_argument("--only", action="append", choices=list(CASES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--from-json", type=Path, help="only re-plot saved results")
    parser.add_argument("--workdir", type=Path, help="keep stores and caches here to inspect")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    if args.from_json:
        results = json.loads(args.from_json.read_text())["results"]
    else:
        results = {}
        with contextlib.ExitStack() as stack:
            if args.workdir:
                args.workdir.mkdir(parents=True, exist_ok=True)
            tmp = args.workdir or stack.enter_context(
                tempfile.TemporaryDirectory(prefix="kc-coldstart-")
            )
            for toolchain in args.only or list(CASES):
                generation, built = build_generation(toolchain, Path(tmp))
                cold = serve(toolchain, None, Path(tmp))
                warm = serve(toolchain, generation, Path(tmp))
                results[toolchain] = {"build_seconds": built, "cold": cold, "warm": warm}
                print(f"{toolchain}: {json.dumps(results[toolchain])}", file=sys.stderr, flush=True)
                if args.json:  # after each toolchain, so a cut-short run keeps what it measured
                    args.json.write_text(json.dumps({"arch": ARCH, "results": results}, indent=1))
    print(f"{'toolchain':14} {'cold s':>8} {'warm s':>8} {'speed-up':>9} {'target':>7} "
          f"{'install cold/warm':>20} {'compiles cold/warm':>19} "
          f"{'process cold/warm s':>20}")  # fmt: skip
    for name, r in results.items():
        cold, warm = r["cold"], r["warm"]
        ratio = cold["first_call_seconds"] / warm["first_call_seconds"]
        print(
            f"{name:14} {cold['first_call_seconds']:8.3f} {warm['first_call_seconds']:8.3f} "
            f"{ratio:8.0f}x {TARGETS[name]:6.0f}x "
            f"{cold['install_seconds']:>10.3f}/{warm['install_seconds']:<9.3f} "
            f"{cold['compile_events']:>9.0f}/{warm['compile_events']:<9.0f} "
            f"{cold['wall_seconds']:>9.1f}/{warm['wall_seconds']:<9.1f}"
        )
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
