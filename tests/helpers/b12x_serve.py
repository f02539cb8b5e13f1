"""Play a serving process of FlashInfer's b12x MoE on a machine without a Blackwell GPU.

    b12x_serve.py WORKLOAD_JSON SM_COUNT

``kernelcache.runtime`` is installed first (``KERNELCACHE_DIR`` names the generation), then
FlashInfer's ``B12xMoEWrapper`` is driven as vLLM builds it, once per batch size, through its
real kernel lookup (``build_and_load_cute_dsl_kernel``: load the ``.o`` or compile) and the real
direct-micro compile (``cute.compile``, which the runtime routes through its disk layer).
What cannot happen without the GPU is stood in for: the GPU's answers (the warmer's own
``answered_for``), the launches, and the direct-micro register probe. Loaded kernels are
never called. Prints one JSON line: the kernels loaded, FlashInfer's builds in this process
(its build log) and the runtime's compile counter.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from kernelcache import runtime
from kernelcache.runtime import metrics


def main(workload_json: str, sm_count: int) -> None:
    runtime.install()
    from kernelcache.spec import B12xWorkload
    from kernelcache.toolchains import b12x
    from kernelcache.toolchains.flashinfer import parse_build_log

    workload = B12xWorkload.model_validate(json.loads(workload_json))
    dispatch, _, _ = b12x._modules()
    loaded: list[dict[str, Any]] = []
    real_lookup = dispatch.build_and_load_cute_dsl_kernel
    real_direct = dispatch.compile_direct_micro_kernel

    def lookup(module: str, name: str, compile_fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        real_lookup(module, name, compile_fn, *args, **kwargs)
        loaded.append({"name": name, "ms": round((time.perf_counter() - start) * 1e3, 2)})
        return b12x._NoKernel()

    def direct_micro(kernel: Any, **kwargs: Any) -> Any:
        real_direct(kernel, **kwargs)  # cute.compile: the runtime's disk layer
        return b12x._NoKernel()

    target = b12x.Target(os.environ["CUTE_DSL_ARCH"], sm_count, sm_count)
    wrapper = b12x.wrapper_for(workload)
    with (
        b12x.answered_for(target),
        b12x.patched(
            dispatch,
            build_and_load_cute_dsl_kernel=lookup,
            compile_direct_micro_kernel=direct_micro,
        ),
        b12x.without_launches(),
    ):
        for m in sorted(set(workload.batch_sizes)):
            wrapper.run(**b12x.operands(workload, m))
    builds = parse_build_log(os.environ["FLASHINFER_JIT_BUILD_LOG"], pid=os.getpid())
    compiles = {f"{tc}:{kernel}": n for (tc, kernel), n in metrics.cold_compiles().items()}
    hits = sum(
        s.value
        for family in metrics.REGISTRY.collect()
        if family.name == "kernelcache_cache_hits"
        for s in family.samples
        if s.name.endswith("_total")
    )
    print(
        json.dumps(
            {
                "loaded": loaded,
                "builds": [b.name for b in builds if not b.noop],
                "compiles": compiles,
                "cache_hits": hits,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
