"""Every vLLM internal the vllm toolchain binds, declared once per version family, and the
vLLM releases the toolchain supports.

kernelcache drives vLLM through its internals (the worker's warm-up and model load, the model
runner's ``execute_model`` and ``_dummy_run``, the JIT monitor, the forward context, the
fused-MoE layer and its config tables, the startup plan, ``vllm serve``'s engine arguments).
None of them is a public API: a release may move any of them. So each is declared here, once,
as what the toolchain expects (module, name, the parameters it passes, the fields it reads),
grouped into a ``Family``: the releases that bind them the same way. Two things follow:

- **A declared range** (``SUPPORTED``): the warm and a serving start check the installed
  vLLM against it (``check_version``) and refuse a release outside it by name, unless the
  spec asks to try anyway (``vllmVersionCheck: warn``): then a warning, and strict mode still
  refuses what it refuses.
- **A check of a vLLM tree against the family** (``check_tree``): it reads the sources with
  ``ast`` (vLLM needs a GPU build of torch to import) and names every internal that moved.
  The compatibility tests run it on each release of ``CHECKED_RELEASES`` and on the stand-in
  engine the tests use, so a release that moves an internal fails a test naming it, not a
  serving pod.

Light at import (no vLLM, no torch): the init-container, doctor and the runtime read it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelcache.contract import VLLM_VERSION_CHECKS
from kernelcache.errors import NotInstalledError

# The kinds of internal.
MODULE = "module"  # the module exists
DEF = "def"  # a function or method accepting ``needs`` (its first ``positional`` in order)
FIELDS = "fields"  # a class holding each of ``needs`` (a field, a property, ``self.x = ``)
NAME = "name"  # a module-level name (defined, imported, or declared for a lazy __getattr__)
REFERS = "refers"  # a function whose body names each of ``needs`` (the hook relies on it)
STRINGS = "strings"  # a module holding each of ``needs`` as a string (a variable, a key)

# How the spec's ``vllmVersionCheck`` answers a release outside ``SUPPORTED``.
REFUSE, WARN = VLLM_VERSION_CHECKS


@dataclass(frozen=True)
class Internal:
    """One vLLM internal the toolchain binds, as it expects it."""

    what: str  # how messages and test ids name it
    module: str
    name: str = ""  # "" for the module itself; "Class.method"; "Class"; a module-level name
    kind: str = DEF
    needs: tuple[str, ...] = ()
    positional: int = 0  # the first ``positional`` of ``needs`` are passed by position, in order
    bound_by: str = ""  # the toolchain's room that binds it
    # Other modules it may live in: it holds where each module present holds it, and one must
    # be (vLLM's two model runners: 0.34 keeps only the ``gpu/`` one).
    also: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.module}:{self.name}" if self.name else self.module


# ---------------------------------------------------------------------- the 0.26 family
# Module paths, once: the rooms import them from here.
ARG_UTILS = "vllm.engine.arg_utils"  # imported by ``vllm serve`` before the engine
JIT_MONITOR = "vllm.utils.jit_monitor"
GPU_WORKER = "vllm.v1.worker.gpu_worker"
STARTUP_PLAN = "vllm.v1.worker.startup_plan"
# The model runners of vLLM's two GPU worker paths (the V1 runner and the newer ``gpu/``).
RUNNERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")
RUNNER_CLASS = "GPUModelRunner"
FORWARD_CONTEXT = "vllm.forward_context"
MOE_PACKAGE = "vllm.model_executor.layers.fused_moe"  # override_config, the MoE layer types
MOE_MODULE = f"{MOE_PACKAGE}.fused_moe"  # the config tables' reader and their names
PLATFORMS = "vllm.platforms"
SERVE_MAIN = "vllm.entrypoints.cli.main"  # ``python -m`` it: ``vllm serve``
# Keyword arguments ``_dummy_run`` is given when it accepts them (``dummy_run_options``).
DUMMY_RUN_OPTIONS = {"skip_eplb": True, "remove_lora": False}
# The engine arguments a vllm workload gives ``vllm serve`` (``VllmWorkload.engine_args``).
ENGINE_ARGS = (
    "model",
    "load_format",
    "dtype",
    "tensor_parallel_size",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "gpu_memory_utilization",
    "skip_tokenizer_init",
    "attention_backend",
    "compilation_config",
)
MOE_CONFIG_FIELDS = (
    "num_experts",
    "experts_per_token",
    "hidden_dim",
    "intermediate_size",
    "in_dtype",
    "device",
    "router_logits_dtype",
)

_I = Internal
INTERNALS_0_26 = (
    # hooks: where they are installed, and what they wrap
    _I("engine arguments", ARG_UTILS, kind=MODULE, bound_by="hooks"),
    _I("jit monitor activate", JIT_MONITOR, "activate", needs=("mode", "verbose"),
       bound_by="hooks"),
    _I("jit monitor event", JIT_MONITOR, "_handle_jit_event",
       needs=("backend", "event", "fn_name", "detail"), bound_by="hooks"),
    _I("worker warm-up", GPU_WORKER, "Worker.compile_or_warm_up_model", bound_by="hooks"),
    _I("worker arms the monitor", GPU_WORKER, "Worker.compile_or_warm_up_model", kind=REFERS,
       needs=("activate",), bound_by="hooks"),
    _I("worker load_model", GPU_WORKER, "Worker.load_model", bound_by="hooks"),
    _I("worker fields", GPU_WORKER, "Worker", kind=FIELDS,
       needs=("vllm_config", "model_runner", "cache_config", "init_snapshot"),
       bound_by="hooks"),
    _I("worker startup plan", GPU_WORKER, "maybe_apply_startup_plan", kind=NAME,
       bound_by="hooks"),
    _I("worker applies the startup plan", GPU_WORKER, "Worker.determine_available_memory",
       kind=REFERS, needs=("maybe_apply_startup_plan",), bound_by="hooks"),
    _I("startup plan apply", STARTUP_PLAN, "maybe_apply_startup_plan", needs=("worker",),
       positional=1, bound_by="hooks"),
    _I("startup plan file", STARTUP_PLAN, kind=STRINGS,
       needs=("startup_plan", "free_memory_baseline"), bound_by="hooks, cache_root"),
    _I("vLLM's variables", "vllm.envs", kind=STRINGS,
       needs=("VLLM_CACHE_ROOT", "VLLM_ENABLE_STARTUP_PLAN", "VLLM_TUNED_CONFIG_FOLDER"),
       bound_by="cache_root, passes, coverage"),
    _I("kv cache bytes", "vllm.config", "CacheConfig", kind=FIELDS,
       needs=("kv_cache_memory_bytes",), bound_by="hooks"),
    _I("memory snapshot", "vllm.utils.mem_utils", "MemorySnapshot", kind=FIELDS,
       needs=("free_memory",), bound_by="hooks"),
    _I("model runner execute_model", RUNNERS[0], f"{RUNNER_CLASS}.execute_model",
       needs=("scheduler_output",), positional=1, bound_by="hooks", also=RUNNERS[1:]),
    _I("model runner _dummy_run", RUNNERS[0], f"{RUNNER_CLASS}._dummy_run",
       needs=("num_tokens", "skip_eplb"), positional=1, bound_by="hooks", also=RUNNERS[1:]),
    _I("scheduled tokens", "vllm.v1.core.sched.output", "SchedulerOutput", kind=FIELDS,
       needs=("total_num_scheduled_tokens", "num_scheduled_tokens", "scheduled_new_reqs",
              "scheduled_cached_reqs", "finished_req_ids"),
       bound_by="hooks, steps"),
    # steps: batches built as the scheduler builds them, run through the worker
    _I("an empty step", "vllm.v1.core.sched.output", "SchedulerOutput.make_empty",
       bound_by="steps"),
    _I("a new request's data", "vllm.v1.core.sched.output", "NewRequestData.from_request",
       needs=("request", "block_ids", "prefill_token_ids"), bound_by="steps"),
    _I("a new request's context", "vllm.v1.core.sched.output", "NewRequestData",
       kind=FIELDS, needs=("num_computed_tokens",), bound_by="steps"),
    _I("a continued request", "vllm.v1.core.sched.output", "CachedRequestData", kind=FIELDS,
       needs=("req_ids", "num_computed_tokens", "new_block_ids", "num_output_tokens"),
       bound_by="steps"),
    _I("worker execute_model", GPU_WORKER, "Worker.execute_model",
       needs=("scheduler_output",), positional=1, bound_by="steps"),
    _I("worker sample_tokens", GPU_WORKER, "Worker.sample_tokens",
       needs=("grammar_output",), positional=1, bound_by="steps"),
    _I("engine model", "vllm.config", "ModelConfig", kind=FIELDS, needs=("model", "dtype"),
       bound_by="hooks, coverage"),
    # coverage: the engine's configuration, its MoE layers and their forward
    _I("engine config", "vllm.config", "VllmConfig", kind=FIELDS,
       needs=("model_config", "compilation_config", "scheduler_config", "parallel_config"),
       bound_by="coverage"),
    _I("compilation config", "vllm.config", "CompilationConfig", kind=FIELDS,
       needs=("static_forward_context", "static_all_moe_layers", "compile_sizes",
              "compile_ranges_endpoints", "cudagraph_capture_sizes"), bound_by="coverage"),
    _I("scheduler config", "vllm.config", "SchedulerConfig", kind=FIELDS,
       needs=("max_num_batched_tokens", "max_num_seqs"), bound_by="coverage, tuning"),
    _I("parallel config", "vllm.config", "ParallelConfig", kind=FIELDS,
       needs=("tensor_parallel_size",), bound_by="coverage, tuning"),
    _I("set forward context", FORWARD_CONTEXT, "set_forward_context",
       needs=("attn_metadata", "vllm_config", "num_tokens"), positional=2,
       bound_by="coverage"),
    _I("get forward context", FORWARD_CONTEXT, "get_forward_context", bound_by="coverage"),
    _I("forward context fields", FORWARD_CONTEXT, "ForwardContext", kind=FIELDS,
       needs=("moe_layer_index",), bound_by="coverage"),
    _I("MoE layer", MOE_PACKAGE, "MoERunner", kind=FIELDS,
       needs=("moe_config", "_quant_method", "routed_experts"), bound_by="coverage, tuning"),
    _I("MoE experts", MOE_PACKAGE, "RoutedExperts", kind=FIELDS, needs=("quant_method",),
       bound_by="tuning"),
    _I("MoE modular wrapper", f"{MOE_PACKAGE}.fused_moe_modular_method",
       "FusedMoEModularMethod", kind=FIELDS, needs=("old_quant_method",), bound_by="tuning"),
    _I("MoE layer forward", MOE_PACKAGE, "MoERunner.forward",
       needs=("hidden_states", "router_logits"), positional=2, bound_by="coverage, tuning"),
    _I("MoE config", MOE_PACKAGE, "FusedMoEConfig", kind=FIELDS, needs=MOE_CONFIG_FIELDS,
       bound_by="coverage, tuning"),
    _I("MoE config file name", MOE_MODULE, "get_config_file_name", needs=("E", "N", "dtype"),
       positional=3, bound_by="coverage, tuning"),
    # tuning: the tables vLLM reads, the config it runs, its experts' weights
    _I("MoE tables", MOE_MODULE, "get_moe_configs", needs=("E", "N", "dtype"), positional=3,
       bound_by="tuning"),
    _I("MoE default config", MOE_MODULE, "get_default_config",
       needs=("M", "E", "N", "K", "topk", "dtype"), positional=6, bound_by="tuning"),
    _I("MoE override_config", MOE_PACKAGE, "override_config", needs=("config",), positional=1,
       bound_by="tuning"),
    _I("MoE unquantized method", MOE_PACKAGE, "UnquantizedFusedMoEMethod", kind=NAME,
       bound_by="tuning"),
    _I("platform", PLATFORMS, "current_platform", kind=NAME, bound_by="tuning"),
    _I("platform is_cuda", f"{PLATFORMS}.interface", "Platform.is_cuda", bound_by="tuning"),
    # engine: ``vllm serve`` and its flags, the completion request it is sent
    _I("vllm serve", SERVE_MAIN, "main", bound_by="engine"),
    _I("engine arguments' fields", ARG_UTILS, "EngineArgs", kind=FIELDS, needs=ENGINE_ARGS,
       bound_by="engine"),
    _I("completion token ids", "vllm.entrypoints.openai.completion.protocol",
       "CompletionRequest", kind=FIELDS, needs=("return_token_ids",), bound_by="engine"),
)  # fmt: skip


def _release(version: str) -> tuple[tuple[int, ...], int]:
    """A version's release numbers (three at least) and 0 for a pre-, dev- or rc-release
    (which comes before its release) or 1; ``ValueError`` when it is no version at all."""
    found = re.match(r"v?(\d+(?:\.\d+)*)(.*)$", version.strip())
    if not found:
        raise ValueError(f"{version!r} is not a version")
    numbers = tuple(int(n) for n in found[1].split("."))
    numbers += (0,) * (3 - len(numbers))
    rest = found[2].lower()
    pre = bool(re.match(r"[.\-_]?(a|b|c|rc|alpha|beta|pre|preview|dev)\d*", rest))
    return numbers, 0 if pre else 1


@dataclass(frozen=True)
class Family:
    """Releases that bind every internal the same way: ``lowest`` <= release < ``below``."""

    name: str
    lowest: str
    below: str
    internals: tuple[Internal, ...]

    def holds(self, version: str) -> bool:
        key = _release(version)
        return _release(self.lowest) <= key < (_release(self.below)[0], 0)

    @property
    def range(self) -> str:
        return f">={self.lowest},<{self.below}"


# The range, decided from the compatibility tests (tests/test_vllm_adapter.py): every release
# from 0.26.0 to 0.34.0 binds each internal of the family as 0.26.0 does. A release past the
# newest checked one is outside until it has been checked (a new minor release may move any
# internal); 0.25 and older lack the startup plan and the JIT monitor the hooks wrap.
FAMILIES = (Family("0.26", "0.26.0", "0.35", INTERNALS_0_26),)
# Run on a GPU end to end (docs/BENCHMARKS.md): the bench's build, strict starts, anchors.
PROVEN_RELEASES = ("0.26.0",)
# Read by the compatibility tests on the CPU (scripts/fetch-vllm-sources.py fetches them):
# the oldest and the newest of the range, and the newest on the package index when it is not.
CHECKED_RELEASES = ("0.26.0", "0.34.0")
SUPPORTED = ", ".join(family.range for family in FAMILIES)


def family_of(version: str) -> Family | None:
    """The family that binds ``version`` (None: outside the supported range)."""
    try:
        return next((family for family in FAMILIES if family.holds(version)), None)
    except ValueError:
        return None


def outside(version: str) -> str | None:
    """Why ``version`` is not supported, in one line; None when it is."""
    if family_of(version) is not None:
        return None
    return (
        f"vLLM {version} is outside the range the vllm toolchain supports ({SUPPORTED}; "
        f"proven on a GPU: {', '.join(PROVEN_RELEASES)})"
    )


def check_version(version: str | None, check: str, who: str) -> str | None:
    """``version`` against the supported range, for ``who`` (the warm, a serving start):
    outside it, a ``NotInstalledError`` naming the version and the range (``check``
    ``refuse``), or the warning line (``warn``: the spec asks to try anyway). None: nothing
    to say (inside the range, or no vLLM installed: the import says so itself)."""
    why = outside(version) if version is not None else None
    if why is None:
        return None
    if check == WARN:
        return f"{who}: {why}; trying it anyway (vllmVersionCheck: warn)"
    raise NotInstalledError(
        f"{who}: {why}: install a vLLM in the range, or set vllmVersionCheck: warn in the "
        "vllm warmer's workload to try this one"
    )


def installed_version() -> str | None:
    """The installed vLLM's version, from its metadata (no import); None when not installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------- the rooms' calls


