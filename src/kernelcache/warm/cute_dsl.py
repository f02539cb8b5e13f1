"""The cute-dsl warmer: import the spec's entry points and let them compile through the disk layer.

Runs for any arch on a CPU-only machine: the build runs each arch in its own process with
``CUTE_DSL_ARCH`` set before the DSL is imported (the variable is read at import).
"""

from __future__ import annotations

import time
from pathlib import Path

from kernelcache import progress
from kernelcache.errors import WarmError
from kernelcache.warm import CACHE_ENV, Warmer, WarmerReport, call_entry_points, dir_usage

SUBDIR = CACHE_ENV["KERNELCACHE_CUTE_DSL_DIR"]


class CuteDslWarmer(Warmer):
    type = "cute-dsl"

    def run(self, files_dir: Path, arch: str) -> WarmerReport:
        from kernelcache.runtime import cute as cute_cache

        target = files_dir / SUBDIR
        target.mkdir(parents=True, exist_ok=True)
        report = WarmerReport(warmer=self.label)
        start = time.perf_counter()
        cute_cache.install()
        previous = cute_cache.on_event

        def on_event(kind: str, name: str, seconds: float | None) -> None:
            if kind == "compile" and seconds is not None:
                progress.compiled(self.type, name, seconds)
            if previous is not None:
                previous(kind, name, seconds)

        cute_cache.on_event = on_event
        try:
            with cute_cache.cache_dir(target) as cache:
                report.kernels = call_entry_points(
                    self.type, self.config.entry_points, self.spec_dir, self.config.workload, arch
                )
                if cache.stats.bypassed:
                    raise WarmError(
                        f"cute-dsl warmer: {cache.stats.bypassed} compile(s) could not be keyed "
                        "and were not cached (see the warnings above)"
                    )
                report.compiled = cache.stats.misses
        finally:
            cute_cache.on_event = previous
            cute_cache.uninstall()
        report.seconds = round(time.perf_counter() - start, 3)
        usage = dir_usage(files_dir).get(SUBDIR, {"files": 0, "bytes": 0})
        report.files, report.bytes = usage["files"], usage["bytes"]
        return report
