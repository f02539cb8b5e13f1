"""A Hopper tensor-core GEMM in CuTe-DSL (TMA loads, WGMMA), the CuTe kernel of the serving
cold-start benchmark on an H200.

C[M, N] = A[M, K] @ B[N, K]^T, bf16 in, fp32 accumulate, bf16 out, both inputs K-major (how a
linear layer's weight is stored). Each CTA computes a (128, 128) tile of C: one producer warp
issues TMA copies of (128, 64) tiles of A and B into a 4-stage shared-memory ring guarded by
mbarriers, one consumer warpgroup multiplies them with WGMMA and writes its accumulators to
C. This is the shape of the GEMMs serving engines ship for Hopper (theirs add warp
specialization across consumers, clusters and a TMA-store epilogue, and compile for longer);
this one compiles in about 0.4 s per shape on the H200's host. sm_90a only; it compiles on
any machine (``CUTE_DSL_ARCH``). M and N must be multiples of 128 and K of 64.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor
from cutlass.utils import LayoutEnum

TILE = (128, 128, 64)  # (M, N, K) per CTA and per pipeline stage
STAGES = 4
MMA_THREADS = 128  # one consumer warpgroup
PRODUCER_WARP = MMA_THREADS // 32  # the warp after it issues the TMA copies
THREADS = MMA_THREADS + 32


@cute.jit
def gemm(m_a: cute.Tensor, m_b: cute.Tensor, m_c: cute.Tensor):
    """Host side: the tiled MMA, the staged shared-memory layouts, the TMA descriptors, launch."""
    tiled_mma = sm90.make_trivial_tiled_mma(
        m_a.element_type,
        m_b.element_type,
        LayoutEnum.from_tensor(m_a).sm90_mma_major_mode(),
        LayoutEnum.from_tensor(m_b).sm90_mma_major_mode(),
        cutlass.Float32,
        (1, 1, 1),
        (64, TILE[1]),
    )
    a_layout = sm90.make_smem_layout_a(LayoutEnum.from_tensor(m_a), TILE, m_a.element_type, STAGES)
    b_layout = sm90.make_smem_layout_b(LayoutEnum.from_tensor(m_b), TILE, m_b.element_type, STAGES)
    tma_a, tma_tensor_a = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(),
        m_a,
        cute.slice_(a_layout, (None, None, 0)),
        (TILE[0], TILE[2]),
    )
    tma_b, tma_tensor_b = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(),
        m_b,
        cute.slice_(b_layout, (None, None, 0)),
        (TILE[1], TILE[2]),
    )

    @cute.struct
    class Shared:
        barriers: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
        s_a: cute.struct.Align[cute.struct.MemRange[m_a.element_type, cute.cosize(a_layout)], 1024]
        s_b: cute.struct.Align[cute.struct.MemRange[m_b.element_type, cute.cosize(b_layout)], 1024]

    # What one stage's two TMA copies write, which completes that stage's barrier.
    stage_bytes = cute.size_in_bytes(
        m_a.element_type, cute.slice_(a_layout, (None, None, 0))
    ) + cute.size_in_bytes(m_b.element_type, cute.slice_(b_layout, (None, None, 0)))
    m, n = m_c.shape
    gemm_kernel(
        tma_a,
        tma_tensor_a,
        tma_b,
        tma_tensor_b,
        m_c,
        tiled_mma,
        a_layout,
        b_layout,
        Shared,
        stage_bytes,
    ).launch(
        grid=(m // TILE[0], n // TILE[1], 1),
        block=(THREADS, 1, 1),
        smem=Shared.size_in_bytes(),
    )


@cute.kernel
def gemm_kernel(
    tma_a: cute.CopyAtom,
    m_a: cute.Tensor,
    tma_b: cute.CopyAtom,
    m_b: cute.Tensor,
    m_c: cute.Tensor,
    tiled_mma: cute.TiledMma,
    a_layout: cute.ComposedLayout,
    b_layout: cute.ComposedLayout,
    shared: cutlass.Constexpr,
    stage_bytes: cutlass.Constexpr,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, bidy, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp == PRODUCER_WARP:
        cpasync.prefetch_descriptor(tma_a)
        cpasync.prefetch_descriptor(tma_b)

    storage = cutlass.utils.SmemAllocator().allocate(shared)
    ring = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.barriers.data_ptr(),
        num_stages=STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        # one release per consumer warp
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_THREADS // 32),
        tx_count=stage_bytes,
        cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
    )
    s_a = storage.s_a.get_tensor(a_layout.outer, swizzle=a_layout.inner)
    s_b = storage.s_b.get_tensor(b_layout.outer, swizzle=b_layout.inner)

    # This CTA's tiles: (128, 64, k_tiles) of A and B, (128, 128) of C.
    g_a = cute.local_tile(m_a, (TILE[0], TILE[2]), (bidx, None))
    g_b = cute.local_tile(m_b, (TILE[1], TILE[2]), (bidy, None))
    g_c = cute.local_tile(m_c, (TILE[0], TILE[1]), (bidx, bidy))
    k_tiles = cute.size(g_a, mode=[2])

    if warp == PRODUCER_WARP:
        t_sa, t_ga = cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(s_a, 0, 2), cute.group_modes(g_a, 0, 2)
        )
        t_sb, t_gb = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(s_b, 0, 2), cute.group_modes(g_b, 0, 2)
        )
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        for k in cutlass.range(k_tiles, unroll=1):
            ring.producer_acquire(state)
            full = ring.producer_get_barrier(state)
            cute.copy(tma_a, t_ga[(None, k)], t_sa[(None, state.index)], tma_bar_ptr=full)
            cute.copy(tma_b, t_gb[(None, k)], t_sb[(None, state.index)], tma_bar_ptr=full)
            ring.producer_commit(state)
            state.advance()

    if tidx < MMA_THREADS:
        thr_mma = tiled_mma.get_slice(tidx)
        frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
        frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
        t_gc = thr_mma.partition_C(g_c)
        acc = cute.make_rmem_tensor(t_gc.shape, cutlass.Float32)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        for _ in cutlass.range(k_tiles, unroll=1):
            ring.consumer_wait(state)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(frag_a, mode=[2])):
                cute.gemm(
                    tiled_mma,
                    acc,
                    frag_a[(None, None, kb, state.index)],
                    frag_b[(None, None, kb, state.index)],
                    acc,
                )
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            ring.consumer_release(state)
            state.advance()
        t_gc.store(acc.load().to(m_c.element_type))


def specializations(workload: Mapping[str, Any]) -> Iterator[tuple[str, Any, tuple]]:
    """One GEMM per (M, N, K) of the workload: A (M, K), B (N, K), C (M, N), bf16, K-major."""
    for m, n, k in workload.get("shapes", [[2048, 2048, 2048]]):

        def fake(rows: int, cols: int) -> Any:
            return make_fake_compact_tensor(
                cutlass.BFloat16, (rows, cols), stride_order=(1, 0), assumed_align=16
            )

        yield f"hopper_gemm[{m}x{n}x{k}]", gemm, (fake(m, k), fake(n, k), fake(m, n))


def warm(workload: Mapping[str, Any]) -> list[str]:
    """The warm-up entry point: compile every GEMM shape; returns their names."""
    names = []
    for name, fn, args in specializations(workload):
        cute.compile(fn, *args)
        names.append(name)
    return names
