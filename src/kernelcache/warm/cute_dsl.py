"""The cute-dsl warmer: import the spec's entry points and let them compile through the disk layer.

Runs for any arch on a CPU-only machine: the build runs each arch in its own process with
``CUTE_DSL_ARCH`` set before the DSL is imported (the variable is read at import).
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernelcache.errors import WarmError
from kernelcache.stamp import source_digest
from kernelcache.warm import CACHE_ENV, Warmer, WarmerReport, dir_usage

SUBDIR = CACHE_ENV["KERNELCACHE_CUTE_DSL_DIR"]


def resolve_entry_point(entry_point: str, spec_dir: Path | None) -> Callable[..., Any]:
    """``module:function`` (or ``module:obj.attr``); the spec's folder is importable first."""
    module_name, _, attr_path = entry_point.partition(":")
    if spec_dir is not None and str(spec_dir) not in sys.path:
        sys.path.insert(0, str(spec_dir))
    try:
        target: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            target = getattr(target, attr)
    except (ImportError, AttributeError) as exc:
        raise WarmError(f"entry point {entry_point}: cannot import: {exc}") from exc
    if not callable(target):
        raise WarmError(f"entry point {entry_point}: not callable")
    return target


class CuteDslWarmer(Warmer):
    type = "cute-dsl"

    @property
    def label(self) -> str:
        return f"cute-dsl {','.join(self.config.entry_points)}"

    def sources(self) -> dict[str, str]:
        if self.spec_dir is not None and str(self.spec_dir) not in sys.path:
            sys.path.insert(0, str(self.spec_dir))
        modules = {ep.partition(":")[0] for ep in self.config.entry_points}
        try:
            return {m: source_digest(m) for m in sorted(modules)}
        except Exception as exc:  # a module that cannot be found cannot be keyed
            raise WarmError(f"cute-dsl warmer: cannot digest source: {exc}") from exc

    def run(self, files_dir: Path, arch: str) -> WarmerReport:
        from kernelcache.runtime import cute as cute_cache

        target = files_dir / SUBDIR
        target.mkdir(parents=True, exist_ok=True)
        report = WarmerReport(warmer=self.label)
        start = time.perf_counter()
        cute_cache.install()
        try:
            with cute_cache.cache_dir(target) as cache:
                for entry_point in self.config.entry_points:
                    fn = resolve_entry_point(entry_point, self.spec_dir)
                    try:
                        names = fn(dict(self.config.workload))
                    except Exception as exc:
                        raise WarmError(
                            f"entry point {entry_point} failed for {arch}: "
                            f"{type(exc).__name__}: {exc}"
                        ) from exc
                    report.kernels.extend(names or [])
                if cache.stats.bypassed:
                    raise WarmError(
                        f"cute-dsl warmer: {cache.stats.bypassed} compile(s) could not be keyed "
                        "and were not cached (see the warnings above)"
                    )
                report.compiled = cache.stats.misses
        finally:
            cute_cache.uninstall()
        report.seconds = round(time.perf_counter() - start, 3)
        usage = dir_usage(files_dir).get(SUBDIR, {"files": 0, "bytes": 0})
        report.files, report.bytes = usage["files"], usage["bytes"]
        return report