def dummy_run_options(dummy_run: Any) -> dict[str, Any]:
    """The keyword arguments of ``DUMMY_RUN_OPTIONS`` this runner's ``_dummy_run`` accepts by
    name (the V1 runner takes ``remove_lora``, the ``gpu/`` runner does not)."""
    import inspect

    accepted = inspect.signature(dummy_run).parameters
    return {name: value for name, value in DUMMY_RUN_OPTIONS.items() if name in accepted}


def scheduled_tokens(scheduler_output: Any) -> int:
    """The tokens of the forward ``execute_model`` runs (``SchedulerOutput``'s field)."""
    return int(scheduler_output.total_num_scheduled_tokens)


def moe_quant_method(layer: Any) -> Any:
    """The quantization method of a MoE layer (``MoERunner._quant_method``)."""
    return layer._quant_method


def base_quant_method(method: Any) -> Any:
    """A quant method under vLLM's modular wrapper unwrapped (``old_quant_method``)."""
    return getattr(method, "old_quant_method", method)


def routed_experts(layer: Any) -> Any:
    """The experts of a MoE layer, whose weights (``w13_weight``, ``w2_weight``) tuning reads."""
    return layer.routed_experts


def set_moe_layer(context: Any, index: int) -> None:
    """Point the forward context at MoE layer ``index`` (vLLM's MoE custom op finds its
    layer by this counter, ``ForwardContext.moe_layer_index``)."""
    context.moe_layer_index = index


