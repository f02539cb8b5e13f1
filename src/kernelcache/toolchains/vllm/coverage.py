"""Coverage by enumeration through the engine's own forward: every kernel the engine's
configuration lets a batch load, loaded before the engine is ready.

A Triton kernel is specialized on what its arguments are at the call: the config vLLM picks
for the token count, integers divisible by 16 or equal to 1, and which path the batch takes
(MLA's attention, for one, runs other kernels for a prefill whose batch mixes requests with
and without context). Which batches a server forms depends on how requests arrive, so a
replayed sweep only samples them, and calling layers from outside both misses what the batch
selects and leaves the engine's state behind (DeepSeek's shared experts). So the warm drives
the engine's worker itself, with batches shaped as its scheduler shapes them (``steps``:
decode-only, prefill without and with context, prefills with and without context together,
decodes beside a prefill), each at every token count the scheduler allows (1 ..
``max_num_batched_tokens``; decode up to ``max_num_seqs``), through the worker's own
``execute_model`` and ``sample_tokens`` (the compiled graphs, the attention metadata builders,
MoE, the sampler), as vLLM's own kernel warm-up does. It runs at the end of vLLM's warm-up,
right before the JIT monitor arms, in an engine started as serving starts (the generation's
cache, vLLM's startup plan applied), so that what vLLM's own warm-up loads there is what it
loads in serving too.

Triton's compilation listener sees every kernel the process loads, compiled or read from the
disk cache, once. Every one is recorded, of every family (``family``: fused MoE, attention,
the compiled graphs, the sampler, ...): those vLLM's warm-up loaded, and those each
enumerated forward loaded first, with its shape and token count (the representatives).
Serving replays the representatives before the monitor arms and checks that every recorded
kernel is then loaded and none had to be compiled: a start whose configuration differs from
the one enumerated, or whose generation lacks a kernel, fails before it is ready, naming the
family, the kernel and the batch. What the enumeration cannot form is named in the record
(``not_enumerated``), and a kernel the warm's later passes still met after ready is a named
gap (``gaps``: family, kernel, the batch it was met in), which serving accepts or, when the
KernelCache demands full coverage and serving is strict, refuses before ready.

Nothing here imports vLLM or torch at module level: the functions are handed vLLM's objects.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernelcache.errors import ColdCompileError
from kernelcache.toolchains.vllm import adapter
from kernelcache.toolchains.vllm.steps import SHAPES, Limits, Steps

log = logging.getLogger(__name__)

MOE = "fused_moe"
ENUMERATE = "enumerate"  # KERNELCACHE_VLLM_COVERAGE's value for the pass that enumerates
FILE = "vllm-warmup/coverage.json"  # under files/
TUNED_FOLDER_ENV = "VLLM_TUNED_CONFIG_FOLDER"  # vLLM reads its fused-MoE tables here first
METHOD = "model runner dummy forward"  # how a record was derived (older ones: MoE layer calls)
WARM_UP = "vLLM's warm-up"  # where a kernel loaded outside the enumerated forwards was met
NOT_ENUMERATED = {
    "sampler": "sampling parameters are per request; vLLM's warm-up runs the sampler at "
    "max_num_seqs and the declared sweep runs greedy requests",
}


def family(kernel: str, module: str) -> str:
    """The family a Triton kernel belongs to, from where it is defined: inductor's generated
    kernels are the compiled graphs; vLLM's own by the package that holds them."""
    if kernel.startswith("triton_") or module.startswith("torch._inductor"):
        return "compiled graphs"
    for part, name in (
        ("fused_moe", MOE),
        ("attention", "attention"),
        ("attn", "attention"),
        ("mla", "attention"),
        ("sample", "sampler"),
    ):
        if part in module or part in kernel:
            return name
    return module.rpartition(".")[0] or module or "other"


@dataclass(frozen=True)
class Specialization:
    """One kernel the engine loads: its name, Triton's hash, its family, and the forward that
    first loaded it (a shape and token count), or None: vLLM's own warm-up loads it."""

    kernel: str
    hash: str
    family: str
    shape: str | None = None
    tokens: int | None = None

    @property
    def where(self) -> str:
        return f"a {self.shape} batch of {self.tokens} tokens" if self.shape else WARM_UP

    @property
    def label(self) -> str:
        return f"{self.family}: {self.kernel} ({self.where}; triton {self.hash[:12]})"


