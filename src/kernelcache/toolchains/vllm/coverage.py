"""Coverage by enumeration: every fused-MoE specialization the engine's configuration allows.

A Triton kernel is specialized on what its arguments are at the call: the config vLLM picks
for the token count (its tuned table's nearest entry, or its default), integers divisible by
16 or equal to 1, the block-assignment path small batches take. Which token counts a served
forward has depends on how requests batch, so a replayed sweep only samples them: a
production-size MoE met specializations its warm had not (every start, strict: HTTP 500 at the
first request). The engine can only ever run its MoE layers on 1 .. ``max_num_batched_tokens``
tokens, so the warm runs each distinct MoE layer on every one of those counts, through the
layer's own forward (the code path serving takes, whatever it selects), in the engine core
right after the model loads: before vLLM's profile run and warm-up, which would load some of
them first and hide them from the record. Triton's compilation listener tells which counts
loaded a kernel the process had not loaded yet; those are the representatives, and the
kernels they loaded (name and Triton's cache hash) are the family's specializations. The set
is a function of the configuration alone (the GPU product's table and any tuned one,
``tuning``, included): the same model, dtype, parallelism and token bound give the same set
on every build.

Serving replays the representatives before the monitor arms (milliseconds each: every kernel
comes from the generation's Triton cache) and checks that each recorded specialization is now
loaded and none had to be compiled: a start whose configuration asks for more than the warm
enumerated, or whose generation lacks a kernel, fails before it is ready, with one line naming
the family and the specialization. After ready, a compile no longer refuses (strict or not):
it is served, counted and recorded for the next build (``toolchains.vllm`` says why).

What is not enumerated is named in the record (``not_enumerated``): the sampler's kernels (per
request sampling parameters; vLLM's own warm-up runs them at ``max_num_seqs``) and the
compiled graphs of each compile range and CUDA-graph size (vLLM's own warm-up compiles and
captures every one of them from its configuration, before the monitor arms).

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

log = logging.getLogger(__name__)

MOE = "fused_moe"
ENUMERATE = "enumerate"  # KERNELCACHE_VLLM_COVERAGE's value for the warm's first pass
FILE = "vllm-warmup/coverage.json"  # under files/
TUNED_FOLDER_ENV = "VLLM_TUNED_CONFIG_FOLDER"  # vLLM reads its fused-MoE tables here first
MOE_MODULE = "vllm.model_executor.layers.fused_moe.fused_moe"  # its tables' reader and names
NOT_ENUMERATED = {
    "sampler": "sampling parameters are per request; vLLM's warm-up runs the sampler at "
    "max_num_seqs and the declared sweep runs greedy requests",
    "compiled graphs": "vLLM's warm-up compiles every compile range and captures every "
    "CUDA-graph size of its configuration before the JIT monitor arms (not replayed here)",
}


@dataclass(frozen=True)
class Specialization:
    """One kernel a family loads: its name, Triton's hash, the token count that loads it."""

    kernel: str
    hash: str
    tokens: int
    layer: str  # the MoE layer shape it was met through (``layer_signature``)

    @property
    def label(self) -> str:
        return f"{self.kernel} for {self.tokens} tokens ({self.layer}; triton {self.hash[:12]})"


@dataclass
class Coverage:
    """What the warm enumerated for one engine configuration (``FILE`` in the generation)."""

    engine: dict[str, Any] = field(default_factory=dict)  # the configuration it derives from
    families: dict[str, dict[str, Any]] = field(default_factory=dict)
    not_enumerated: dict[str, str] = field(default_factory=lambda: dict(NOT_ENUMERATED))

    def specializations(self, family: str) -> list[Specialization]:
        entries = self.families.get(family, {}).get("specializations", [])
        return [Specialization(**entry) for entry in entries]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def read(cls, path: Path) -> Coverage | None:
        """The recorded coverage, or None when the generation holds none (an older warm)."""
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(
            engine=data.get("engine", {}),
            families=data.get("families", {}),
            not_enumerated=data.get("not_enumerated", {}),
        )

    def summary(self) -> dict[str, str]:
        """Family -> one line: how many specializations, derived from what."""
        lines = {}
        for family, entry in sorted(self.families.items()):
            lines[family] = (
                f"{len(entry.get('specializations', []))} specializations from "
                f"{len(entry.get('representatives', []))} token counts; {entry.get('derived', '')}"
            )
        for family, why in sorted(self.not_enumerated.items()):
            lines[family] = f"not enumerated: {why}"
        return lines


# ---------------------------------------------------------------------- Triton loads


@dataclass
class _Load:
    kernel: str
    hash: str
    compiled: bool


class Loads:
    """Every Triton kernel this process loads (compiled or read from the disk cache), from
    Triton's compilation listener, which fires once per miss of its in-memory cache."""

    def __init__(self) -> None:
        self.seen: list[_Load] = []
        self.hashes: set[str] = set()

    def install(self) -> None:
        from triton import knobs

        previous = knobs.compilation.listener

        def listener(*, src: Any, cache_hit: bool, **event: Any) -> None:
            if previous is not None:
                previous(src=src, cache_hit=cache_hit, **event)
            kernel_hash = str((event.get("metadata") or {}).get("hash", ""))
            self.seen.append(_Load(getattr(src, "name", "?"), kernel_hash, not cache_hit))
            self.hashes.add(kernel_hash)

        knobs.compilation.listener = listener

    @contextlib.contextmanager
    def during(self) -> Iterator[list[_Load]]:
        """The loads made inside the block."""
        start = len(self.seen)
        found: list[_Load] = []
        try:
            yield found
        finally:
            found.extend(self.seen[start:])


