"""vLLM: the engine's whole cache warmed until a fresh engine meets no JIT, its cache root
bound to one absolute path, and, in serving, the warmed shapes loaded before vLLM's JIT monitor
arms.

**Warm.** Each pass is a fresh process (``drive``) running ``vllm.LLM`` with the spec's engine
arguments, ``VLLM_CACHE_ROOT`` at the workload's ``cacheRoot`` (the path serving uses too: see
the cache root below) and Triton, inductor and FlashInfer caches in the staging generation,
then a sweep of requests over every declared prompt length and batch size with vLLM's own JIT
monitor in ``warn`` mode. The first pass compiles (cold); each later pass is set up as serving
is (the forward sizes at which the monitor fired so far run before it arms) and must see
nothing: no monitor event, no compile counted by kernelcache. After at most ``maxPasses``
processes the warm fails naming the kernel that still JITs. The cache root is then copied
into ``files/vllm``, with the recorded sizes in ``files/vllm-warmup/sizes.json`` and vLLM's
own ``cache_key_factors.json`` in the report.

**The cache root.** vLLM's compile cache is bound to where it was written: its artifacts name
the cache root, the vLLM install and the model by absolute path, a copy at another path
crashes the engine, and a warm start writes new files into it (a read-only copy crashes it
too). So the generation keeps vLLM's tree under ``files/vllm`` with the root it was built at
as the stamp factor ``vllm/cache_root``, and the init-container copies it back to exactly
that path, writable (``place``). A root is only ever emptied when it is kernelcache's own
(``MARKER``, written before anything else): a path that holds something else is refused,
never cleared. Pure Python, no vLLM: the init-container runs this.

**Serving.** vLLM arms its own JIT monitor (``vllm.utils.jit_monitor.activate``) at the end of
its warm-up. From then on every Triton kernel the process loads for the first time counts as a
JIT, whether it is compiled or read from Triton's disk cache: the monitor listens on Triton's
``jit_post_compile_hook``, which fires on every miss of the in-memory kernel cache. vLLM's
warm-up runs the CUDA-graph sizes and the compile ranges' ends, not every token count a served
batch has, so a fused-MoE kernel specialized for a prefill size the warm-up did not run is
first loaded at the first such request (and ``jit_monitor_mode="error"`` stops the engine
there). No cache on disk can change that; only running the shape before the monitor arms can.
So the warm records the token counts of the forwards at which the monitor fired
(``WARMUP_FILE``), and in serving one dummy forward per recorded size runs just before the
monitor arms (inside ``Worker.compile_or_warm_up_model``). Strict mode arms the monitor in
``error`` mode whatever the engine was given. Every monitor event is counted
(``kernelcache_vllm_jit_events_total``) and kept in ``state.events`` with the token count of
the forward it happened in. The engine's model and the cache root are checked against the
generation's stamp.

Nothing here imports vLLM: each hook is installed when vLLM's own module is imported.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelcache.errors import StampMismatchError, StorageError, WarmError
from kernelcache.runtime import metrics
from kernelcache.runtime.imports import when_imported
from kernelcache.toolchains import flashinfer, inductor, triton
from kernelcache.toolchains.base import (
    Serving,
    Toolchain,
    Warmer,
    WarmerReport,
    make_cache_dirs,
)

if TYPE_CHECKING:
    from kernelcache.spec import VllmWorkload
    from kernelcache.store import Manifest

log = logging.getLogger(__name__)

FACTOR = "vllm/cache_root"
MODEL_FACTOR = "vllm/model"
SUBDIR = "vllm"  # files/vllm: VLLM_CACHE_ROOT's tree, placed back at its root
WARMUP_SUBDIR = "vllm-warmup"
WARMUP_FILE = f"{WARMUP_SUBDIR}/sizes.json"
MARKER = ".kernelcache-vllm-root"
ENV = "VLLM_CACHE_ROOT"
TOOLCHAIN_DIRS = (triton.SUBDIR, inductor.CACHE_SUBDIR, flashinfer.SUBDIR)
# Set by vLLM's own warm-up; left as vLLM chooses them unless the spec's env says otherwise.
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_RUNNERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


@dataclass
class VllmReport(WarmerReport):
    """The warm report plus each pass, the recorded sizes and vLLM's own cache key factors."""

    passes: list[dict[str, Any]] = field(default_factory=list)
    preload_sizes: list[int] = field(default_factory=list)
    compiled_by_toolchain: dict[str, dict[str, float]] = field(default_factory=dict)
    cache_key_factors: dict[str, Any] = field(default_factory=dict)


