"""In every vLLM process: kernelcache's hooks into vLLM's worker, model runner and JIT monitor,
installed when vLLM's own modules are imported (``watch``), and what they saw written for the
warm and the bench (``dump``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernelcache.errors import ColdCompileError, StampMismatchError
from kernelcache.runtime import metrics, ready
from kernelcache.runtime.imports import when_imported
from kernelcache.toolchains import flashinfer
from kernelcache.toolchains.vllm import adapter, coverage, tuning
from kernelcache.toolchains.vllm.cache_root import ENV, MODEL_FACTOR, PLAN_DIR
from kernelcache.toolchains.vllm.coverage import Coverage

log = logging.getLogger(__name__)


WARMUP_SUBDIR = "vllm-warmup"
WARMUP_FILE = f"{WARMUP_SUBDIR}/sizes.json"


@dataclass
class State:
    """What the hooks saw in this process, written to ``state_dir`` for the warm and bench."""

    sizes: list[int] = field(default_factory=list)  # token counts run before the monitor arms
    coverage: Coverage | None = None  # replayed before the monitor arms (serving)
    enumerate: bool = False  # the warm's enumerating pass: enumerate the coverage instead
    enumerated: dict[str, Any] | None = None
    coverage_seconds: float | None = None
    tuning: dict[str, Any] | None = None  # the warm's first pass: tune (mode, budget_seconds)
    tuned: dict[str, Any] | None = None  # what the tuning did (``tuning.Report``)
    strict: bool = False
    expected_model: str | None = None
    monitor_mode: str | None = None  # the mode the monitor was armed in
    preload_seconds: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    forward_tokens: int | None = None  # tokens of the forward running now
    forward_batch: str | None = None  # the batch it runs, in words (``describe``)
    worker: Any = None  # the worker warming up, until it has
    startup_plan: dict[str, Any] | None = None  # whether vLLM applied its startup plan
    state_dir: Path | None = None
    vllm_imported_at: float | None = None
    # What the parent process compiled (before a fork), and the tuning's candidates (compiled
    # into a scratch cache): not this process's kernels.
    compiles_not_counted: dict[tuple[str, str], float] = field(default_factory=dict)
    dumped: tuple[Any, ...] = ()
    tuning_ended: bool = False  # the engine that tuned stops after it (``prepare``)


state = State()


def read_sizes(files: Path) -> list[int]:
    """The token counts a generation's warm recorded; none when it holds no vLLM warm-up."""
    path = files / WARMUP_FILE
    if not path.is_file():
        return []
    sizes = json.loads(path.read_text()).get("sizes", [])
    return sorted({int(n) for n in sizes if isinstance(n, int) and n > 0})


def watch(
    sizes: list[int],
    strict: bool,
    expected_model: str | None = None,
    state_dir: Path | None = None,
    replayed: Coverage | None = None,
    enumerate_coverage: bool = False,
    moe_tuning: dict[str, Any] | None = None,
) -> None:
    """Install the hooks when vLLM's modules are imported (at once where they already are).

    ``replayed``: the coverage loaded before the monitor arms (``coverage.replay``);
    ``enumerate_coverage``: enumerate it there instead (the warm's first pass);
    ``moe_tuning``: tune the fused-MoE tables before vLLM's warm-up (``tuning.tune``), and
    leave the enumeration to the next pass when a table was written.

    vLLM's engine core is a process of its own (forked by ``vllm serve``, or spawned, when
    the runtime's ``.pth`` hook installs these again): the hooks work wherever the model
    runs, and each process writes what it saw to ``state_dir`` under its own pid.
    """
    state.sizes, state.strict, state.expected_model = sorted(set(sizes)), strict, expected_model
    state.state_dir = state_dir
    state.coverage, state.enumerate = replayed, enumerate_coverage
    state.tuning = moe_tuning
    os.register_at_fork(after_in_child=_forked)
    when_imported("triton", lambda _: coverage.loads.install())
    when_imported(adapter.ARG_UTILS, _imported)
    when_imported(adapter.JIT_MONITOR, _hook_monitor)
    when_imported(adapter.GPU_WORKER, _hook_worker_module)
    for name in adapter.RUNNERS:
        when_imported(name, lambda module: _hook_runner(getattr(module, adapter.RUNNER_CLASS)))


def _log_beside_vllm() -> None:
    """kernelcache's INFO lines (the tuning's progress, the coverage loaded) on stderr beside
    vLLM's own, in the process where the model runs: vLLM logs through a logger of its own,
    so without this only warnings pass."""
    logger = logging.getLogger("kernelcache")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _imported(module: Any) -> None:
    """When vLLM's engine arguments were importable: the end of vllm serve's import (torch,
    vLLM), which every start pays and ``ready - import`` leaves out."""
    state.vllm_imported_at = state.vllm_imported_at or time.time()
    dump(force=True)


def _forked() -> None:
    """A forked child counts from here: what the parent counted is the parent's."""
    state.compiles_not_counted = dict(metrics.cold_compiles())
    state.events, state.dumped = [], ()