@dataclass
class Coverage:
    """What the warm enumerated for one engine configuration (``FILE`` in the generation)."""

    engine: dict[str, Any] = field(default_factory=dict)  # the configuration it derives from
    method: str = METHOD
    shapes: dict[str, str] = field(default_factory=dict)  # shape -> the token counts run
    families: dict[str, dict[str, Any]] = field(default_factory=dict)
    not_enumerated: dict[str, str] = field(default_factory=lambda: dict(NOT_ENUMERATED))
    gaps: list[dict[str, Any]] = field(default_factory=list)  # met after ready all the same
    full_coverage_required: bool = False  # the KernelCache refuses a generation with gaps
    seconds: float = 0.0  # what the enumeration took

    def specializations(self, family: str | None = None) -> list[Specialization]:
        return [
            Specialization(**entry)
            for name, data in sorted(self.families.items())
            if family is None or name == family
            for entry in data.get("specializations", [])
        ]

    def representatives(self) -> list[tuple[str, int]]:
        """(shape, token count) of each enumerated forward that loaded a kernel first."""
        return sorted({(s.shape, s.tokens) for s in self.specializations() if s.shape and s.tokens})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def read(cls, path: Path) -> Coverage | None:
        """The recorded coverage, or None when the generation holds none (an older warm)."""
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        known = {name for name in cls.__dataclass_fields__}
        coverage = cls(**{k: v for k, v in data.items() if k in known})
        if "method" not in data:  # an older warm: fused-MoE layers called from outside
            coverage.method = "fused-MoE layer calls"
        return coverage

    @property
    def replayable(self) -> bool:
        return self.method == METHOD

    def gap_lines(self) -> list[str]:
        return [f"{g['family']}: {g['kernel']} ({g['batch']})" for g in self.gaps]

    def summary(self) -> dict[str, str]:
        """Family -> one line: how many kernels, met how; then what was not enumerated and
        the gaps."""
        lines = {}
        for name, entry in sorted(self.families.items()):
            specs = entry.get("specializations", [])
            first = sum(1 for s in specs if s.get("shape"))
            lines[name] = (
                f"{len(specs)} kernels: {first} first loaded by the enumerated forwards, "
                f"{len(specs) - first} by {WARM_UP}; {entry.get('derived', '')}"
            )
        for name, why in sorted(self.not_enumerated.items()):
            lines[name] = f"not enumerated: {why}"
        if self.gaps:
            lines["gaps"] = f"{len(self.gaps)} kernel(s) still loaded after ready: " + "; ".join(
                self.gap_lines()[:5]
            )
        return lines


# ---------------------------------------------------------------------- Triton loads


@dataclass
class _Load:
    kernel: str
    hash: str
    compiled: bool
    family: str
    forward: tuple[str, int] | None  # the enumerated forward it was loaded in, if any


class Loads:
    """Every Triton kernel this process loads (compiled or read from the disk cache), from
    Triton's compilation listener, which fires once per miss of its in-memory cache."""

    def __init__(self) -> None:
        self.seen: list[_Load] = []
        self.hashes: set[str] = set()
        self.forward: tuple[str, int] | None = None

    def install(self) -> None:
        from triton import knobs

        previous = knobs.compilation.listener

        def listener(*, src: Any, cache_hit: bool, **event: Any) -> None:
            if previous is not None:
                previous(src=src, cache_hit=cache_hit, **event)
            kernel_hash = str((event.get("metadata") or {}).get("hash", ""))
            name = getattr(src, "name", "?")
            function = getattr(getattr(src, "fn", None), "fn", None)
            module = str(getattr(function, "__module__", "") or "")
            load = _Load(name, kernel_hash, not cache_hit, family(name, module), self.forward)
            self.seen.append(load)
            self.hashes.add(kernel_hash)

        knobs.compilation.listener = listener

    @contextlib.contextmanager
    def during(self, forward: tuple[str, int] | None = None) -> Iterator[list[_Load]]:
        """The loads made inside the block, attributed to ``forward``."""
        start, before = len(self.seen), self.forward
        self.forward = forward
        found: list[_Load] = []
        try:
            yield found
        finally:
            self.forward = before
            found.extend(self.seen[start:])


loads = Loads()


# ---------------------------------------------------------------------- the engine's configuration


