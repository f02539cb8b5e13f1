"""Example FlashInfer workload: the ops a serving engine calls, warmed ahead of time by kernelcache.

``warm(workload)`` is the flashinfer warmer's entry point. On a GPU of the target arch it calls
FlashInfer's public ops, which JIT-build their modules on first use: single decode and,
with ``batch_decode: true``, the batch decode wrapper's ``plan`` and ``run`` for every head
dim and dtype; ``bmm_fp8`` for every ``[b, m, n, k]`` listed, which the warmer's autotuner
profiles when the workload says ``tune: true``. Without such a GPU it compiles the same decode
modules for the target arch (nvcc needs no GPU); ``bmm_fp8`` needs the GPU and is left out.

    workload: {head_dims: [128], dtypes: [bfloat16], batch_decode: true,
               bmm_fp8: [[1, 128, 256, 512]], tune: true}

``main()`` plays the serving process on a materialized generation: FlashInfer pointed at its
``files/flashinfer`` with JIT disabled, modules from the AOT layout, tactics loaded, and the
build log read back. Exits 0 only when nothing was compiled.

    python examples/flashinfer_ops.py --files <generation>/files --arch sm_90a
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kernelcache.toolchains import flashinfer as fi_cache

DEFAULT_WORKLOAD: dict[str, Any] = {
    "head_dims": [128],
    "dtypes": ["bfloat16"],
    "batch_decode": True,
    "bmm_fp8": [[1, 128, 256, 512]],
}
NUM_QO_HEADS, NUM_KV_HEADS, KV_LEN, PAGE_SIZE, BATCH = 32, 8, 256, 16, 4


def _dtype(name: str) -> Any:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def module_specs(workload: Mapping[str, Any]) -> list[Any]:
    """The JIT specs of the decode modules the workload's ops build, as the ops name them."""
    import torch
    from flashinfer.jit import gen_batch_decode_module, gen_single_decode_module

    specs = []
    for dtype_name in workload.get("dtypes", ["bfloat16"]):
        dtype = _dtype(dtype_name)
        for head_dim in workload.get("head_dims", [128]):
            # posenc NONE, no sliding window, no logits cap: the ops' defaults.
            specs.append(
                gen_single_decode_module(dtype, dtype, dtype, head_dim, head_dim, 0, False, False)
            )
            if workload.get("batch_decode"):
                specs.append(
                    gen_batch_decode_module(
                        dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False
                    )
                )
    return specs


def prebuild(workload: Mapping[str, Any]) -> list[str]:
    """Compile the decode modules for FlashInfer's target arch without loading them."""
    from flashinfer.jit import build_jit_specs

    specs = module_specs(workload)
    build_jit_specs(specs)
    return [spec.name for spec in specs]


def run_ops(workload: Mapping[str, Any]) -> list[str]:
    """Call the workload's ops on the GPU; returns what ran, one name per op and shape."""
    import flashinfer
    import torch

    ran = []
    for dtype_name in workload.get("dtypes", ["bfloat16"]):
        dtype = _dtype(dtype_name)
        for head_dim in workload.get("head_dims", [128]):
            q = torch.randn(NUM_QO_HEADS, head_dim, dtype=dtype, device="cuda")
            k = torch.randn(KV_LEN, NUM_KV_HEADS, head_dim, dtype=dtype, device="cuda")
            flashinfer.single_decode_with_kv_cache(q, k, torch.randn_like(k))
            ran.append(f"single_decode[{dtype_name},hd={head_dim}]")
            if workload.get("batch_decode"):
                _batch_decode(dtype, head_dim)
                ran.append(f"batch_decode[{dtype_name},hd={head_dim}]")
    for b, m, n, k in workload.get("bmm_fp8", []):
        a = torch.randn(b, m, k, device="cuda").to(torch.float8_e4m3fn)
        w = torch.randn(b, n, k, device="cuda").to(torch.float8_e4m3fn).transpose(-2, -1)
        one = torch.ones((), device="cuda")
        flashinfer.bmm_fp8(a, w, one, one, torch.bfloat16)
        ran.append(f"bmm_fp8[{b}x{m}x{n}x{k}]")
    torch.cuda.synchronize()
    return ran


def _batch_decode(dtype: Any, head_dim: int) -> None:
    """A paged batch decode: ``plan`` loads (or builds) the module, ``run`` launches it."""
    import flashinfer
    import torch

    pages_per_seq = KV_LEN // PAGE_SIZE
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    indptr = torch.arange(BATCH + 1, dtype=torch.int32, device="cuda") * pages_per_seq
    indices = torch.arange(BATCH * pages_per_seq, dtype=torch.int32, device="cuda")
    last_page_len = torch.full((BATCH,), PAGE_SIZE, dtype=torch.int32, device="cuda")
    wrapper.plan(
        indptr, indices, last_page_len, NUM_QO_HEADS, NUM_KV_HEADS, head_dim, PAGE_SIZE,
        q_data_type=dtype, kv_data_type=dtype,
    )  # fmt: skip
    kv = torch.randn(
        BATCH * pages_per_seq, 2, PAGE_SIZE, NUM_KV_HEADS, head_dim, dtype=dtype, device="cuda"
    )
    wrapper.run(torch.randn(BATCH, NUM_QO_HEADS, head_dim, dtype=dtype, device="cuda"), kv)


def warm(workload: Mapping[str, Any]) -> list[str]:
    """The warm-up entry point: run the ops where the target GPU is, else compile them."""
    gpu = fi_cache.visible_gpu()
    target = os.environ.get("KERNELCACHE_ARCH")
    if gpu is not None and (target is None or gpu[1].rstrip("af") == target.rstrip("af")):
        return run_ops(workload)
    return prebuild(workload)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", required=True, type=Path, help="a generation's files/ dir")
    parser.add_argument("--arch", required=True, help="the generation's arch, e.g. sm_90a")
    parser.add_argument(
        "--workload", default=json.dumps(DEFAULT_WORKLOAD), help="the spec's warmer workload"
    )
    args = parser.parse_args(argv)
    flashinfer_dir = args.files / fi_cache.SUBDIR
    with tempfile.TemporaryDirectory(prefix="flashinfer-serve-") as tmp:
        log = Path(tmp) / "build-log.jsonl"
        # Before FlashInfer is imported: it reads these at import.
        os.environ.update(fi_cache.serving_env(flashinfer_dir, args.arch))
        os.environ["FLASHINFER_JIT_BUILD_LOG"] = str(log)
        from flashinfer.autotuner import autotune
        from flashinfer.jit import MissingJITCacheError

        fi_cache.use_aot_dir(flashinfer_dir / fi_cache.AOT_SUBDIR)
        gpu = fi_cache.visible_gpu()
        tactics = fi_cache.tactics_file(flashinfer_dir, gpu[0]) if gpu else None
        start = time.perf_counter()
        try:
            with autotune(False, cache=str(tactics) if tactics and tactics.exists() else None):
                ran = run_ops(json.loads(args.workload))
        except MissingJITCacheError as exc:
            print(f"flashinfer_ops: not in the cache: {exc.spec.name if exc.spec else exc}")
            return 1
        seconds = time.perf_counter() - start
        builds = [r for r in fi_cache.parse_build_log(log, pid=os.getpid()) if not r.noop]
    print(
        f"{len(ran)} ops ran in {seconds:.3f} s from {flashinfer_dir}: "
        f"{len(builds)} compiled, tactics {'loaded' if tactics and tactics.exists() else 'none'}"
    )
    return 0 if not builds else 1


if __name__ == "__main__":
    sys.exit(main())
