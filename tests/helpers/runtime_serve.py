"""A serving process for the runtime tests: install ``kernelcache.runtime``, compile, report.

The runtime must be judged in a fresh process (it hooks imports, reads the environment once
and keeps process-wide counters), so each test runs this script with its own environment:

    runtime_serve.py [--cute WORKLOAD] [--torch BATCH [--device D] [--save-megacache F]]
                     [--triton BLOCK [--launch]] [--serve]

``--cute`` compiles the example CuTe-DSL kernels (``examples/demo_kernels.py``) for a
workload, ``--torch`` runs a small MLP through ``torch.compile`` (on the CPU unless
``--device cuda``; the batch size is part of the compiled graph), ``--triton`` compiles a
vector add for sm_90 without a GPU, or with ``--launch`` runs it on the GPU through
Triton's JIT.
Then it prints the metrics text after a ``--- metrics`` line. ``--serve`` prints
``serving <port>`` first (``/metrics`` on an ephemeral port unless the environment set one)
and keeps running after the report, until it is killed or its stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys

from kernelcache import runtime
from kernelcache.runtime import metrics


def run_cute(workload: str) -> None:
    import demo_kernels

    demo_kernels.warm(json.loads(workload))


def run_torch(batch: int, device: str, save_megacache: str | None) -> None:
    import torch

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(16, 32)
            self.down = torch.nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    model = torch.compile(MLP().to(device), dynamic=False)
    with torch.no_grad():
        model(torch.randn(batch, 16, device=device))
    if save_megacache:
        artifacts = torch.compiler.save_cache_artifacts()
        assert artifacts is not None, "torch.compile saved no cache artifacts"
        with open(save_megacache, "wb") as f:
            f.write(artifacts[0])


def run_triton(block: int, launch: bool) -> None:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def vector_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, x + tl.load(y_ptr + offsets, mask=mask), mask=mask)

    if launch:
        import torch

        x = torch.arange(1000, dtype=torch.float32, device="cuda")
        out = torch.empty_like(x)
        vector_add[(triton.cdiv(x.numel(), block),)](x, x, out, x.numel(), BLOCK=block)
        assert torch.equal(out, 2 * x)
        return
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    source = ASTSource(
        vector_add, signature={**signature, "BLOCK": "constexpr"}, constexprs={"BLOCK": block}
    )
    triton.compile(source, target=GPUTarget("cuda", 90, 32))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cute", metavar="WORKLOAD")
    parser.add_argument("--torch", type=int, metavar="BATCH")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--triton", type=int, metavar="BLOCK")
    parser.add_argument("--launch", action="store_true")
    parser.add_argument("--save-megacache", metavar="FILE")
    parser.add_argument("--serve", action="store_true")
    args = parser.parse_args()

    installed = runtime.install()  # a no-op returning the first result under the .pth hook
    if args.serve:
        port = installed.metrics_port or metrics.serve_metrics(0, "127.0.0.1")
        print(f"serving {port}", flush=True)
    if args.cute:
        run_cute(args.cute)
    if args.torch:
        run_torch(args.torch, args.device, args.save_megacache)
    if args.triton:
        run_triton(args.triton, args.launch)
    print("--- metrics")
    print(metrics.render().decode(), flush=True)
    if args.serve:
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
