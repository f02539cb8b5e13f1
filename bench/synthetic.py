"""A synthetic generation with a realistic file-size mix, for the verify benchmarks.

~85% of the bytes in 2-24 MB modules (FlashInfer ``.so``, Triton cubins), the rest in
4-256 KB kernels and metadata (CuTe-DSL ``.o``/``.json``, Triton ``.json``), laid out as the
toolchains lay them out: one subtree per toolchain under ``files/``.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from kernelcache.store import Store, verify


def make_files(root: Path, size_mb: int, seed: int = 11) -> tuple[int, int]:
    """Write about ``size_mb`` MB of files under ``root``; returns (files, bytes)."""
    rng = random.Random(seed)
    total, count, budget = 0, 0, size_mb << 20
    noise = rng.randbytes(1 << 20)
    while total < budget:
        if rng.random() < 0.08:
            size = rng.randint(2 << 20, 24 << 20)
            rel = rng.choice(
                [f"flashinfer/aot/mod{count}/mod{count}.so", f"triton/{count:06x}/kernel.cubin"]
            )
        else:
            size = rng.randint(4 << 10, 256 << 10)
            rel = rng.choice(
                [f"cute-dsl/k{count:05d}.o", f"cute-dsl/k{count:05d}.json", f"triton/t{count}.json"]
            )
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        offset = rng.randrange(1 << 19)
        path.write_bytes((noise * (size // len(noise) + 2))[offset : offset + size])
        total += size
        count += 1
    return count, total


def publish_generation(work: Path, key: str, size_mb: int) -> tuple[Path, int, int]:
    """Publish a synthetic generation in a store under ``work``: (generation dir, files, bytes).

    The generation is verified once, which also reads every file into the page cache.
    """
    src = work / "src"
    count, total = make_files(src, size_mb)
    store = Store(work / "store")
    with store.writer(key) as writer:
        staging = writer.staging()
        shutil.rmtree(staging)
        shutil.move(str(src), staging)
        writer.publish(staging, {"digest": "blake3:" + "0" * 64, "factors": {}}, {})
    gen = store.current(key)
    assert gen is not None and verify(gen).ok
    return gen, count, total
