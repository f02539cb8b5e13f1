"""The serving side of the demo: get every example kernel through kernelcache's disk layer.

A serving engine calls ``cute.compile`` for each kernel it needs. With
``kernelcache.runtime.cute.install()`` those calls load from ``$KERNELCACHE_CUTE_DSL_DIR``
(a materialized generation) instead of compiling; ``KERNELCACHE_STRICT=1`` turns any compile
that still happens into an error. Exits 0 only when every kernel came from the cache.

    KERNELCACHE_CUTE_DSL_DIR=<generation>/files/cute-dsl python examples/demo_serve.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kernelcache.errors import ColdCompileError
from kernelcache.runtime import cute as cute_cache

DEFAULT_WORKLOAD = {
    "sizes": [[128, 256], [1024, 1024]],
    "dtypes": ["float32", "float16"],
    "tiles": [[32, 32], [64, 64]],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        default=json.dumps(DEFAULT_WORKLOAD),
        help="workload JSON (the spec's warmer workload)",
    )
    args = parser.parse_args(argv)
    cute_cache.install()  # before the kernels' module binds cute.compile
    import demo_kernels

    cache = cute_cache.default_cache()
    start = time.perf_counter()
    try:
        names = demo_kernels.warm(json.loads(args.workload))
    except ColdCompileError as exc:
        print(f"demo_serve: {exc}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    stats = cache.stats
    print(
        f"{len(names)} kernels ready in {seconds:.3f} s from {cache.root}: "
        f"{stats.hits} loaded from cache, {stats.misses} compiled, {stats.bypassed} uncacheable"
    )
    return 0 if stats.misses == 0 and stats.bypassed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