def layer_signature(layer: Any) -> str:
    """What decides a MoE layer's kernels: its shapes, dtype, routing and quantization."""
    config = layer.moe_config
    method = type(adapter.moe_quant_method(layer)).__name__
    dtype = str(config.in_dtype).removeprefix("torch.")
    return (
        f"E={config.num_experts},top{config.experts_per_token},H={config.hidden_dim},"
        f"N={config.intermediate_size},{dtype},{method}"
    )


def moe_layers(vllm_config: Any) -> list[tuple[str, int, Any]]:
    """(signature, index, layer): the first MoE layer of each distinct signature, with its
    index in vLLM's MoE layer order (the forward context resolves a layer by it)."""
    compilation = vllm_config.compilation_config
    context = compilation.static_forward_context
    found: dict[str, tuple[str, int, Any]] = {}
    for index, name in enumerate(compilation.static_all_moe_layers):
        layer = context.get(name)
        if layer is None or not hasattr(layer, "moe_config"):
            continue
        found.setdefault(layer_signature(layer), (layer_signature(layer), index, layer))
    return list(found.values())


def engine_config(vllm_config: Any, layers: list[tuple[str, int, Any]]) -> dict[str, Any]:
    """The configuration the enumeration derives from: a start with another one fails.

    The GPU product as vLLM names it for its config tables, and the tuned tables the engine
    reads (``tuning``), are part of it: they choose the kernels as much as the shapes do."""
    scheduler, parallel = vllm_config.scheduler_config, vllm_config.parallel_config
    return {
        "max_num_batched_tokens": int(scheduler.max_num_batched_tokens),
        "max_num_seqs": int(scheduler.max_num_seqs),
        "max_model_len": int(vllm_config.model_config.max_model_len),
        "dtype": str(vllm_config.model_config.dtype).removeprefix("torch."),
        "tensor_parallel_size": int(parallel.tensor_parallel_size),
        "moe_layers": sorted(signature for signature, _, _ in layers),
        "moe_config_device": config_device(),
        "moe_tuned_configs": tuned_configs(),
    }


def config_device() -> str:
    """The GPU product in the names of vLLM's fused-MoE config tables (``NVIDIA_H200``)."""
    name = adapter.moe_module().get_config_file_name(1, 1, None)
    return name.partition("device_name=")[2].removesuffix(".json")


def tuned_configs() -> dict[str, str]:
    """File name -> digest of each table in ``VLLM_TUNED_CONFIG_FOLDER`` (vLLM reads a table
    there before its own)."""
    folder = os.environ.get(TUNED_FOLDER_ENV)
    if not folder or not Path(folder).is_dir():
        return {}
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        for path in sorted(Path(folder).glob("*.json"))
    }


def limits(vllm_config: Any) -> Limits:
    scheduler = vllm_config.scheduler_config
    return Limits(
        int(scheduler.max_num_batched_tokens),
        int(scheduler.max_num_seqs),
        int(vllm_config.model_config.max_model_len),
    )


def graph_sizes(vllm_config: Any) -> str:
    """The token counts vLLM's warm-up compiles and captures graphs for, from its configuration
    (what serving's strict mode then finds in the generation or refuses before ready)."""
    compilation = vllm_config.compilation_config
    parts = []
    for name, label in (
        ("compile_sizes", "compile sizes"),
        ("compile_ranges_endpoints", "compile range ends"),
        ("cudagraph_capture_sizes", "CUDA-graph sizes"),
    ):
        values = getattr(compilation, name, None)
        if values:
            parts.append(f"{label} {','.join(str(v) for v in values)}")
    return "; ".join(parts)


def differences(recorded: Mapping[str, Any], here: Mapping[str, Any]) -> list[str]:
    """The engine settings the generation's coverage was derived from that differ here (a
    setting an older generation did not record is not compared)."""
    return [
        f"{name}: {recorded.get(name)} != {here.get(name)}"
        for name in sorted(recorded)
        if recorded.get(name) != here.get(name)
    ]


# ---------------------------------------------------------------------- the forwards


