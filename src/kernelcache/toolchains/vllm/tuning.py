"""Fused-MoE configs tuned on the compile Job's GPU: a bounded search per MoE shape.

vLLM runs its fused-MoE Triton kernel with a config (tile sizes, warps, stages) picked per
token count from a table it ships per (experts, intermediate size, dtype, GPU product), or
from a generic default where it ships none: on a shape or GPU it has no table for, every MoE
layer runs with tiles chosen for no GPU in particular. vLLM's own tuner times about a
thousand configs per batch size (hours). Here, in the compile Job's engine core (the model
loaded, before vLLM's warm-up), each MoE shape that needs it gets a local search that fits a
budget (``search``): per batch bucket, the baseline (the shipped entry, else vLLM's default),
the last bucket's winner and other GPUs' shipped entries for the shape as seeds, then one
step along each tile parameter from the best until no step is faster or the bucket's share
of the budget is spent. A candidate runs through the layer's own forward (vLLM's
``override_config``), so what is timed is what serving runs; its compiles go to a scratch
Triton cache, not the generation. The winner is timed again against the baseline, side by
side, and is kept only when faster.

The table is written in vLLM's format and file name to ``VLLM_TUNED_CONFIG_FOLDER`` (the
generation's ``files/vllm-moe``): vLLM reads it before its shipped tables, in the warm's
later passes (which enumerate coverage with it) and in serving. It holds for one GPU
product, so the files are tuning (``gpu_product`` scopes them, as other tuning). Only bf16
and fp16 layers on vLLM's unquantized Triton experts at tensor parallel 1 are tuned; every
shape not tuned is named in the report with why.

Nothing here imports vLLM or torch at module level: ``tune`` is handed vLLM's objects.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernelcache.toolchains.vllm import adapter, coverage

log = logging.getLogger(__name__)

SUBDIR = "vllm-moe"  # files/vllm-moe: VLLM_TUNED_CONFIG_FOLDER
# The values the search steps through (vLLM's own tuner's grid, benchmark_moe.py).
SPACE: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128, 256),
    "BLOCK_SIZE_N": (32, 64, 128, 256),
    "BLOCK_SIZE_K": (64, 128, 256),
    "GROUP_SIZE_M": (1, 16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4, 5),
}
# vLLM's tuner's batch sizes; the tables it ships are keyed by them.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
BETTER = 0.98  # a step is taken when it is at least 2% faster: closer is noise
UNQUANTIZED = "UnquantizedFusedMoEMethod"

Config = dict[str, int]
Measure = Callable[[Config, int], float | None]  # seconds per forward, None: cannot run


def key(config: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((name, int(value)) for name, value in config.items()))


def neighbors(config: Config) -> Iterator[Config]:
    """The configs one step away along one parameter of ``SPACE``."""
    for name, values in SPACE.items():
        current = config.get(name, values[0])
        below = [v for v in values if v < current]
        above = [v for v in values if v > current]
        for value in below[-1:] + above[:1]:
            yield {**config, name: value}


def layer_inputs(layer: Any, tokens: int) -> tuple[Any, Any]:
    """Random hidden states and router logits for ``tokens`` tokens, on the layer's device."""
    import torch

    config = layer.moe_config
    device = torch.device(config.device)
    hidden = torch.randn(tokens, config.hidden_dim, dtype=config.in_dtype, device=device)
    logits_dtype = getattr(config, "router_logits_dtype", None) or config.in_dtype
    logits = torch.randn(tokens, config.num_experts, dtype=logits_dtype, device=device)
    return hidden, logits


def forward(vllm_config: Any, layer: Any, index: int, hidden: Any, logits: Any) -> None:
    """The layer's forward on these inputs, as the model's forward calls it: from outside the
    model, which leaves layer state behind (a shared expert's output slot), so the engine that
    tuned serves nothing afterwards (``hooks.prepare``)."""
    import torch
    from vllm.forward_context import get_forward_context, set_forward_context

    tokens = int(hidden.shape[0])
    with torch.inference_mode(), set_forward_context(None, vllm_config, num_tokens=tokens):
        context = get_forward_context()
        if hasattr(context, "moe_layer_index"):
            context.moe_layer_index = index
        layer.forward(hidden, logits)