loads = Loads()


# ---------------------------------------------------------------------- vLLM's MoE layers


def layer_signature(layer: Any) -> str:
    """What decides a MoE layer's kernels: its shapes, dtype, routing and quantization."""
    config = layer.moe_config
    method = type(getattr(layer, "_quant_method", None) or layer).__name__
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
        "dtype": str(vllm_config.model_config.dtype).removeprefix("torch."),
        "tensor_parallel_size": int(parallel.tensor_parallel_size),
        "moe_layers": sorted(signature for signature, _, _ in layers),
        "moe_config_device": config_device(),
        "moe_tuned_configs": tuned_configs(),
    }


def config_device() -> str:
    """The GPU product in the names of vLLM's fused-MoE config tables (``NVIDIA_H200``)."""
    name = importlib.import_module(MOE_MODULE).get_config_file_name(1, 1, None)
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
    """The layer's forward on these inputs, as the model's forward calls it."""
    import torch
    from vllm.forward_context import get_forward_context, set_forward_context

    tokens = int(hidden.shape[0])
    with torch.inference_mode(), set_forward_context(None, vllm_config, num_tokens=tokens):
        context = get_forward_context()
        if hasattr(context, "moe_layer_index"):
            context.moe_layer_index = index
        layer.forward(hidden, logits)


def run_layer(vllm_config: Any, layer: Any, index: int, tokens: int) -> None:
    """One forward of ``layer`` on ``tokens`` random tokens."""
    forward(vllm_config, layer, index, *layer_inputs(layer, tokens))


def enumerate_moe(vllm_config: Any) -> Coverage:
    """Every token count 1 .. max_num_batched_tokens through each distinct MoE layer; the
    counts that loaded a kernel not loaded before, and those kernels."""
    import torch

    layers = moe_layers(vllm_config)
    engine = engine_config(vllm_config, layers)
    bound = engine["max_num_batched_tokens"]
    started = time.perf_counter()
    specializations: list[Specialization] = []
    representatives: set[int] = set()
    for signature, index, layer in layers:
        for tokens in range(1, bound + 1):
            with loads.during() as found:
                run_layer(vllm_config, layer, index, tokens)
            for load in found:
                specializations.append(Specialization(load.kernel, load.hash, tokens, signature))
                representatives.add(tokens)
            if tokens % 1024 == 0:
                log.info(
                    "kernelcache: fused-MoE coverage: %s: %d/%d token counts, %d kernels",
                    signature,
                    tokens,
                    bound,
                    len(specializations),
                )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    coverage = Coverage(engine=engine)
    if sizes := graph_sizes(vllm_config):
        coverage.not_enumerated["compiled graphs"] = (
            f"{NOT_ENUMERATED['compiled graphs']}; this configuration's: {sizes}"
        )
    if layers:
        coverage.families[MOE] = {
            "derived": f"every token count 1..{bound} (max_num_batched_tokens) through the "
            f"forward of {len(layers)} distinct MoE layer shape(s)",
            "representatives": sorted(representatives),
            "specializations": [asdict(s) for s in specializations],
            "seconds": round(time.perf_counter() - started, 3),
        }
    log.info(
        "kernelcache: fused-MoE coverage enumerated: %d specializations from %d token counts "
        "in %.1f s",
        len(specializations),
        len(representatives),
        time.perf_counter() - started,
    )
    return coverage


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


def replay(vllm_config: Any, coverage: Coverage) -> float:
    """Load every recorded specialization before the engine is ready, or raise one line
    naming the first one that is not in the generation (or the configuration that differs).

    A kernel the replay had to compile, or a recorded one it did not load, is missing; in
    strict mode Triton's cache manager already refused the compile (a ColdCompileError)."""
    started = time.perf_counter()
    layers = {signature: (index, layer) for signature, index, layer in moe_layers(vllm_config)}
    here = engine_config(vllm_config, [(s, i, x) for s, (i, x) in layers.items()])
    if changed := differences(coverage.engine, here):
        raise ColdCompileError(
            f"vllm coverage: the engine's configuration is not the one the generation "
            f"enumerated ({changed[0]}): rebuild the KernelCache with this configuration"
        )
    wanted = coverage.specializations(MOE)
    by_tokens: dict[tuple[str, int], list[Specialization]] = {}
    for spec in wanted:
        by_tokens.setdefault((spec.layer, spec.tokens), []).append(spec)
    for (signature, tokens), specs in sorted(by_tokens.items()):
        index, layer = layers[signature]
        try:
            with loads.during() as found:
                run_layer(vllm_config, layer, index, tokens)
        except ColdCompileError as exc:
            raise ColdCompileError(
                f"vllm coverage: {MOE}: {specs[0].label} is not in the generation ({exc})"
            ) from None
        if compiled := [load for load in found if load.compiled]:
            raise ColdCompileError(
                f"vllm coverage: {MOE}: {compiled[0].kernel} for {tokens} tokens ({signature}) "
                f"had to be compiled: the generation lacks it"
            )
    if lost := [spec for spec in wanted if spec.hash not in loads.hashes]:
        raise ColdCompileError(
            f"vllm coverage: {MOE}: {lost[0].label} was not loaded by its token count here "
            "(the engine selects other kernels than the warm did)"
        )
    return round(time.perf_counter() - started, 3)