def dump(force: bool = False) -> None:
    """This process's state to ``state_dir/vllm-<pid>.json``, when it changed (atomically)."""
    if state.state_dir is None:
        return
    compiles = {
        key: count - state.compiles_not_counted.get(key, 0)
        for key, count in metrics.cold_compiles().items()
        if count - state.compiles_not_counted.get(key, 0) > 0
    }
    loaded = flashinfer.loads
    signature = (
        len(state.events),
        sum(compiles.values()),
        state.monitor_mode,
        bool(state.startup_plan),
        len(loaded.modules),
        len(loaded.builds),
        state.tuned is not None,
    )
    if signature == state.dumped and not force:
        return
    seconds = metrics.compile_seconds()
    by_toolchain: dict[str, dict[str, float]] = {}
    for (toolchain, _), count in compiles.items():
        entry = by_toolchain.setdefault(toolchain, {"compiled": 0, "seconds": 0.0})
        entry["compiled"] += count
        entry["seconds"] = round(seconds.get(toolchain, 0.0), 3)
    data = {
        "pid": os.getpid(),
        "vllm_imported_at": state.vllm_imported_at,
        "monitor_mode": state.monitor_mode,
        "sizes": state.sizes,
        "preload_seconds": state.preload_seconds,
        "coverage": state.enumerated,
        "coverage_seconds": state.coverage_seconds,
        "moe_tuning": state.tuned,
        "tuning_ended": state.tuning_ended,
        "events": state.events,
        "startup_plan": state.startup_plan,
        "cold_compiles": {f"{t}/{k}": v for (t, k), v in compiles.items()},
        "compiled_by_toolchain": by_toolchain,
        "flashinfer_modules": sorted(loaded.modules),
        "flashinfer_builds": loaded.builds,
    }
    path = state.state_dir / f"vllm-{os.getpid()}.json"
    with contextlib.suppress(OSError):
        state.state_dir.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(data))
        os.replace(path.with_suffix(".tmp"), path)
    state.dumped = signature


def _hook_monitor(module: Any) -> None:
    activate, handle = module.activate, module._handle_jit_event

    def activate_after_preload(*, mode: str = "warn", verbose: bool = False) -> None:
        worker = state.worker
        if worker is not None:
            if state.sizes:
                preload(worker.model_runner, state.sizes)
            if state.enumerate:
                enumerate_coverage(worker, worker.vllm_config)
            else:
                cover(worker, worker.vllm_config)
        # Ready from here: a compile is served and counted, not refused (``runtime.ready``).
        ready.mark_ready()
        state.monitor_mode = mode
        activate(mode=state.monitor_mode, verbose=verbose)
        dump()

    def handle_counted(
        *, backend: str, event: str, fn_name: str, detail: str | None = None
    ) -> None:
        metrics.record_vllm_jit_event(backend, fn_name, state.forward_tokens)
        state.events.append(
            {
                "backend": backend,
                "kernel": fn_name,
                "tokens": state.forward_tokens,
                "batch": state.forward_batch,
            }
        )
        dump()
        handle(backend=backend, event=event, fn_name=fn_name, detail=detail)

    module.activate = activate_after_preload
    module._handle_jit_event = handle_counted


def prepare(vllm_config: Any) -> None:
    """The model loaded and nothing run yet: tune the MoE tables, when asked. The tuning runs
    MoE layers from outside the model, which leaves layer state behind (a shared expert's
    output slot, a config vLLM cached), so the engine that tuned serves nothing afterwards: it
    says so, writes what it did and ends here; a fresh engine, reading the tables, builds the
    cache in the next pass."""
    if state.tuning is None:
        return
    tune_moe(vllm_config, state.tuning)
    if not tuning.ran_layers(state.tuned):
        return  # nothing ran from outside: this engine goes on as the cold pass
    state.tuning_ended = True
    log.info(
        "kernelcache: the engine that tuned the MoE tables ends here (its layers were run from "
        "outside the model); a fresh engine reads the tables in the next pass"
    )
    dump(force=True)
    logging.shutdown()
    os._exit(0)


def enumerate_coverage(worker: Any, vllm_config: Any) -> None:
    """The warm's enumerating pass, right before the monitor arms: every batch shape at every
    token count through the model runner's own dummy forward (``coverage``)."""
    enumerated = coverage.enumerate_forwards(worker, vllm_config)
    state.enumerated = asdict(enumerated)
    state.coverage_seconds = enumerated.seconds
    dump(force=True)  # the enumeration changes nothing dump() compares


