"""A register-blocked SIMT GEMM in CuTe-DSL, the CuTe kernel of the serving cold-start benchmark.

C[M, N] = A[M, K] @ B[K, N], fp32, row-major. Each CTA stages a (BM, BK) tile of A and a
(BK, BN) tile of B in shared memory and each thread accumulates a (TM, TN) block of C in
registers; the unrolled inner loops make the compile cost realistic (about half a second),
which is what a serving process pays per shape without a cache. M and N must be multiples of
64 and K of 16.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor

BM, BN, BK = 64, 64, 16
TM, TN = 4, 4
THREADS = (BM // TM) * (BN // TN)


@cute.kernel
def gemm_kernel(g_a: cute.Tensor, g_b: cute.Tensor, g_c: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, bidy, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    s_a = smem.allocate_tensor(cutlass.Float32, cute.make_layout((BM, BK), stride=(BK, 1)), 16)
    s_b = smem.allocate_tensor(cutlass.Float32, cute.make_layout((BK, BN), stride=(BN, 1)), 16)
    acc = cute.make_rmem_tensor(cute.make_layout((TM, TN), stride=(TN, 1)), cutlass.Float32)
    acc.fill(0.0)
    row0 = (tidx // (BN // TN)) * TM
    col0 = (tidx % (BN // TN)) * TN
    for k0 in range(0, g_a.shape[1], BK):
        for i in range(tidx, BM * BK, THREADS):
            s_a[i // BK, i % BK] = g_a[bidx * BM + i // BK, k0 + i % BK]
        for i in range(tidx, BK * BN, THREADS):
            s_b[i // BN, i % BN] = g_b[k0 + i // BN, bidy * BN + i % BN]
        cute.arch.sync_threads()
        for kk in cutlass.range_constexpr(BK):
            for r in cutlass.range_constexpr(TM):
                for c in cutlass.range_constexpr(TN):
                    acc[r, c] = acc[r, c] + s_a[row0 + r, kk] * s_b[kk, col0 + c]
        cute.arch.sync_threads()
    for r in cutlass.range_constexpr(TM):
        for c in cutlass.range_constexpr(TN):
            g_c[bidx * BM + row0 + r, bidy * BN + col0 + c] = acc[r, c]


@cute.jit
def gemm(m_a: cute.Tensor, m_b: cute.Tensor, m_c: cute.Tensor):
    m, n = m_c.shape
    gemm_kernel(m_a, m_b, m_c).launch(grid=(m // BM, n // BN, 1), block=(THREADS, 1, 1))


def specializations(workload: Mapping[str, Any]) -> Iterator[tuple[str, Any, tuple]]:
    """One GEMM per (M, N, K) of the workload."""
    for m, n, k in workload.get("shapes", [[1024, 1024, 1024]]):

        def fake(rows: int, cols: int) -> Any:
            return make_fake_compact_tensor(
                cutlass.Float32, (rows, cols), stride_order=(1, 0), assumed_align=16
            )

        yield f"gemm[{m}x{n}x{k}]", gemm, (fake(m, k), fake(k, n), fake(m, n))


def warm(workload: Mapping[str, Any]) -> list[str]:
    """The warm-up entry point: compile every GEMM shape; returns their names."""
    names = []
    for name, fn, args in specializations(workload):
        cute.compile(fn, *args)
        names.append(name)
    return names