def buckets(bound: int) -> list[int]:
    """The batch buckets a table for an engine of ``bound`` tokens per forward holds."""
    inside = [n for n in BUCKETS if n <= bound]
    return inside if bound in inside or bound > BUCKETS[-1] else [*inside, bound]


class Budget:
    """Seconds left for the whole search, shared out evenly over the buckets not yet tuned."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.deadline = clock() + seconds

    def left(self) -> float:
        return max(0.0, self.deadline - self.clock())

    def share(self, buckets_left: int) -> float:
        return self.left() / max(1, buckets_left)


@dataclass
class Bucket:
    """One batch bucket's outcome: the baseline and the winner, timed side by side."""

    tokens: int
    baseline_ms: float | None
    tuned_ms: float | None
    config: Config
    tried: int
    rejected: int
    stopped: str  # "converged" or "budget"

    @property
    def gain(self) -> float | None:
        if not self.baseline_ms or not self.tuned_ms:
            return None
        return round(1 - self.tuned_ms / self.baseline_ms, 4)


def search(
    measure: Measure,
    sizes: Sequence[int],
    baseline: Callable[[int], Config],
    seeds: Callable[[int], list[Config]],
    budget: Budget,
    progress: Callable[[int, Bucket], None] = lambda index, bucket: None,
) -> list[Bucket]:
    """Each bucket in turn (``tune_bucket``), its share of the budget what is left over the
    buckets left, the last bucket's winner a seed of the next."""
    results: list[Bucket] = []
    for index, tokens in enumerate(sizes):
        until = budget.clock() + budget.share(len(sizes) - index)
        previous = [results[-1].config] if results else []
        bucket = tune_bucket(
            measure, tokens, baseline(tokens), [*previous, *seeds(tokens)], budget.clock, until
        )
        results.append(bucket)
        progress(index, bucket)
    return results


def tune_bucket(
    measure: Measure,
    tokens: int,
    base: Config,
    seeds: list[Config],
    clock: Callable[[], float],
    until: float,
) -> Bucket:
    """The baseline, the seeds, then steps from the best while one is faster and time lasts;
    the winner timed again against the baseline and kept only when it is still faster."""
    times: dict[tuple[tuple[str, int], ...], float | None] = {key(base): measure(base, tokens)}
    best, stopped = base, "converged"
    pending, improved = seeds, True
    while improved and stopped == "converged":
        improved = False
        for candidate in [*pending, *neighbors(best)]:
            if key(candidate) in times:
                continue
            if clock() >= until:
                stopped = "budget"
                break
            took = times[key(candidate)] = measure(candidate, tokens)
            best_time = times[key(best)]
            if took is not None and (best_time is None or took < best_time * BETTER):
                best, improved = candidate, True
        pending = []
    baseline_ms, tuned_ms = _side_by_side(measure, base, best, tokens)
    if tuned_ms is not None and baseline_ms is not None and tuned_ms >= baseline_ms:
        best, tuned_ms = base, baseline_ms  # not faster when timed again: keep the baseline
    rejected = sum(1 for t in times.values() if t is None)
    return Bucket(tokens, baseline_ms, tuned_ms, best, len(times), rejected, stopped)


def _side_by_side(
    measure: Measure, base: Config, best: Config, tokens: int, rounds: int = 3
) -> tuple[float | None, float | None]:
    """Median milliseconds of each, timed in alternation (the same clocks, the same heat)."""
    if key(base) == key(best):
        took = measure(base, tokens)
        return (_ms(took), _ms(took))
    base_times: list[float] = []
    best_times: list[float] = []
    for _ in range(rounds):
        for config, into in ((base, base_times), (best, best_times)):
            took = measure(config, tokens)
            if took is not None:
                into.append(took)
    return (
        _ms(statistics.median(base_times)) if base_times else None,
        _ms(statistics.median(best_times)) if best_times else None,
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 5)