def cover(worker: Any, vllm_config: Any) -> None:
    """Replay the generation's coverage: a kernel it lacks fails the start here, before the
    engine is ready; so does a generation with named gaps when the KernelCache demands full
    coverage and serving is strict."""
    recorded = state.coverage
    if recorded is None:
        return
    try:
        if not recorded.replayable:
            log.warning(
                "kernelcache: the generation's coverage was recorded by %s, which this "
                "kernelcache does not replay: rebuild the KernelCache",
                recorded.method,
            )
            return
        if recorded.gaps and recorded.full_coverage_required:
            raise ColdCompileError(
                f"vllm coverage: the generation names {len(recorded.gaps)} kernel(s) the warm "
                f"still met after ready (e.g. {recorded.gap_lines()[0]}) and the KernelCache "
                "demands full coverage"
            )
        state.coverage_seconds = coverage.replay(worker, vllm_config, recorded)
    except ColdCompileError as exc:
        metrics.record_verify_failure("coverage")
        if state.strict:
            raise
        log.warning("kernelcache: %s; the engine compiles what is missing", exc)
        return
    log.info(
        "kernelcache: coverage loaded before the engine is ready: %d kernels, %d forwards "
        "replayed in %.2f s%s",
        len(recorded.specializations()),
        len(recorded.representatives()),
        state.coverage_seconds,
        f"; {len(recorded.gaps)} named gap(s): {recorded.gap_lines()[0]}" if recorded.gaps else "",
    )
    dump()


def tune_moe(vllm_config: Any, settings: Mapping[str, Any]) -> None:
    """Tune the MoE tables (``tuning``); the candidates' compiles are not the generation's
    kernels, so they are not counted."""
    before = metrics.cold_compiles()
    said = logging.getLogger(metrics.__name__)
    level = said.level
    said.setLevel(logging.ERROR)  # a candidate's compile is no news
    try:
        report = tuning.tune(vllm_config, str(settings["mode"]), int(settings["budget_seconds"]))
    finally:
        said.setLevel(level)
    for name, count in metrics.cold_compiles().items():
        if added := count - before.get(name, 0):
            state.compiles_not_counted[name] = state.compiles_not_counted.get(name, 0) + added
    state.tuned = asdict(report)
    dump()


def _hook_worker_module(module: Any) -> None:
    _log_beside_vllm()
    worker_class = module.Worker
    warm_up, load_model = worker_class.compile_or_warm_up_model, worker_class.load_model

    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        state.worker = self
        try:
            return warm_up(self, *args, **kwargs)
        finally:
            state.worker = None
            dump()

    def load_model_checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        check_model(str(self.vllm_config.model_config.model))
        loaded = load_model(self, *args, **kwargs)
        prepare(self.vllm_config)
        return loaded

    worker_class.compile_or_warm_up_model = compile_or_warm_up_model
    worker_class.load_model = load_model_checked
    module.maybe_apply_startup_plan = _plan_checked(module.maybe_apply_startup_plan)


def _plan_checked(apply: Any) -> Any:
    """vLLM's ``maybe_apply_startup_plan``, then say whether the plan was applied: vLLM only
    logs at INFO that a node with less free memory than the plan recorded profiles again."""

    def apply_and_say(worker: Any) -> None:
        apply(worker)
        if os.environ.get("VLLM_ENABLE_STARTUP_PLAN") != "1":
            return
        plan_dir = Path(os.path.expanduser(os.environ.get(ENV, "~/.cache/vllm"))) / PLAN_DIR
        plans = sorted(plan_dir.glob("startup_plan_*.json")) if plan_dir.is_dir() else []
        applied = worker.cache_config.kv_cache_memory_bytes is not None
        free = int(worker.init_snapshot.free_memory)
        baselines = []
        for path in plans:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                baselines.append(int(json.loads(path.read_text())["free_memory_baseline"]))
        state.startup_plan = {
            "applied": applied,
            "plans": len(plans),
            "free_bytes": free,
            "baselines": baselines,
        }
        if plans and not applied:
            lower = [b for b in baselines if free < b]
            why = (
                f"this GPU has {free / 2**30:.2f} GiB free, the plan recorded "
                f"{min(lower) / 2**30:.2f} GiB"
                if lower
                else "no plan of the generation fits this engine's config and GPU"
            )
            state.startup_plan["reason"] = why
            log.warning(
                "kernelcache: vLLM's startup plan from the generation was not applied (%s): "
                "vLLM profiles memory instead",
                why,
            )
        dump()

    return apply_and_say


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
        state.forward_tokens = adapter.scheduled_tokens(scheduler_output)
        state.forward_batch = describe(scheduler_output)
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            state.forward_tokens = state.forward_batch = None
            dump()

    runner_class.execute_model = execute_model


def describe(scheduler_output: Any) -> str | None:
    """A served batch in words (how many requests, new or continued, the longest query and
    how many new requests came with cached context): where a gap was met."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
    if not isinstance(scheduled, Mapping) or not scheduled:
        return None
    new = list(getattr(scheduler_output, "scheduled_new_reqs", None) or [])
    with_context = sum(1 for r in new if int(getattr(r, "num_computed_tokens", 0) or 0) > 0)
    queries = [int(n) for n in scheduled.values()]
    return (
        f"{sum(queries)} tokens in {len(queries)} requests ({len(new)} new, {with_context} of "
        f"them with cached context); longest query {max(queries)}, "
        f"{sum(1 for n in queries if n == 1)} of one token"
    )


def preload(runner: Any, sizes: list[int]) -> None:
    """One dummy forward per token count, largest first, as vLLM's own warm-up runs them."""
    start = time.perf_counter()
    options = adapter.dummy_run_options(runner._dummy_run)
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
