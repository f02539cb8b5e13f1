"""Example CuTe-DSL kernels: what a serving engine compiles, warmed ahead of time by kernelcache.

Two kernels with several specializations each: an elementwise add (one per shape and dtype)
and a tiled scale whose tile shape is a compile-time constant (one per shape, dtype and tile).
``warm(workload)`` is the entry point named in ``examples/kernelcache.yaml``; it calls plain
``cute.compile``, which the cute-dsl warmer routes through kernelcache's disk layer.

``demo_serve.py`` plays the serving process that loads them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor

DTYPES = {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}
THREADS = 128


@cute.kernel
def add_kernel(g_a: cute.Tensor, g_b: cute.Tensor, g_c: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * THREADS + tidx
    m, n = g_a.shape
    if i < m * n:
        g_c[i // n, i % n] = g_a[i // n, i % n] + g_b[i // n, i % n]


@cute.jit
def add(m_a: cute.Tensor, m_b: cute.Tensor, m_c: cute.Tensor):
    m, n = m_a.shape
    add_kernel(m_a, m_b, m_c).launch(
        grid=((m * n + THREADS - 1) // THREADS, 1, 1), block=(THREADS, 1, 1)
    )


@cute.kernel
def scale_tile_kernel(
    g_a: cute.Tensor,
    g_b: cute.Tensor,
    alpha: cutlass.Float32,
    tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, bidy, _ = cute.arch.block_idx()
    t_a = cute.local_tile(g_a, (tile_m, tile_n), (bidx, bidy))
    t_b = cute.local_tile(g_b, (tile_m, tile_n), (bidx, bidy))
    for i in range(tidx, tile_m * tile_n, THREADS):
        t_b[i // tile_n, i % tile_n] = t_a[i // tile_n, i % tile_n] * alpha.to(g_a.element_type)


@cute.jit
def scale_tiled(
    m_a: cute.Tensor,
    m_b: cute.Tensor,
    alpha: cutlass.Float32,
    tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
):
    m, n = m_a.shape
    scale_tile_kernel(m_a, m_b, alpha, tile_m, tile_n).launch(
        grid=(m // tile_m, n // tile_n, 1), block=(THREADS, 1, 1)
    )


def specializations(workload: Mapping[str, Any]) -> Iterator[tuple[str, Any, tuple]]:
    """Every (name, jit function, compile arguments) the workload needs, in a stable order."""
    for dtype_name in workload.get("dtypes", ["float32"]):
        dtype = DTYPES[dtype_name]
        for m, n in workload.get("sizes", [[128, 128]]):
            t = make_fake_compact_tensor(dtype, (m, n), stride_order=(1, 0), assumed_align=16)
            yield f"add[{dtype_name},{m}x{n}]", add, (t, t, t)
            for tm, tn in workload.get("tiles", [[32, 32]]):
                if m % tm == 0 and n % tn == 0:
                    name = f"scale_tiled[{dtype_name},{m}x{n},tile={tm}x{tn}]"
                    yield name, scale_tiled, (t, t, cutlass.Float32(1.0), tm, tn)


def warm(workload: Mapping[str, Any]) -> list[str]:
    """The warm-up entry point: compile every specialization; returns their names."""
    names = []
    for name, fn, args in specializations(workload):
        cute.compile(fn, *args)
        names.append(name)
    return names
