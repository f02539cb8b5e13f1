"""Inductor (``torch.compile``): the torch-compile warmer keeps PyTorch's Mega-Cache, and serving
counts every dynamo/inductor compile that still happens.

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
winner as final (``keep_tuned_configs``); the warm then replays the entry points in
fresh processes set up as serving is, each adding what it compiled, until one compiles
nothing (at most ``MAX_REPLAYS``); the report lists each replay's compile count. Replays run
in the staging dir itself, so they cannot show a lookup bound to its path: inductor's bundled
autotuners keep that path, and serving looks their tuned configs up in its own copy instead.

Serving: dynamo's compile start/end callbacks bracket each frame compile, and the FX-graph
cache's own counters (``fxgraph_cache_miss``/``_hit``/``_bypass``) say whether it compiled.
The kernel label is the compiled frame (``forward (model.py:12)``). Strict: the FX-graph
cache lookup raises on a miss, before lowering. A bypass (a graph inductor will not cache) is
counted, not refused. The Triton kernels of a missed graph are compiled in inductor's compile
workers (other processes, by default): here they are that graph's miss. On CPU the C++
kernels of a cache hit are rebuilt unless the generation's ``inductor`` directory holds them:
the Mega-Cache carries graphs, not shared objects. These rely on semi-private hooks of torch;
an observer that finds its hook missing logs one warning and counts nothing.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from kernelcache.errors import ColdCompileError, WarmError
from kernelcache.runtime import metrics, ready
from kernelcache.runtime.imports import when_imported
from kernelcache.toolchains import triton
from kernelcache.toolchains.base import (
    Serving,
    Toolchain,
    Warmer,
    WarmerReport,
    call_entry_points,
)

log = logging.getLogger(__name__)

CACHE_SUBDIR = "inductor"  # TORCHINDUCTOR_CACHE_DIR: inductor's own cache
SUBDIR = "torch-compile"
MEGACACHE = "megacache.bin"
MEGACACHE_INFO = "megacache.json"
MEGACACHE_FILE = f"{SUBDIR}/{MEGACACHE}"  # as named under files/
CACHE_DIRS = {"TORCHINDUCTOR_CACHE_DIR": CACHE_SUBDIR, "TRITON_CACHE_DIR": triton.SUBDIR}
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
    report_type = TorchCompileReport
    fills = (*CACHE_DIRS.values(), SUBDIR)

    def env(self, files_dir: Path, arch: str) -> dict[str, str]:
        return {var: str(files_dir / sub) for var, sub in CACHE_DIRS.items()}

    def produce(self, files_dir: Path, arch: str, report: TorchCompileReport) -> None:
        out = files_dir / SUBDIR
        # Save-artifacts accumulates over the process: an earlier torch-compile warmer's
        # artifacts are in this blob too, so count what this one added.
        earlier = artifact_count(out / MEGACACHE_INFO)
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
            report.replays.append(self._replay(files_dir, arch))
        if report.replays[-1]:
            print(
                f"warning: {self.label}: a process serving from this generation may still "
                f"compile (compiles in {MAX_REPLAYS} replays: {report.replays})",
                file=sys.stderr,
                flush=True,
            )

    def _replay(self, files_dir: Path, arch: str) -> int:
        """The entry points in a fresh process set up as serving is; its compile count."""
        job = {
            "entry_points": self.config.entry_points,
            "spec_dir": str(self.spec_dir) if self.spec_dir else None,
            "workload": self.config.workload,
            "arch": arch,
            "files": str(files_dir),
        }
        from kernelcache.toolchains import serving_settings

        env = {**os.environ, **serving_settings()}  # the warm's caches, as serving sets up
        proc = subprocess.run(
            [sys.executable, "-m", "kernelcache.toolchains.inductor", json.dumps(job)],
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
    triton.watch(strict=False)
    observe_torch(Path(job["files"]), strict=False)
    spec_dir = Path(job["spec_dir"]) if job["spec_dir"] else None
    call_entry_points(
        TorchCompileWarmer.type, job["entry_points"], spec_dir, job["workload"], job["arch"]
    )
    return int(sum(metrics.cold_compiles().values()))


# ------------------------------------------------------------------------------ serving


def observe_torch(files: Path | None, strict: bool) -> None:
    """Count dynamo/inductor compiles; with a generation's ``files``, serve inductor from it.

    Also used by the torch-compile warmer's replays, which must see what serving sees.
    """
    watch_inductor(strict, _megacache_to_load(files) if files is not None else None)
    if files is not None:
        keep_tuned_configs()


def _megacache_to_load(files: Path) -> Path | None:
    """The generation's Mega-Cache, unless inductor already reads the generation's own cache.

    The warm process's inductor cache (``files/inductor``) holds every artifact of the blob
    plus what the warmer's replays added after it was saved. Loading the blob over it would
    put the first process's autotune results back over the replays' ones, in an order that
    varies per process (the blob can hold several results for one kernel).
    """
    blob = files / MEGACACHE_FILE
    if not blob.is_file():
        return None
    own = files / CACHE_SUBDIR
    in_use = os.environ.get("TORCHINDUCTOR_CACHE_DIR") == str(own)
    if in_use and own.is_dir() and any(own.iterdir()):
        log.info("kernelcache: inductor reads the generation's own cache; Mega-Cache not loaded")
        return None
    return blob


def watch_inductor(strict: bool, megacache: Path | None) -> None:
    """Count dynamo/inductor compiles; load a Mega-Cache when torch is imported."""
    if megacache is not None:
        when_imported("torch", lambda torch: _load_megacache(torch, megacache))
    when_imported("torch._dynamo", _count_dynamo_compiles)
    if strict:
        when_imported("torch._inductor.codecache", _refuse_fx_graph_misses)


def _load_megacache(torch: Any, path: Path) -> None:
    """``torch.compiler.load_cache_artifacts``: fills the local caches before any compile."""
    start = time.perf_counter()
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as exc:  # another torch's format, or a truncated file: compile instead
        log.warning("kernelcache: Mega-Cache %s not loaded: %s: %s", path, type(exc).__name__, exc)
        metrics.record_dropped("inductor", "megacache-unloadable")
        return
    loaded = sum(len(keys) for keys in info.artifacts.values()) if info is not None else 0
    seconds = time.perf_counter() - start
    log.info(
        "kernelcache: Mega-Cache loaded: %d artifacts from %s in %.2f s", loaded, path, seconds
    )


def keep_tuned_configs() -> None:
    """Serving from a generation: a kernel whose config came from the generation's autotune
    cache is not tuned again.

    Under ``coordinate_descent_tuning`` (max-autotune) inductor re-runs coordinate descent at
    a kernel's first launch unless its config is marked ``found_by_coordesc``, and Triton's
    ``Config`` loses that mark when it is copied or unpickled (3.6). Every serving process
    would then re-tune from the saved best config, compile each neighbour it tries, and
    pick its own winner from noisy timings. A cache hit is already the warm's tuned result
    (inductor itself skips its RBLOCK rescaling on a hit for the same reason).

    Kernels that inductor bundled with a cached graph come back as pickled autotuners that
    still name their module by the path it had in the warm's staging dir, and they look up
    their tuned config beside it: a miss wherever that path is gone (every pod), so they
    were tuned and compiled again. Their lookup is made in this process's inductor cache.
    """
    when_imported("torch._inductor.runtime.triton_heuristics", _keep_tuned_configs)


def _keep_tuned_configs(heuristics: ModuleType) -> None:
    autotuner = getattr(heuristics, "CachingAutotuner", None)
    tune = getattr(autotuner, "coordinate_descent_tuning", None)
    if autotuner is None or tune is None:
        log.warning("kernelcache: unknown inductor autotuner: it may re-tune in serving")
        return

    def coordinate_descent_tuning(self: Any, launcher: Any, *args: Any, **kwargs: Any) -> Any:
        if (getattr(self, "autotune_cache_info", None) or {}).get("autotune_cache_state") == "hit":
            return launcher
        return tune(self, launcher, *args, **kwargs)

    autotuner.coordinate_descent_tuning = coordinate_descent_tuning
    recheck = getattr(autotuner, "recheck_autotune_cache", None)
    if recheck is None:  # a torch that bundles no autotuners
        return
    try:
        from torch._inductor.runtime.runtime_utils import cache_dir
    except ImportError:
        log.warning("kernelcache: unknown inductor cache layout: bundled kernels may re-tune")
        return

    def recheck_autotune_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.filename is not None:
            self.filename = kernel_module_in(Path(cache_dir()), self.filename)
        return recheck(self, *args, **kwargs)

    autotuner.recheck_autotune_cache = recheck_autotune_cache


def kernel_module_in(cache: Path, filename: str) -> str:
    """A kernel module's path in the inductor cache ``cache`` (``<cache>/<xx>/<name>.py``,
    where inductor writes every kernel module it loads), wherever it was written first."""
    module = Path(filename)
    return str(cache / module.parent.name / module.name)


class _FrameCompile(threading.local):
    """The dynamo compile in progress on this thread."""

    kernel = ""
    start = 0.0
    counts: tuple[int, int, int] = (0, 0, 0)
    refused = False


_frame = _FrameCompile()


def _fx_graph_counts() -> tuple[int, int, int]:
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return (
        inductor["fxgraph_cache_miss"],
        inductor["fxgraph_cache_bypass"],
        inductor["fxgraph_cache_hit"],
    )


def _frame_name(compile_id: str) -> str:
    """``forward (model.py:12)``: dynamo records each frame it traces as ``name path:line``."""
    try:
        from torch._dynamo.convert_frame import dynamo_tls

        name, _, where = dynamo_tls.traced_frame_infos[-1].partition(" ")
    except (ImportError, AttributeError, IndexError):
        return f"frame {compile_id}"
    return f"{name} ({os.path.basename(where)})"


def _count_dynamo_compiles(dynamo: Any) -> None:
    handler = getattr(dynamo, "callback_handler", None)
    if handler is None:
        log.warning("kernelcache: this torch has no dynamo compile callbacks: not counted")
        return

    def start(args: Any) -> None:
        _frame.kernel = _frame_name(str(args.compile_id))
        _frame.start = time.perf_counter()
        _frame.counts = _fx_graph_counts()
        _frame.refused = False

    def end(_: Any) -> None:
        now = _fx_graph_counts()
        misses, bypasses, hits = (b - a for a, b in zip(_frame.counts, now, strict=True))
        if misses or bypasses:
            seconds = None if _frame.refused else time.perf_counter() - _frame.start
            metrics.record_compile("inductor", _frame.kernel, seconds, count=misses + bypasses)
        if hits:
            metrics.record_hit("inductor", hits)

    handler.register_start_callback(start)
    handler.register_end_callback(end)


def _refuse_fx_graph_misses(codecache: Any) -> None:
    cache = codecache.FxGraphCache
    lookup = getattr(cache, "load_with_key", None)
    if lookup is None:
        log.warning("kernelcache: this torch's FX graph cache has no load_with_key: not refused")
        return

    def load_with_key(*args: Any, **kwargs: Any) -> Any:
        graph, info = lookup(*args, **kwargs)
        if graph is None and info.get("cache_state") == "miss" and ready.refusing(True):
            _frame.refused = True
            where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "the default inductor cache")
            raise ColdCompileError(
                f"inductor: cold compile of {_frame.kernel or 'a graph'} in strict mode "
                f"(FX graph not in the cache at {where})"
            )
        return graph, info

    cache.load_with_key = staticmethod(load_with_key)


def set_by_inductor(name: str) -> bool:
    """Whether ``name`` holds inductor's own default, written by torch rather than the user.

    Importing ``torch._inductor`` (``compile_fx``, say) sets ``TORCHINDUCTOR_CACHE_DIR`` to
    ``/tmp/torchinductor_<user>`` when it is unset. An application that imports it before
    ``install()`` would otherwise serve from that empty default instead of the generation.
    Inductor reads the variable again at every cache access, so pointing it later works.
    """
    if name != "TORCHINDUCTOR_CACHE_DIR" or "torch._inductor" not in sys.modules:
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch: its default is not known here
        return False
    return os.environ[name] == os.path.abspath(default_cache_dir())


class Inductor(Toolchain):
    def serving_env(self, serving: Serving, files: Path) -> dict[str, str]:
        if "torch._inductor.config" in sys.modules:
            log.warning(
                "kernelcache: torch._inductor was imported before kernelcache.runtime.install(): "
                "settings inductor reads at import (TORCHINDUCTOR_COMPILE_THREADS=1) do not "
                "apply; install first, or set KERNELCACHE_RUNTIME=1"
            )
        return super().serving_env(serving, files)

    def observe(self, serving: Serving) -> None:
        observe_torch(serving.files, serving.config.strict)

    def holds_own_default(self, name: str) -> bool:
        return set_by_inductor(name)


TOOLCHAIN = Inductor(
    # Not read in place: its file locks live in its cache directory (codecache's locks/), a
    # hit writes the graph's module there when absent, its C++ kernels are dlopen'ed (an
    # image volume is noexec) and its Triton kernels go through Triton's cache.
    name="inductor",
    cache_env={"TORCHINDUCTOR_CACHE_DIR": CACHE_SUBDIR},
    serving_settings={
        # Inductor's kernels are loaded from the generation, not compiled: no compile-worker
        # pool to start (seconds), and a compile that still happens stays in this process,
        # counted.
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    },
    tuning_suffixes=(".best_config",),  # inductor's tuned launch configs
    warmers=(TorchCompileWarmer,),
    requires=("torch", "torch"),
)


if __name__ == "__main__":  # a replay: run as this package's module, so that one copy serves
    from kernelcache.toolchains.inductor import replay as replay_job

    print(replay_job(json.loads(sys.argv[1])))