class VllmWarmer(Warmer):
    type = "vllm"
    report_type = VllmReport
    fills = (*TOOLCHAIN_DIRS, SUBDIR, WARMUP_SUBDIR)

    @property
    def workload(self) -> VllmWorkload:
        return self.config.vllm_workload()

    @property
    def label(self) -> str:
        return f"vllm {self.workload.model}"

    def measured_factors(self) -> list[str]:
        return ["vllm/install"]

    def path_factors(self) -> dict[str, str]:
        return {FACTOR: self.workload.cache_root, MODEL_FACTOR: self.workload.model}

    def env(self, files_dir: Path, arch: str) -> dict[str, str]:
        from kernelcache.toolchains import cache_env

        return {
            **{name: value for name, value in ENGINE_ENV.items() if name not in self.config.env},
            **make_cache_dirs(files_dir, cache_env()),
            ENV: str(Path(self.workload.cache_root)),
            "CUTE_DSL_ARCH": arch,
        }

    def produce(self, files_dir: Path, arch: str, report: VllmReport) -> None:
        workload = self.workload
        root = Path(workload.cache_root)
        claim(root)
        env = dict(os.environ)
        sizes: set[int] = set()
        for index in range(workload.max_passes):
            serving = index > 0
            result = run_pass(workload, env, sorted(sizes), serving, self.config.timeout_seconds)
            report.passes.append(pass_summary(result))
            if not serving:
                report.kernels = sorted({k for _, k in _compiled(result)})
                report.compiled = len(_compiled(result))
                report.compiled_by_toolchain = result["compiled_by_toolchain"]
            elif not result["jit_events"] and not result["cold_compiles"]:
                break
            unplaced = [e for e in result["jit_events"] if not e["tokens"]]
            if unplaced:
                raise WarmError(
                    f"{self.label}: vLLM's JIT monitor saw {unplaced[0]['kernel']} outside a "
                    "forward (the sampler?): no warmed size can cover it"
                )
            sizes |= {e["tokens"] for e in result["jit_events"]}
        else:
            last = report.passes[-1]
            seen = [e["kernel"] for e in last["jit_events"]] or [k for k in last["cold_compiles"]]
            raise WarmError(
                f"{self.label}: still JIT after {workload.max_passes} engine processes "
                f"(e.g. {seen[0] if seen else '?'}); declare fewer shapes or more maxPasses"
            )
        report.preload_sizes = sorted(sizes)
        self._keep(files_dir, root, report)

    def _keep(self, files_dir: Path, root: Path, report: VllmReport) -> None:
        """vLLM's tree into files/vllm (its marker left out), the sizes beside it."""
        target = files_dir / SUBDIR
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(root, target, ignore=shutil.ignore_patterns(MARKER))
        sizes_file = files_dir / WARMUP_FILE
        sizes_file.parent.mkdir(parents=True, exist_ok=True)
        sizes_file.write_text(json.dumps({"sizes": report.preload_sizes}) + "\n")
        report.cache_key_factors = cache_key_factors(target)