def moe_module() -> Any:
    """vLLM's fused-MoE module (its tables' reader, names and default config)."""
    import importlib

    return importlib.import_module(MOE_MODULE)


def override_config() -> Any:
    """vLLM's ``override_config`` context manager: a forward runs with the config given."""
    import importlib

    return importlib.import_module(MOE_PACKAGE).override_config


def is_cuda() -> bool:
    """Whether vLLM runs on a CUDA GPU here (its platform says so)."""
    import importlib

    return bool(importlib.import_module(PLATFORMS).current_platform.is_cuda())


# ---------------------------------------------------------------------- the tree's check


@dataclass(frozen=True)
class Problem:
    """An internal a vLLM tree does not hold as the family declares it."""

    internal: Internal
    found: str  # what the tree holds instead

    @property
    def line(self) -> str:
        item = self.internal
        return f"{item.what} ({item.where}, bound by {item.bound_by}): {self.found}"


class _Tree:
    """A vLLM source tree (the directory holding ``vllm/``), its modules parsed on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.parsed: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self.parsed:
            base = self.root.joinpath(*dotted.split("."))
            found = [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()]
            text = found[0].read_text(encoding="utf-8", errors="replace") if found else None
            self.parsed[dotted] = ast.parse(text) if text is not None else None
        return self.parsed[dotted]

    def is_package(self, dotted: str) -> bool:
        return (self.root.joinpath(*dotted.split(".")) / "__init__.py").is_file()

    def top_level(self, dotted: str) -> dict[str, ast.AST]:
        """Each module-level name and what binds it (also inside ``if``/``try`` blocks)."""
        tree = self.module(dotted)
        names: dict[str, ast.AST] = {}
        if tree is None:
            return names
        for node in _statements(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.setdefault(node.name, node)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    names.setdefault(alias.asname or alias.name, node)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names.setdefault(alias.asname or alias.name.partition(".")[0], node)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.setdefault(node.target.id, node)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            names.setdefault(name.id, node)
        return names

    def resolve(self, dotted: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """(module, node) defining ``name`` as seen from module ``dotted``, following
        re-exports (``from vllm.x import Name``) and a package's submodules."""
        if depth > 8:
            return None
        node = self.top_level(dotted).get(name)
        if isinstance(node, ast.ImportFrom):
            source = _absolute(dotted, node, self.is_package(dotted))
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            if self.module(f"{source}.{original}") is not None and not self.top_level(source).get(
                original
            ):
                return f"{source}.{original}", ast.Module(body=[], type_ignores=[])
            return self.resolve(source, original, depth + 1)
        if node is not None:
            return dotted, node
        return None

    def find(self, dotted: str, qualname: str) -> tuple[str, ast.AST] | str:
        """(module, node) of ``Class.attr`` or ``name`` in ``dotted``; else what is missing."""
        if self.module(dotted) is None:
            return f"module {dotted} not found"
        head, _, attr = qualname.partition(".")
        found = self.resolve(dotted, head)
        if found is None:
            return f"{dotted} has no {head}"
        if not attr:
            return found
        where, node = found
        if not isinstance(node, ast.ClassDef):
            return f"{head} in {where} is not a class"
        member = self.member(where, node, attr)
        return member if member is not None else f"{where}.{head} has no {attr}"

    def bases(self, dotted: str, cls: ast.ClassDef) -> Iterator[tuple[str, ast.ClassDef]]:
        """The class and its bases found in the tree, nearest first."""
        seen: set[tuple[str, str]] = set()
        todo = [(dotted, cls)]
        while todo:
            where, current = todo.pop(0)
            if (where, current.name) in seen:
                continue
            seen.add((where, current.name))
            yield where, current
            for base in current.bases:
                name = base.id if isinstance(base, ast.Name) else None
                if isinstance(base, ast.Subscript) and isinstance(base.value, ast.Name):
                    name = base.value.id  # Generic[T]-style bases
                found = self.resolve(where, name) if name else None
                if found is not None and isinstance(found[1], ast.ClassDef):
                    todo.append((found[0], found[1]))

    def member(self, dotted: str, cls: ast.ClassDef, attr: str) -> tuple[str, ast.AST] | None:
        for where, current in self.bases(dotted, cls):
            for node in current.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr:
                    return where, node
        return None

    def attributes(self, dotted: str, cls: ast.ClassDef) -> set[str]:
        """Every attribute a class (and its bases) declares or assigns on ``self``."""
        found: set[str] = set()
        for _, current in self.bases(dotted, cls):
            for node in current.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    found.add(node.target.id)
                elif isinstance(node, ast.Assign):
                    found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.add(node.name)  # a property, or a method
                    for inner in ast.walk(node):
                        target = getattr(inner, "target", None)
                        targets = getattr(inner, "targets", [target] if target else [])
                        for item in [t for each in targets for t in _unpacked(each)]:
                            if (
                                isinstance(item, ast.Attribute)
                                and isinstance(item.value, ast.Name)
                                and item.value.id == "self"
                            ):
                                found.add(item.attr)
        return found


