"""Example torch.compile models, warmed ahead of time by the torch-compile warmer.

A small MLP (the default) or, with ``"model": "block"`` in the workload, a pre-norm transformer
block (attention and MLP: four GEMM shapes).

On a GPU the MLP is compiled with ``mode="max-autotune-no-cudagraphs"``, where inductor
benchmarks Triton GEMM templates against cuBLAS (10-17.6 s cold on an H200, 1.0-1.5 s from
the Mega-Cache); on a CPU with the default mode and inductor's C++ backend, which is how the
tests run it. ``warm(workload)`` is the entry point named in ``examples/serving-stack.yaml``.

``main()`` plays the serving process: it loads the Mega-Cache before the first compiled call,
from ``--megacache FILE`` (``torch.compiler.load_cache_artifacts``, the contract itself) or
through ``kernelcache.runtime`` when ``KERNELCACHE_DIR`` is set, compiles, and prints
inductor's cache counters as one JSON line (with the runtime, also the compiles it counted:
Triton kernels compiled or tuned again count there). It exits 0 only when nothing compiled:

    python examples/torch_models.py --megacache <generation>/files/torch-compile/megacache.bin
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 5e-2, "rtol": 5e-2},
}
DEFAULT_WORKLOAD = {"batch_sizes": [8, 64], "features": 256, "hidden": 1024, "dtype": "bfloat16"}


class MLP(nn.Module):
    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(features, hidden)
        self.down = nn.Linear(hidden, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm transformer block: four GEMM shapes for max-autotune to tune, as in a model."""

    def __init__(self, features: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(features), nn.LayerNorm(features)
        self.qkv = nn.Linear(features, 3 * features)
        self.out = nn.Linear(features, features)
        self.mlp = MLP(features, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, features = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).unbind(2)
        attn = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        x = x + self.out(attn.transpose(1, 2).reshape(batch, seq, features))
        return x + self.mlp(self.norm2(x))


def model_for(workload: Mapping[str, Any], device: str) -> tuple[nn.Module, torch.dtype]:
    """The workload's model (``model``: ``mlp``, the default, or ``block``), seeded."""
    dtype = DTYPES[workload.get("dtype", "float32")]
    features, hidden = workload.get("features", 64), workload.get("hidden", 256)
    torch.manual_seed(0)
    if workload.get("model", "mlp") == "block":
        model: nn.Module = Block(features, hidden, workload.get("heads", 8))
    else:
        model = MLP(features, hidden)
    return model.to(device=device, dtype=dtype).eval(), dtype


def input_for(workload: Mapping[str, Any], batch: int, device: str) -> torch.Tensor:
    """``(batch, features)`` for the MLP, ``(batch, seq, features)`` for the block."""
    dtype = DTYPES[workload.get("dtype", "float32")]
    shape = [batch, workload.get("features", 64)]
    if workload.get("model", "mlp") == "block":
        shape.insert(1, workload.get("seq", 128))
    return torch.randn(*shape, device=device, dtype=dtype)


def compile_model(model: nn.Module, device: str) -> Any:
    # dynamic=False: one graph per batch size, as the workload lists them.
    mode = "max-autotune-no-cudagraphs" if device == "cuda" else None
    return torch.compile(model, mode=mode, dynamic=False)


def warm(workload: Mapping[str, Any]) -> list[str]:
    """The warm-up entry point: compile and run the model per batch size, checked against eager."""
    device = workload.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    model, dtype = model_for(workload, device)
    compiled = compile_model(model, device)
    names = []
    label = f"{workload.get('model', 'mlp')}[{workload.get('dtype', 'float32')},"
    label += f"{workload.get('features', 64)}x{workload.get('hidden', 256)}"
    with torch.no_grad():
        for batch in workload.get("batch_sizes", [8]):
            x = input_for(workload, batch, device)
            torch.testing.assert_close(compiled(x), model(x), **TOLERANCE[dtype])
            names.append(f"{label},batch={batch}]")
    return names


def _install_runtime() -> bool:
    """Let ``kernelcache.runtime`` load the generation's caches, where it offers that."""
    from kernelcache import runtime

    install = getattr(runtime, "install", None)
    if install is None:
        print(
            "torch_models: kernelcache.runtime has no install(); no cache loaded", file=sys.stderr
        )
        return False
    install()
    return True


def _runtime_compiles() -> int:
    from kernelcache.runtime import metrics

    return int(sum(metrics.cold_compiles().values()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        default=json.dumps(DEFAULT_WORKLOAD),
        help="workload JSON (the spec's warmer workload)",
    )
    parser.add_argument("--megacache", type=Path, help="a megacache.bin to load first")
    args = parser.parse_args(argv)
    counted = False
    if args.megacache is not None:
        torch.compiler.load_cache_artifacts(args.megacache.read_bytes())
    elif os.environ.get("KERNELCACHE_DIR"):
        counted = _install_runtime()
    from torch._dynamo.utils import counters

    start = time.perf_counter()
    names = warm(json.loads(args.workload))
    stats = {
        "models": len(names),
        "seconds": round(time.perf_counter() - start, 3),
        **{k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")},
        **{k: counters["aot_autograd"][k] for k in ("autograd_cache_hit", "autograd_cache_miss")},
    }
    if counted:
        stats["runtime_compiles"] = _runtime_compiles()
    print(json.dumps(stats))
    return 0 if stats["fxgraph_cache_miss"] == 0 and not stats.get("runtime_compiles") else 1


if __name__ == "__main__":
    sys.exit(main())