def _compiled(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(toolchain, kernel) of each kernel a pass compiled."""
    return [(key.partition("/")[0], key.partition("/")[2]) for key in result["cold_compiles"]]


def cache_key_factors(tree: Path) -> dict[str, Any]:
    """vLLM's own ``cache_key_factors.json`` files, by path relative to the cache root."""
    found = {}
    for path in sorted(tree.rglob("cache_key_factors.json")):
        try:
            found[str(path.relative_to(tree))] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return found


def pass_summary(result: dict[str, Any]) -> dict[str, Any]:
    keep = ("serving", "ready_seconds", "sweep_seconds", "torch_compile_seconds")
    summary = {name: result.get(name) for name in keep}
    summary.update(
        jit_events=result["jit_events"],
        cold_compiles=result["cold_compiles"],
        preload_seconds=result.get("preload_seconds", 0.0),
    )
    return summary


def sweep_plan(workload: VllmWorkload) -> dict[str, Any]:
    return {
        "prompt_lengths": workload.prompt_lengths,
        "batch_sizes": workload.batch_sizes,
        "max_tokens": workload.max_tokens,
    }


def engine_job(workload: Mapping[str, Any]) -> dict[str, Any]:
    """The ``engine`` arguments and request ``sweep`` of a vllm warmer's workload (as a spec
    writes it), for a job of ``python -m kernelcache.toolchains.vllm`` (``drive``)."""
    from kernelcache.spec import Warmer as WarmerSpec

    parsed = WarmerSpec(type="vllm", workload=dict(workload)).vllm_workload()
    return {"engine": parsed.engine_args(), "sweep": sweep_plan(parsed)}


def run_pass(
    workload: VllmWorkload,
    env: dict[str, str],
    sizes: list[int],
    serving: bool,
    timeout: int,
) -> dict[str, Any]:
    """One engine process (``drive``); its result, or a WarmError with its last line."""
    from kernelcache.toolchains import serving_settings

    with tempfile.TemporaryDirectory(prefix="kernelcache-vllm-") as tmp:
        job: dict[str, Any] = {
            "engine": workload.engine_args(),
            "sweep": sweep_plan(workload),
            "runtime": "warm",
            "preload": sizes,
            "result": str(Path(tmp) / "result.json"),
        }
        # A later pass is set up as serving from the generation is.
        child_env = {**serving_settings(), **env} if serving else env
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", __name__, str(job_path)],
                env=child_env,
                stderr=subprocess.PIPE,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise WarmError(f"vllm warmer: an engine pass ran past {timeout} s") from exc
        sys.stderr.write(proc.stderr)  # the engine's own log, after the fact
        result_path = Path(job["result"])
        if proc.returncode != 0 or not result_path.exists():
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            said = lines[-1].strip() if lines else f"exit status {proc.returncode}"
            raise WarmError(f"vllm warmer: engine pass failed: {said}")
        result: dict[str, Any] = json.loads(result_path.read_text())
    result["serving"] = serving
    return result


# ---------------------------------------------------------------------------- one engine


def prompts_for(length: int, batch: int) -> list[dict[str, list[int]]]:
    """``batch`` prompts of ``length`` token ids, the same in every process."""
    import random

    rng = random.Random(length * 100_003 + batch)
    return [
        {"prompt_token_ids": [rng.randrange(10, 30_000) for _ in range(length)]}
        for _ in range(batch)
    ]


class _KeepLines(logging.Handler):
    """vLLM's log lines with their time since the process started (vLLM's own breakdown)."""

    def __init__(self, started: float) -> None:
        super().__init__(level=logging.INFO)
        self.started = started
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((round(record.created - self.started, 3), record.getMessage()))


_TORCH_COMPILE = re.compile(r"torch\.compile took ([0-9.]+) s in total")


def drive(job: dict[str, Any], started: float) -> dict[str, Any]:
    """Start the engine, sweep the declared shapes, and say what it took and compiled."""
    if job["runtime"] == "serving":  # as the serving image's .pth hook does
        from kernelcache.runtime import autoinstall

        autoinstall()
    elif job["runtime"] == "warm":
        triton.watch(strict=False)
        inductor.observe_torch(None, strict=False)
        watch(job["preload"], strict=False)
    else:  # an engine of its own: only vLLM's monitor is counted
        watch([], strict=False)
    import vllm

    imported = time.time()
    logs = _KeepLines(started)
    logging.getLogger("vllm").addHandler(logs)
    llm = vllm.LLM(**job["engine"])
    ready = time.time()
    params = vllm.SamplingParams(
        max_tokens=job["sweep"]["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
    )
    outputs: dict[str, list[list[int]]] = {}
    error = None
    first_generate = None
    sweep_start = time.time()
    try:
        for length in job["sweep"]["prompt_lengths"]:
            for batch in job["sweep"]["batch_sizes"]:
                t = time.time()
                done = llm.generate(prompts_for(length, batch), params, use_tqdm=False)
                first_generate = first_generate or round(time.time() - t, 3)
                outputs[f"{length}x{batch}"] = [list(o.outputs[0].token_ids) for o in done]
    except Exception as exc:  # vLLM's monitor in error mode raises here
        error = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
    finished = time.time()
    compiles = {f"{t}/{k}": v for (t, k), v in metrics.cold_compiles().items()}
    by_toolchain: dict[str, dict[str, float]] = {}
    seconds = metrics.compile_seconds()
    for (toolchain, _), count in metrics.cold_compiles().items():
        entry = by_toolchain.setdefault(toolchain, {"compiled": 0, "seconds": 0.0})
        entry["compiled"] += count
        entry["seconds"] = round(seconds.get(toolchain, 0.0), 3)
    compile_lines = [float(m[1]) for _, line in logs.lines if (m := _TORCH_COMPILE.search(line))]
    return {
        "import_seconds": round(imported - started, 3),
        "ready_at": ready,
        "ready_seconds": round(ready - started, 3),
        "first_generate_seconds": first_generate,
        "sweep_seconds": round(finished - sweep_start, 3),
        "torch_compile_seconds": round(sum(compile_lines), 3) if compile_lines else None,
        "monitor_mode": state.monitor_mode,
        "preload_sizes": state.sizes,
        "preload_seconds": state.preload_seconds,
        "jit_events": state.events,
        "cold_compiles": compiles,
        "compiled_by_toolchain": by_toolchain,
        "sweep_error": error,
        "outputs": outputs,
        "log": logs.lines,
    }


def main(argv: list[str]) -> int:
    started = time.time()
    job = json.loads(Path(argv[0]).read_text())
    result = drive(job, float(os.environ.get("KERNELCACHE_STARTED_AT", started)))
    Path(job["result"]).write_text(json.dumps(result))
    return 0 if result["sweep_error"] is None else 1


# ---------------------------------------------------------------------------- serving


@dataclass
class State:
    """What the hooks saw in this process (read by the warmer's passes and the benchmark)."""

    sizes: list[int] = field(default_factory=list)  # token counts run before the monitor arms
    strict: bool = False
    expected_model: str | None = None
    monitor_mode: str | None = None  # the mode the monitor was armed in
    preload_seconds: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    forward_tokens: int | None = None  # tokens of the forward running now
    worker: Any = None  # the worker warming up, until it has


state = State()


def read_sizes(files: Path) -> list[int]:
    """The token counts a generation's warm recorded; none when it holds no vLLM warm-up."""
    path = files / WARMUP_FILE
    if not path.is_file():
        return []
    sizes = json.loads(path.read_text()).get("sizes", [])
    return sorted({int(n) for n in sizes if isinstance(n, int) and n > 0})


def watch(sizes: list[int], strict: bool, expected_model: str | None = None) -> None:
    """Install the hooks when vLLM's modules are imported (at once where they already are)."""
    state.sizes, state.strict, state.expected_model = sorted(set(sizes)), strict, expected_model
    when_imported("vllm.utils.jit_monitor", _hook_monitor)
    when_imported("vllm.v1.worker.gpu_worker", lambda module: _hook_worker(module.Worker))
    for name in _RUNNERS:
        when_imported(name, lambda module: _hook_runner(module.GPUModelRunner))


def _hook_monitor(module: Any) -> None:
    activate, handle = module.activate, module._handle_jit_event

    def activate_after_preload(*, mode: str = "warn", verbose: bool = False) -> None:
        worker = state.worker
        if worker is not None and state.sizes:
            preload(worker.model_runner, state.sizes)
        state.monitor_mode = "error" if state.strict else mode
        activate(mode=state.monitor_mode, verbose=verbose)

    def handle_counted(
        *, backend: str, event: str, fn_name: str, detail: str | None = None
    ) -> None:
        metrics.record_vllm_jit_event(backend, fn_name)
        state.events.append({"backend": backend, "kernel": fn_name, "tokens": state.forward_tokens})
        handle(backend=backend, event=event, fn_name=fn_name, detail=detail)

    module.activate = activate_after_preload
    module._handle_jit_event = handle_counted


def _hook_worker(worker_class: Any) -> None:
    warm_up, load_model = worker_class.compile_or_warm_up_model, worker_class.load_model

    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        state.worker = self
        try:
            return warm_up(self, *args, **kwargs)
        finally:
            state.worker = None

    def load_model_checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        check_model(str(self.vllm_config.model_config.model))
        return load_model(self, *args, **kwargs)

    worker_class.compile_or_warm_up_model = compile_or_warm_up_model
    worker_class.load_model = load_model_checked


def check_model(model: str) -> None:
    """The engine's model against the generation's ``vllm/model``: its cache names that path."""
    expected = state.expected_model
    if expected is None or model == expected:
        return
    message = (
        f"stamp mismatch: {MODEL_FACTOR}: {expected} != {model} (the engine's model; vLLM's "
        "compile cache was built for the other path)"
    )
    if state.strict:
        raise StampMismatchError(message)
    metrics.STAMP_MISMATCH.set(1)
    log.warning("kernelcache: %s", message)


def _hook_runner(runner_class: Any) -> None:
    execute = runner_class.execute_model

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        state.forward_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            state.forward_tokens = None

    runner_class.execute_model = execute_model


def preload(runner: Any, sizes: list[int]) -> None:
    """One dummy forward per token count, largest first, as vLLM's own warm-up runs them."""
    start = time.perf_counter()
    accepted = inspect.signature(runner._dummy_run).parameters
    options = {"skip_eplb": True} if "skip_eplb" in accepted else {}
    if "remove_lora" in accepted:
        options["remove_lora"] = False
    for size in sorted(sizes, reverse=True):
        runner._dummy_run(size, **options)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    state.preload_seconds = round(time.perf_counter() - start, 3)
    log.info(
        "kernelcache: ran %d warmed forward sizes before vLLM's JIT monitor armed (%.2f s)",
        len(sizes),
        state.preload_seconds,
    )


# ---------------------------------------------------------------------------- the cache root


def recorded_root(manifest: Manifest) -> Path | None:
    """The cache root the generation was built at, or None when it holds no vLLM cache."""
    factors = manifest.stamp.get("factors")
    value = factors.get(FACTOR) if isinstance(factors, Mapping) else None
    return Path(value) if isinstance(value, str) and value else None


def check_env_root(manifest: Manifest, environ: Mapping[str, str]) -> None:
    """Refuse when ``VLLM_CACHE_ROOT`` here names another root than the one built at."""
    root = recorded_root(manifest)
    here = environ.get(ENV)
    if root is not None and here and Path(os.path.expanduser(here)) != root:
        raise StampMismatchError(
            f"stamp mismatch: {FACTOR}: {root} != {here} ({ENV}; vLLM's compile cache holds "
            f"absolute paths: set {ENV}={root} in the pod, as in the compile Job)"
        )


def claim(root: Path) -> None:
    """Make ``root`` an empty directory of kernelcache's own, or refuse a foreign one."""
    from kernelcache.store import io_errors

    if not root.is_absolute() or root == Path(root.anchor):
        raise StorageError(f"{root}: a vLLM cache root must be an absolute path below /")
    with io_errors(root):
        root.mkdir(parents=True, exist_ok=True)
        entries = [entry for entry in root.iterdir() if entry.name != MARKER]
        if entries and not (root / MARKER).is_file():
            raise StorageError(
                f"{root}: vLLM cache root is not empty and not kernelcache's "
                f"(holds {entries[0].name}; give the pod an empty volume there)",
                path=str(root),
            )
        (root / MARKER).write_text("kernelcache materializes vLLM's cache here\n")
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    if not os.access(root, os.W_OK):
        raise StorageError(f"{root}: vLLM cache root is not writable (vLLM writes into it)")


def place(
    generation_copy: Path, manifest: Manifest, root: Path, dropped: Iterable[str] = ()
) -> int:
    """Copy the generation's ``files/vllm`` to ``root`` (claimed first); the files copied.

    ``dropped``: files of the generation the copy left out on purpose (tuning of another GPU).
    """
    from kernelcache.store import FILES_DIR, io_errors

    claim(root)
    source = generation_copy / FILES_DIR / SUBDIR
    with io_errors(root):
        if source.is_dir():
            shutil.copytree(source, root, dirs_exist_ok=True, copy_function=shutil.copyfile)
    if lost := sorted(set(missing(manifest, root)) - set(dropped)):
        raise StorageError(
            f"{root}: {len(lost)} file(s) of the vLLM cache missing after the copy, e.g. {lost[0]}"
        )
    return sum(1 for e in manifest.files if e.path.startswith(f"{SUBDIR}/")) - len(
        [d for d in dropped if d.startswith(f"{SUBDIR}/")]
    )


def missing(manifest: Manifest, root: Path) -> list[str]:
    """The generation's vLLM files that ``root`` lacks or holds with another size."""
    lost = []
    for entry in manifest.files:
        if not entry.path.startswith(f"{SUBDIR}/"):
            continue
        path = root / entry.path.removeprefix(f"{SUBDIR}/")
        try:
            if path.stat().st_size != entry.size:
                lost.append(entry.path)
        except OSError:
            lost.append(entry.path)
    return lost


def factor_diffs(left: Mapping[str, Any], right: Mapping[str, Any]) -> list[str]:
    """vLLM's own ``cache_key_factors.json`` of two warm reports, compared in vLLM's words."""

    def flat(report: Mapping[str, Any]) -> dict[tuple[str, str], Any]:
        found: dict[tuple[str, str], Any] = {}
        for warmer in report.get("warmers") or []:
            for file, factors in (warmer.get("cache_key_factors") or {}).items():
                for name, value in factors.items():
                    if isinstance(value, Mapping):
                        found.update({(file, f"{name}.{k}"): v for k, v in value.items()})
                    else:
                        found[(file, name)] = value
        return found

    a, b = flat(left), flat(right)
    return [
        f"{key[1]}: {a.get(key, '(absent)')} != {b.get(key, '(absent)')} ({key[0]})"
        for key in sorted(set(a) | set(b))
        if a.get(key) != b.get(key)
    ]


class Vllm(Toolchain):
    def serving_env(self, serving: Serving, files: Path) -> dict[str, str]:
        env = super().serving_env(serving, files)
        # A vLLM cache is read at the absolute root it was built at, never from files/vllm.
        if serving.manifest is not None and recorded_root(serving.manifest) is not None:
            env.pop(ENV)
        return env

    def check_generation(self, manifest: Manifest, strict: bool) -> None:
        """vLLM reads its cache at the root it was built at: the init-container put it there."""
        root = recorded_root(manifest)
        if root is None or not (lost := missing(manifest, root)):
            return
        error = StorageError(
            f"{root}: the vLLM cache root lacks {len(lost)} of the generation's files, e.g. "
            f"{lost[0]} (kernelcache verify --materialize puts them there)",
            path=str(root),
        )
        if strict:
            raise error
        log.warning("kernelcache: %s; vLLM will compile what is missing", error.message)

    def observe(self, serving: Serving) -> None:
        factors = serving.manifest.stamp.get("factors", {}) if serving.manifest else {}
        sizes = read_sizes(serving.files) if serving.files is not None else []
        watch(sizes, serving.config.strict, factors.get(MODEL_FACTOR))


TOOLCHAIN = Vllm(
    name="vllm",
    cache_env={ENV: SUBDIR},
    warmers=(VllmWarmer,),
    requires=("vllm", "vllm"),
)


if __name__ == "__main__":  # one engine process: run as this package's module, whose state
    from kernelcache.toolchains.vllm import main as drive_main  # the runtime's hooks fill

    sys.exit(drive_main(sys.argv[1:]))