def _unpacked(target: ast.AST) -> list[ast.AST]:
    """The targets of an assignment, tuples unpacked (``self.a, self.b = ...``)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for each in target.elts for t in _unpacked(each)]
    return [target]


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, those under ``if``/``try``/``with`` included."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            yield from _statements(node.body)
            yield from _statements(getattr(node, "orelse", []))
            yield from _statements(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                yield from _statements(handler.body)


def _absolute(dotted: str, node: ast.ImportFrom, package: bool) -> str:
    """The module an ``ImportFrom`` in module ``dotted`` names."""
    if not node.level:
        return node.module or ""
    parts = dotted.split(".")
    base = parts if package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[str], bool, set[str]]:
    """(positional parameters in order, self dropped; whether it takes **kwargs; all names)."""
    args = node.args
    positional = [a.arg for a in [*args.posonlyargs, *args.args]]
    if positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    named = {a.arg for a in [*args.args, *args.kwonlyargs]}
    return positional, args.kwarg is not None, named


def _mentioned(tree: _Tree, item: Internal, node: ast.AST, depth: int = 0) -> set[str]:
    """The names a function's body mentions, and those of the methods of its class it calls
    on ``self`` (0.31 moved the monitor's arming into ``Worker._maybe_activate_jit_monitor``,
    still called from the warm-up: the hook holds)."""
    names: set[str] = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.Name):
            names.add(inner.id)
        elif isinstance(inner, ast.Attribute):
            names.add(inner.attr)
        elif isinstance(inner, ast.ImportFrom):
            names |= {alias.name for alias in inner.names}
        if (
            depth < 2
            and isinstance(inner, ast.Call)
            and isinstance(inner.func, ast.Attribute)
            and isinstance(inner.func.value, ast.Name)
            and inner.func.value.id == "self"
        ):
            cls = item.name.partition(".")[0]
            found = tree.find(item.module, f"{cls}.{inner.func.attr}")
            if not isinstance(found, str):
                names |= _mentioned(tree, item, found[1], depth + 1)
    return names


def _check_one(tree: _Tree, item: Internal) -> str | None:
    """What the tree holds instead of ``item``; None when it holds it as declared."""
    if item.also:
        present = [m for m in (item.module, *item.also) if tree.module(m) is not None]
        if not present:
            return f"none of {', '.join((item.module, *item.also))} is there"
        for module in present:
            if (instead := _check_one(tree, _one_module(item, module))) is not None:
                return instead
        return None
    if item.kind in (MODULE, STRINGS):
        parsed = tree.module(item.module)
        if parsed is None:
            return f"module {item.module} not found"
        strings = {
            n.value
            for n in ast.walk(parsed)
            if isinstance(n, ast.Constant) and n.value in item.needs
        }
        lost = [name for name in item.needs if name not in strings]
        return f"{item.module} no longer names {', '.join(lost)}" if lost else None
    found = tree.find(item.module, item.name)
    if isinstance(found, str):
        return found
    where, node = found
    if item.kind == NAME:
        return None
    if item.kind == FIELDS:
        if not isinstance(node, ast.ClassDef):
            return f"{item.name} in {where} is not a class"
        lost = [name for name in item.needs if name not in tree.attributes(where, node)]
        return f"{item.name} in {where} has no {', '.join(lost)}" if lost else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{item.name} in {where} is not a function"
    if item.kind == REFERS:
        mentioned = _mentioned(tree, item, node)
        lost = [name for name in item.needs if name not in mentioned]
        return f"{item.name} in {where} no longer uses {', '.join(lost)}" if lost else None
    positional, kwargs, named = _parameters(node)
    order = list(item.needs[: item.positional])
    if positional[: len(order)] != order:
        shown = ", ".join(positional[: len(order)]) or "none"
        return f"{item.name} in {where} takes ({shown}) first, not ({', '.join(order)})"
    lost = [name for name in item.needs[item.positional :] if name not in named and not kwargs]
    return f"{item.name} in {where} takes no {', '.join(lost)}" if lost else None


def _one_module(item: Internal, module: str) -> Internal:
    from dataclasses import replace

    return replace(item, module=module, also=())


def check_tree(root: Path, family: Family = FAMILIES[0]) -> list[Problem]:
    """Every internal of ``family`` the vLLM tree at ``root`` (the directory holding
    ``vllm/``) does not hold as declared; read with ``ast``, nothing imported."""
    tree = _Tree(Path(root))
    problems = []
    for item in family.internals:
        if (found := _check_one(tree, item)) is not None:
            problems.append(Problem(item, found))
    return problems
