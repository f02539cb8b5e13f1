"""vLLM in a serving process: load the warmed shapes before vLLM's JIT monitor arms, count what
the monitor sees, and hold the engine to the model the generation was built for.

vLLM arms its own JIT monitor (``vllm.utils.jit_monitor.activate``) at the end of its warm-up.
From then on every Triton kernel the process loads for the first time counts as a JIT, whether
it is compiled or read from Triton's disk cache: the monitor listens on Triton's
``jit_post_compile_hook``, which fires on every miss of the in-memory kernel cache. vLLM's
warm-up runs the CUDA-graph sizes and the compile ranges' ends, not every token count a served
batch has, so a fused-MoE kernel specialized for a prefill size the warm-up did not run is
first loaded at the first such request (and ``jit_monitor_mode="error"`` stops the engine
there). No cache on disk can change that; only running the shape before the monitor arms can.

So the vllm warmer records the token counts of the forwards at which the monitor fired
(``WARMUP_FILE`` in the generation), and here, in serving, one dummy forward per recorded size
runs just before the monitor arms (inside ``Worker.compile_or_warm_up_model``). Strict mode
arms the monitor in ``error`` mode whatever the engine was given. Every monitor event is
counted (``kernelcache_vllm_jit_events_total``) and kept in ``events`` with the token count of
the forward it happened in.

Nothing here imports vLLM: each hook is installed when vLLM's own module is imported.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelcache.errors import StampMismatchError
from kernelcache.runtime import metrics
from kernelcache.runtime.imports import when_imported

log = logging.getLogger(__name__)

WARMUP_FILE = "vllm-warmup/sizes.json"
MODEL_FACTOR = "vllm/model"
_RUNNERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


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