def table(results: Sequence[Bucket], triton_version: str) -> dict[str, Any]:
    """The buckets' winners as vLLM reads a tuned table (``get_moe_configs``)."""
    data: dict[str, Any] = {"triton_version": triton_version}
    data.update({str(bucket.tokens): bucket.config for bucket in results})
    return data


# ---------------------------------------------------------------------------- in the engine


@dataclass
class Shape:
    """One distinct MoE layer shape, as vLLM names its config table."""

    signature: str
    index: int
    layer: Any
    experts: int
    intermediate: int  # N in vLLM's table names: w2's last dimension
    hidden: int
    top_k: int
    file: str = ""
    shipped: dict[int, Config] | None = None
    why_not: str = ""  # set when the shape cannot be tuned

    @property
    def label(self) -> str:
        return f"E={self.experts},N={self.intermediate}"


@dataclass
class Report:
    """What the tuning did, per shape (``VllmReport.moe_tuning``)."""

    mode: str
    budget_seconds: int
    device: str = ""
    timing: str = ""  # how a candidate was timed: cuda graphs, cuda events, wall clock
    seconds: float = 0.0
    shapes: list[dict[str, Any]] = field(default_factory=list)


def tuned(report: Mapping[str, Any] | None) -> list[str]:
    """The tables a pass's tuning wrote (its ``Report`` as the engine core dumped it)."""
    shapes = report.get("shapes", []) if report else []
    return [shape["file"] for shape in shapes if shape.get("tuned")]


def ran_layers(report: Mapping[str, Any] | None) -> bool:
    """Whether the tuning ran a MoE layer (timed a bucket): its engine then serves nothing."""
    return any(shape.get("buckets") for shape in (report or {}).get("shapes", []))


def summary(report: Mapping[str, Any] | None) -> str:
    """One line of what a warm's tuning did per shape (``kernelcache inspect`` and
    ``explain`` show it beside the coverage)."""
    said = []
    for shape in report.get("shapes", []) if report else []:
        if not shape.get("tuned"):
            said.append(f"{shape['file'] or shape['shape']}: not tuned ({shape['why']})")
            continue
        gains = [b["gain"] for b in shape["buckets"] if b.get("gain")]
        best = f", up to {max(gains):.1%}" if gains else ""
        said.append(
            f"{shape['file']}: tuned against vLLM's {shape['baseline']} table, "
            f"{len(gains)} of {len(shape['buckets'])} buckets faster{best}"
        )
    return "; ".join(said)


def shape_of(signature: str, index: int, layer: Any, tensor_parallel: int) -> Shape:
    """The shape's table name and shipped table, or why it cannot be tuned here."""
    experts = adapter.routed_experts(layer)
    # A quantized method registers other weights (w2_weight_packed, scales): none to tune.
    w2 = getattr(experts, "w2_weight", None)
    config = layer.moe_config
    if w2 is None:
        return Shape(signature, index, layer, 0, 0, 0, 0, why_not="no unquantized expert weights")
    count, hidden, intermediate = (int(n) for n in w2.shape)
    shape = Shape(signature, index, layer, count, intermediate, hidden, config.experts_per_token)
    method = adapter.base_quant_method(experts.quant_method)
    dtype = str(config.in_dtype).removeprefix("torch.")
    if type(method).__name__ != UNQUANTIZED or dtype not in ("bfloat16", "float16"):
        shape.why_not = f"{type(method).__name__} {dtype}: only bf16/fp16 unquantized is tuned"
    elif tensor_parallel != 1:
        shape.why_not = f"tensor parallel {tensor_parallel}: tuning runs at tensor parallel 1"
    shape.file = adapter.moe_module().get_config_file_name(count, intermediate, None)
    shipped = shipped_folder() / shape.file
    if shipped.is_file():
        data = json.loads(shipped.read_text())
        shape.shipped = {int(k): v for k, v in data.items() if k.isdigit()}
    return shape


