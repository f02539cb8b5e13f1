"""Compile vs load for the example CuTe-DSL kernels, each side in a fresh process.

A cold process compiles every specialization of ``examples/demo_kernels.py`` through the
disk layer (miss: compile + export); a second fresh process gets the same kernels from the
cache (hit: ``load_module`` + lookup). With ``--gpu`` each kernel is also launched on real
tensors and its result checked against torch, so "ready" means a correct first result.

    python bench/cute_compile_vs_load.py [--arch sm_90a] [--gpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = {
    "sizes": [[128, 256], [1024, 1024]],
    "dtypes": ["float32", "float16"],
    "tiles": [[32, 32], [64, 64]],
}


def child(phase: str, gpu: bool) -> None:
    """One fresh process: time each kernel through the disk layer, optionally launch it."""
    sys.path.insert(0, str(REPO / "examples"))
    start = time.perf_counter()
    import demo_kernels

    from kernelcache.runtime import cute as cute_cache

    imported = time.perf_counter() - start
    cache = cute_cache.default_cache()
    rows = []
    for name, fn, args in demo_kernels.specializations(WORKLOAD):
        t0 = time.perf_counter()
        compiled = cache.compile(fn, *args)
        ready = time.perf_counter() - t0
        row = {"kernel": name, "seconds": ready}
        if gpu:
            t1 = time.perf_counter()
            row["correct"] = launch_and_check(compiled, name, args)
            row["first_launch_seconds"] = time.perf_counter() - t1
        rows.append(row)
    print(
        json.dumps(
            {
                "phase": phase,
                "import_seconds": imported,
                "rows": rows,
                "hits": cache.stats.hits,
                "misses": cache.stats.misses,
                "process_seconds": time.perf_counter() - start,
            }
        )
    )


def launch_and_check(compiled, name: str, args) -> bool | str:
    """Run the kernel on CUDA tensors shaped like the fake ones; compare with torch.

    Returns True/False for a correct/incorrect result, or the error text if it did not run.
    """
    import torch
    from cutlass.cute.runtime import from_dlpack

    fake = args[0]
    dtype = {"Float32": torch.float32, "Float16": torch.float16}[fake.element_type.__name__]
    m, n = fake.shape
    a = torch.randn(m, n, device="cuda", dtype=dtype)
    b = torch.randn(m, n, device="cuda", dtype=dtype)
    out = torch.zeros_like(a)
    ta, tb, tout = (from_dlpack(t, assumed_align=16) for t in (a, b, out))
    try:
        if name.startswith("add"):
            compiled(ta, tb, tout)
            expected = a + b
        else:
            compiled(ta, tout, 2.0)
            expected = a * 2
        torch.cuda.synchronize()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return bool(torch.allclose(out, expected, atol=1e-2, rtol=1e-2))


def machine() -> str:
    """CPU model and count, and the GPU when torch sees one."""
    cpu = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    text = f"{cpu} x{os.cpu_count()}"
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            text += f", {torch.cuda.get_device_name()} (torch {torch.__version__})"
    return text


def run_phase(phase: str, cache: Path, arch: str, gpu: bool) -> dict:
    env = dict(os.environ, KERNELCACHE_CUTE_DSL_DIR=str(cache), CUTE_DSL_ARCH=arch)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--child", phase] + (["--gpu"] if gpu else [])
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["wall_seconds"] = time.perf_counter() - t0
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--gpu", action="store_true", help="launch each kernel and check vs torch")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.gpu)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cold = run_phase("cold", Path(tmp), args.arch, args.gpu)
        warm = run_phase("warm", Path(tmp), args.arch, args.gpu)
    assert warm["misses"] == 0, "the warm process compiled"
    print(f"machine: {machine()}, target arch {args.arch}")
    print(f"{'kernel':44} {'compile s':>10} {'load s':>10} {'ratio':>8}")
    for c, w in zip(cold["rows"], warm["rows"], strict=True):
        print(
            f"{c['kernel']:44} {c['seconds']:10.4f} {w['seconds']:10.4f} "
            f"{c['seconds'] / w['seconds']:7.0f}x"
            + (f"  correct: cold={c['correct']} warm={w['correct']}" if args.gpu else "")
        )
    total_c = sum(r["seconds"] for r in cold["rows"])
    total_w = sum(r["seconds"] for r in warm["rows"])
    print(f"{'all kernels':44} {total_c:10.3f} {total_w:10.4f} {total_c / total_w:7.0f}x")
    print(f"whole process: cold {cold['wall_seconds']:.2f} s, warm {warm['wall_seconds']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps({"arch": args.arch, "cold": cold, "warm": warm}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