def _synchronize() -> None:
    torch = importlib.import_module("torch")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def enumerate_forwards(worker: Any, vllm_config: Any) -> Coverage:
    """Every batch shape at every token count through the worker's own steps (``steps``);
    every kernel the process has loaded, each with the batch that loaded it first."""
    bound = limits(vllm_config)
    engine = engine_config(vllm_config, moe_layers(vllm_config))
    steps = Steps(worker)
    started = time.perf_counter()
    warmed_up = len(loads.seen)  # vLLM's own warm-up (and the model's load) loaded these
    coverage = Coverage(engine=engine)
    for shape, batch_of in SHAPES.items():
        ran: list[int] = []
        for tokens in range(1, bound.max_num_batched_tokens + 1):
            batch = batch_of(tokens, bound)
            if batch is None or not steps.fits(batch):
                continue
            try:
                with loads.during((shape, tokens)):
                    steps.run(batch)
            except ColdCompileError:
                raise
            except Exception as exc:  # vLLM refuses the shape here: named, not guessed
                why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
                coverage.not_enumerated[f"{shape} batches from {tokens} tokens"] = (
                    f"the engine raised {why}"
                )
                log.warning("kernelcache: coverage: %s batches stop at %d tokens: %s",
                            shape, tokens, why)  # fmt: skip
                break
            ran.append(tokens)
            if tokens % 512 == 0:
                log.info(
                    "kernelcache: coverage: %s batches: %d/%d token counts, %d kernels",
                    shape, tokens, bound.max_num_batched_tokens, len(loads.seen),
                )  # fmt: skip
        coverage.shapes[shape] = f"{min(ran)}..{max(ran)} tokens" if ran else "none formed"
    _synchronize()
    by_family: dict[str, list[Specialization]] = {}
    for load in loads.seen:  # an enumerated batch's first loads name it; the rest: warm-up
        by_family.setdefault(load.family, []).append(
            Specialization(load.kernel, load.hash, load.family, *(load.forward or (None, None)))
        )
    for name, specs in sorted(by_family.items()):
        coverage.families[name] = {
            "derived": "every batch shape at every token count through the engine's own steps",
            "specializations": [asdict(s) for s in specs],
        }
    if sizes := graph_sizes(vllm_config):
        coverage.shapes[WARM_UP] = sizes
    coverage.seconds = round(time.perf_counter() - started, 3)
    log.info(
        "kernelcache: coverage enumerated: %d kernels in %d families, %d first loaded by "
        "%d batches (%s) in %.1f s",
        sum(len(s) for s in by_family.values()),
        len(by_family),
        len(loads.seen) - warmed_up,
        len(coverage.representatives()),
        "; ".join(f"{shape} {counts}" for shape, counts in coverage.shapes.items()),
        coverage.seconds,
    )
    return coverage


def replay(worker: Any, vllm_config: Any, coverage: Coverage) -> float:
    """Load every recorded kernel before the engine is ready, or raise one line naming the
    first one that is not in the generation (or the configuration that differs).

    A kernel the replay had to compile, or a recorded one not loaded by the end, is missing;
    in strict mode Triton's cache manager already refused the compile (a ColdCompileError)."""
    started = time.perf_counter()
    here = engine_config(vllm_config, moe_layers(vllm_config))
    if changed := differences(coverage.engine, here):
        raise ColdCompileError(
            f"vllm coverage: the engine's configuration is not the one the generation "
            f"enumerated ({changed[0]}): rebuild the KernelCache with this configuration"
        )
    steps, bound = Steps(worker), limits(vllm_config)
    for shape, tokens in coverage.representatives():
        batch = SHAPES[shape](tokens, bound) if shape in SHAPES else None
        if batch is None:
            raise ColdCompileError(
                f"vllm coverage: the generation names a {shape} batch of {tokens} tokens, "
                "which this kernelcache cannot form: rebuild the KernelCache"
            )
        try:
            with loads.during((shape, tokens)) as found:
                steps.run(batch)
        except ColdCompileError as exc:
            raise ColdCompileError(
                f"vllm coverage: a {shape} batch of {tokens} tokens loads a kernel the "
                f"generation lacks ({exc})"
            ) from None
        if compiled := [load for load in found if load.compiled]:
            raise ColdCompileError(
                f"vllm coverage: {compiled[0].family}: {compiled[0].kernel} for a {shape} "
                f"batch of {tokens} tokens had to be compiled: the generation lacks it"
            )
    _synchronize()
    if lost := [spec for spec in coverage.specializations() if spec.hash not in loads.hashes]:
        raise ColdCompileError(
            f"vllm coverage: {lost[0].label} was not loaded here before ready (the engine "
            "selects other kernels than the warm did)"
        )
    return round(time.perf_counter() - started, 3)