def shipped_folder() -> Path:
    """Where vLLM keeps the config tables it ships."""
    return Path(str(adapter.moe_module().__file__)).parent / "configs"


def other_gpus(shape: Shape) -> list[dict[int, Config]]:
    """The tables vLLM ships for this shape on other GPU products: seeds, not answers."""
    folder = shipped_folder()
    found = []
    for path in sorted(folder.glob(f"E={shape.experts},N={shape.intermediate},device_name=*.json")):
        if path.name == shape.file or ",dtype=" in path.name:
            continue
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            found.append({int(k): v for k, v in data.items() if k.isdigit()})
    return found


def nearest(known: Mapping[int, Config], tokens: int) -> Config:
    """The entry vLLM picks for ``tokens``: the key closest to it."""
    return dict(known[min(known, key=lambda n: abs(n - tokens))])


def timer(vllm_config: Any, shape: Shape, scratch: str, report: Report) -> Measure:
    """Seconds per forward of the shape's layer under a config, on its own inputs per bucket
    (its compiles in the ``scratch`` Triton cache); None when the config cannot run (too much
    shared memory, a compile error).

    On a GPU the forward is replayed from a CUDA graph, as serving runs it: launched one by
    one, a small batch's forward is bound by the CPU's launches, and every config times the
    same. Where a graph cannot be captured, CUDA events time plain launches (``report``
    says which)."""
    import torch
    from triton import knobs

    override = adapter.override_config()
    inputs: dict[int, tuple[Any, Any]] = {}
    cuda = torch.cuda.is_available()
    report.timing = "cuda graphs" if cuda else "wall clock"

    def once(tokens: int) -> None:
        if tokens not in inputs:
            inputs.clear()
            inputs[tokens] = layer_inputs(shape.layer, tokens)
        forward(vllm_config, shape.layer, shape.index, *inputs[tokens])

    def measure(config: Config, tokens: int) -> float | None:
        with override(dict(config)), knobs.cache.scope():
            knobs.cache.dir = scratch
            try:
                once(tokens)  # compiles, and warms
            except Exception as exc:  # out of resources, a compile error: not a candidate
                log.debug("kernelcache: MoE tuning: %s for %d tokens: %s", config, tokens, exc)
                return None
            if report.timing == "cuda graphs":
                try:
                    return _graph_timed(lambda: once(tokens), torch)
                except RuntimeError as exc:  # the forward cannot be captured here
                    log.warning("kernelcache: MoE tuning: CUDA graph capture failed (%s): "
                                "timing launches", str(exc).splitlines()[0])  # fmt: skip
                    report.timing = "cuda events"
            first = _timed(lambda: once(tokens), 1, torch if cuda else None)
            reps = max(3, min(50, int(0.02 / max(first, 1e-6))))
            return _timed(lambda: once(tokens), reps, torch if cuda else None)

    return measure


