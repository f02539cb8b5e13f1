"""The torch-compile warmer: compile the spec's models and keep PyTorch's Mega-Cache.

The entry points compile and call their models (``torch.compile``) with inductor's cache in
``files/inductor`` and Triton's in ``files/triton``. What the warm produced is then taken as
one portable blob, ``torch.compiler.save_cache_artifacts()`` (inductor FX graphs,
AOTAutograd entries, autotune results and, on GPU, the Triton binaries inductor bundles with
its graphs), written to ``files/torch-compile/megacache.bin``; ``megacache.json`` beside it
lists the artifacts by kind for the report. A warm that recorded no artifact fails: a model
that was not compiled, or compiled with caching off, would leave serving to compile again.

The consumer contract (``kernelcache.runtime`` implements it, ``observe_torch``): a serving
process points ``TORCHINDUCTOR_CACHE_DIR`` at its materialized (writable) copy of
``files/inductor``, the warm process's own cache, and the compile that follows is a cache hit
(``fxgraph_cache_hit``, ``autograd_cache_hit``) instead of an inductor compile. Where inductor
uses another directory, or the generation holds only the blob, the process first passes
``files/torch-compile/megacache.bin`` to ``torch.compiler.load_cache_artifacts``, which
writes the same entries there. Loading after a model was compiled does not help that model.
The artifacts are valid only for the same torch build (a stamp factor) and, for GPU kernels,
the same arch.

On a GPU, max-autotune also tunes pointwise and reduction kernels at their first launch
(coordinate descent), and writes the winners to the autotune cache. Serving takes a saved
winner as final (``hooks.keep_tuned_configs``); the warm then replays the entry points in
fresh processes set up as serving is, each adding what it compiled, until one compiles
nothing (at most ``MAX_REPLAYS``); the report lists each replay's compile count. Replays run
in the staging dir itself, so they cannot show a lookup bound to its path: inductor's bundled
autotuners keep that path, and serving looks their tuned configs up in its own copy instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelcache.errors import WarmError
from kernelcache.warm import (
    CACHE_ENV,
    Warmer,
    WarmerReport,
    call_entry_points,
    record_growth,
    scoped_env,
    snapshot,
)

SUBDIR = "torch-compile"
MEGACACHE = "megacache.bin"
MEGACACHE_INFO = "megacache.json"
CACHE_DIRS = {var: CACHE_ENV[var] for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
MAX_REPLAYS = 3


@dataclass
class TorchCompileReport(WarmerReport):
    """The warm report plus the Mega-Cache's artifacts by kind (inductor, aot_autograd, ...)."""

    megacache: dict[str, int] = field(default_factory=dict)
    replays: list[int] = field(default_factory=list)  # compiles in each serving-like replay


def artifact_count(info_path: Path) -> int:
    """Artifacts listed in a ``megacache.json``; 0 when there is none yet."""
    if not info_path.exists():
        return 0
    info = json.loads(info_path.read_text())
    return sum(len(keys) for keys in info["artifacts"].values())


class TorchCompileWarmer(Warmer):
    type = "torch-compile"

    def run(self, files_dir: Path, arch: str) -> WarmerReport:
        out = files_dir / SUBDIR
        out.mkdir(parents=True, exist_ok=True)
        subdirs = [*CACHE_DIRS.values(), SUBDIR]
        before = snapshot(files_dir, subdirs)
        # Save-artifacts accumulates over the process: an earlier torch-compile warmer's
        # artifacts are in this blob too, so count what this one added.
        earlier = artifact_count(out / MEGACACHE_INFO)
        report = TorchCompileReport(warmer=self.label)
        start = time.perf_counter()
        env = {var: str(files_dir / sub) for var, sub in CACHE_DIRS.items()}
        with scoped_env({**self.config.env, **env}):
            import torch
            from torch._dynamo.utils import counters

            misses = counters["inductor"]["fxgraph_cache_miss"]
            report.kernels = call_entry_points(
                self.type, self.config.entry_points, self.spec_dir, self.config.workload, arch
            )
            report.compiled = counters["inductor"]["fxgraph_cache_miss"] - misses
            saved = torch.compiler.save_cache_artifacts()
        if saved is None or not saved[0]:
            raise WarmError(f"{self.label} produced no cache artifacts for {arch}")
        blob, info = saved
        artifacts: dict[str, Any] = {kind: list(keys) for kind, keys in info.artifacts.items()}
        if sum(map(len, artifacts.values())) <= earlier:
            raise WarmError(f"{self.label} produced no cache artifacts for {arch}")
        report.megacache = {kind: len(keys) for kind, keys in sorted(artifacts.items())}
        (out / MEGACACHE).write_bytes(blob)
        summary = {"bytes": len(blob), "artifacts": artifacts}
        (out / MEGACACHE_INFO).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        while len(report.replays) < MAX_REPLAYS and report.replays[-1:] != [0]:
            report.replays.append(self._replay(files_dir, arch, env))
        if report.replays[-1]:
            print(
                f"warning: {self.label}: a process serving from this generation may still "
                f"compile (compiles in {MAX_REPLAYS} replays: {report.replays})",
                file=sys.stderr,
                flush=True,
            )
        report.seconds = round(time.perf_counter() - start, 3)
        after = snapshot(files_dir, subdirs)
        record_growth(report, files_dir, {p: n for p, n in after.items() if before.get(p) != n})
        return report

    def _replay(self, files_dir: Path, arch: str, cache_env: dict[str, str]) -> int:
        """The entry points in a fresh process set up as serving is; its compile count."""
        job = {
            "entry_points": self.config.entry_points,
            "spec_dir": str(self.spec_dir) if self.spec_dir else None,
            "workload": self.config.workload,
            "arch": arch,
            "files": str(files_dir),
        }
        from kernelcache.runtime import SERVING_SETTINGS

        env = {**os.environ, **self.config.env, **cache_env, **SERVING_SETTINGS}
        proc = subprocess.run(
            [sys.executable, "-m", __name__, json.dumps(job)],
            env=env,
            capture_output=True,
            text=True,
            timeout=self.config.timeout_seconds,
        )
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines or not lines[-1].isdigit():
            said = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise WarmError(f"{self.label}: replay for {arch} failed: {said}")
        return int(lines[-1])


def replay(job: dict[str, Any]) -> int:
    """In the replay process: count compiles as the serving runtime does, run the entry points."""
    from kernelcache.runtime import hooks, metrics, observe_torch

    hooks.watch_triton(strict=False)
    observe_torch(Path(job["files"]), strict=False)
    spec_dir = Path(job["spec_dir"]) if job["spec_dir"] else None
    call_entry_points(
        TorchCompileWarmer.type, job["entry_points"], spec_dir, job["workload"], job["arch"]
    )
    return int(sum(metrics.cold_compiles().values()))


if __name__ == "__main__":
    print(replay(json.loads(sys.argv[1])))
