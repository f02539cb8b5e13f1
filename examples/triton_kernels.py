"""Example Triton kernel: an autotuned matmul, warmed ahead of time by kernelcache's triton warmer.

The matmul is tuned over eight tile configs per (M, N, K). Cold, a process pays for compiling
every config and benchmarking them on its first call of each shape; with the binaries cached
it still benchmarks; with the autotune results cached too it only loads the chosen kernel.
``warm(workload)`` is the entry point named in ``examples/serving-stack.yaml``.

``main()`` plays the serving process. Pointed at a generation's Triton cache it must compile
nothing and benchmark nothing; it exits 0 only then:

    TRITON_CACHE_DIR=<generation>/files/triton TRITON_CACHE_AUTOTUNING=1 \\
    TRITON_CACHE_MANAGER=kernelcache.toolchains.triton:GenerationCacheManager \\
        python examples/triton_kernels.py --workload '{"shapes": [[512, 512, 512]]}'

(Stock Triton looks for a kernel's files where they were first written, so a moved cache
needs kernelcache's cache manager.)

Needs a CUDA GPU: Triton compiles for the GPU it runs on.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_WORKLOAD = {"shapes": [[512, 512, 512], [1024, 1024, 1024]], "dtypes": ["float16"]}

CONFIGS = [
    triton.Config(
        {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w
    )
    for m, n, k, s, w in [
        (128, 256, 64, 3, 8),
        (64, 256, 32, 4, 4),
        (128, 128, 32, 4, 4),
        (128, 64, 32, 4, 4),
        (64, 128, 32, 4, 4),
        (128, 32, 32, 4, 4),
        (64, 32, 32, 5, 2),
        (32, 64, 32, 5, 2),
    ]
]

# Configs benchmarked in this process: anything above zero in serving means re-tuning.
benchmarked = 0


def _bench(kernel_call: Any, quantiles: Any) -> Any:
    """Triton's own benchmark, counted."""
    global benchmarked
    benchmarked += 1
    return triton.testing.do_bench(kernel_call, quantiles=quantiles)


# Triton >= 3.4 can keep the chosen config next to the binaries (TRITON_CACHE_AUTOTUNING=1
# turns it on for every kernel; this turns it on for this one).
_CACHE_RESULTS = (
    {"cache_results": True}
    if "cache_results" in inspect.signature(triton.autotune).parameters
    else {}
)


@triton.autotune(configs=CONFIGS, key=["M", "N", "K"], do_bench=_bench, **_CACHE_RESULTS)
@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """C = A @ B with fp32 accumulation; tiles grouped along M for L2 reuse."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % group_m
    pid_n = (pid % group_size) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    (m, k), (_, n) = a.shape, b.shape
    c = torch.empty((m, n), device=a.device, dtype=a.dtype)

    def grid(meta: Mapping[str, Any]) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    matmul_kernel[grid](
        a, b, c, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
    )  # fmt: skip
    return c


def warm(workload: Mapping[str, Any]) -> list[str]:
    """The warm-up entry point: tune and run every shape and dtype, checked against torch."""
    names = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype_name in workload.get("dtypes", ["float16"]):
        dtype = DTYPES[dtype_name]
        for m, n, k in workload.get("shapes", DEFAULT_WORKLOAD["shapes"]):
            a = torch.randn((m, k), device="cuda", dtype=dtype, generator=gen)
            b = torch.randn((k, n), device="cuda", dtype=dtype, generator=gen)
            torch.testing.assert_close(matmul(a, b), a @ b, atol=0.5, rtol=2e-2)
            names.append(f"matmul_kernel[{dtype_name},{m}x{n}x{k}]")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        default=json.dumps(DEFAULT_WORKLOAD),
        help="workload JSON (the spec's warmer workload)",
    )
    args = parser.parse_args(argv)
    from triton import knobs  # Triton >= 3.4

    compiled: list[str] = []

    def listener(*, src: Any, cache_hit: bool, **_: Any) -> None:
        if not cache_hit:  # a disk-cache hit is a load, not a compile
            compiled.append(src.name)

    knobs.compilation.listener = listener
    start = time.perf_counter()
    names = warm(json.loads(args.workload))
    seconds = time.perf_counter() - start
    print(
        f"{len(names)} matmuls ready in {seconds:.3f} s from {knobs.cache.dir}: "
        f"{len(compiled)} compiled, {benchmarked} configs benchmarked"
    )
    return 0 if not compiled and not benchmarked else 1


if __name__ == "__main__":
    sys.exit(main())