def _graph_timed(run: Callable[[], None], torch: Any, per_graph: int = 10) -> float:
    """Median seconds of one ``run`` over 5 replays of a CUDA graph of ``per_graph`` runs."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            run()
    graph.replay()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1000 / per_graph)
    del graph
    return statistics.median(samples)


def _timed(run: Callable[[], None], reps: int, torch: Any) -> float:
    """Median seconds of ``reps`` runs (CUDA events on a GPU, else the wall clock)."""
    samples = []
    for _ in range(reps):
        if torch is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            run()
            samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def tune(vllm_config: Any, mode: str, budget_seconds: int) -> Report:
    """Tune each MoE shape of the engine that ``mode`` asks for; write the tables where vLLM
    reads them first (``VLLM_TUNED_CONFIG_FOLDER``) and make vLLM read them again."""
    module = adapter.moe_module()
    report = Report(mode, budget_seconds, device=coverage.config_device())
    folder = os.environ.get(coverage.TUNED_FOLDER_ENV)
    started = time.monotonic()
    tensor_parallel = int(vllm_config.parallel_config.tensor_parallel_size)
    shapes = [shape_of(s, i, x, tensor_parallel) for s, i, x in coverage.moe_layers(vllm_config)]
    for shape in shapes:
        if not shape.why_not and mode == "auto" and shape.shipped:
            shape.why_not = f"vLLM ships {shape.file} (mode auto)"
        if not shape.why_not and not folder:
            shape.why_not = f"{coverage.TUNED_FOLDER_ENV} is not set: nowhere to keep a table"
        if not shape.why_not and not adapter.is_cuda():
            shape.why_not = "no GPU: a table is measured on the GPU product it is for"
        if shape.why_not:
            report.shapes.append(
                {"shape": shape.signature, "file": shape.file, "tuned": False,
                 "why": shape.why_not}
            )  # fmt: skip
            log.info("kernelcache: MoE tuning: %s not tuned: %s", shape.label, shape.why_not)
    todo = [shape for shape in shapes if not shape.why_not]
    budget = Budget(budget_seconds)
    scratch = tempfile.mkdtemp(prefix="kernelcache-moe-tuning-")
    try:
        for number, shape in enumerate(todo):
            share = Budget(budget.left() / (len(todo) - number))
            entry = tune_shape(vllm_config, shape, share, scratch, Path(str(folder)), report)
            report.shapes.append(entry)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if todo:
        module.get_moe_configs.cache_clear()  # vLLM reads its tables again: the tuned ones
    report.seconds = round(time.monotonic() - started, 1)
    return report


def tune_shape(
    vllm_config: Any, shape: Shape, budget: Budget, scratch: str, folder: Path, report: Report
) -> dict[str, Any]:
    """One shape's table, searched within ``budget`` and written (atomically) to ``folder``;
    what the report says of it."""
    import triton

    module = adapter.moe_module()
    others = other_gpus(shape)
    baseline_name = "shipped" if shape.shipped else "default"
    sizes = buckets(int(vllm_config.scheduler_config.max_num_batched_tokens))

    def baseline(tokens: int) -> Config:
        if shape.shipped:
            return nearest(shape.shipped, tokens)
        default = module.get_default_config(
            tokens, shape.experts, shape.intermediate, shape.hidden, shape.top_k, None
        )
        return {k: int(v) for k, v in default.items() if k in SPACE}

    def seeds(tokens: int) -> list[Config]:
        return [{k: int(v) for k, v in nearest(t, tokens).items() if k in SPACE} for t in others]

    def progress(index: int, bucket: Bucket) -> None:
        gain = f"{bucket.gain:+.1%}" if bucket.gain is not None else "?"
        log.info(
            "kernelcache: MoE tuning %s [%d/%d] %d tokens: %s ms against %s %s ms (%s); "
            "%d configs (%s); %.0f s of its budget left",
            shape.label, index + 1, len(sizes), bucket.tokens, bucket.tuned_ms, baseline_name,
            bucket.baseline_ms, gain, bucket.tried, bucket.stopped, budget.left(),
        )  # fmt: skip

    began = time.monotonic()
    measure = timer(vllm_config, shape, scratch, report)
    results = search(measure, sizes, baseline, seeds, budget, progress)
    target = folder / shape.file
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(table(results, triton.__version__), indent=1) + "\n")
    os.replace(partial, target)
    return {
        "shape": shape.signature,
        "file": shape.file,
        "tuned": True,
        "baseline": baseline_name,
        "seconds": round(time.monotonic() - began, 1),
        "buckets": [{**asdict(b), "gain": b.gain} for b in results],
    }
