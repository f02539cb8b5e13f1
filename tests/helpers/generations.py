"""Generations published straight through the store writer, stamped for an H200 node: what
the init-container and least-privilege tests verify and refuse."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import publish_files

from kernelcache import stamp as stamps
from kernelcache.store import Store

NS, NAME, ARCH = "ns", "demo", "sm_90a"

KEY = f"{NS}/{NAME}/{ARCH}"

PRODUCT = "NVIDIA H200"  # as nvidia-smi names it, and the build stamped it

IMAGE = "registry.example/vllm:0.9.0@sha256:" + "ab" * 32

COMPILED = {
    "cute-dsl/gemm_128x256.o": b"\x7fELF" + bytes(range(256)) * 40,
    "cute-dsl/gemm_128x256.json": b'{"prefix": "gemm"}',
    "triton/k3x/matmul.cubin": b"\x7fELF" + bytes(3000),
}

TUNING = {
    "triton/k3x/matmul.autotune.json": b'{"BLOCK_M": 128}',
    "flashinfer/tactics/nvidia-h200.json": b'{"_metadata": {"gpu": "NVIDIA H200"}}',
}


def make_stamp(**factor_changes: str) -> dict:
    stamp = stamps.collect(
        arch=ARCH,
        gpu_product=PRODUCT,
        distributions=["blake3"],
        extra={"engine_image": IMAGE, "model": "example/model"},
    )
    return stamps.Stamp({**stamp.factors, **factor_changes}).to_dict()


def publish(
    root: Path,
    key: str = KEY,
    files: dict[str, bytes] | None = None,
    stamp: dict | None = None,
    signing_key: Path | None = None,
) -> Path:
    """Publish files as the key's current generation; returns its directory."""
    store = Store(root)
    files = files if files is not None else {**COMPILED, **TUNING}
    publish_files(
        store, key, files, stamp or make_stamp(), {"warmers": []}, signing_key=signing_key
    )
    gen = store.current(key)
    assert gen is not None
    return gen
