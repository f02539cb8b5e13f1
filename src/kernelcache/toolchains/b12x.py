"""The b12x warmer: FlashInfer's SM12x fused-MoE kernels, compiled ahead of time on any node.

vLLM's ``--moe-backend=flashinfer_b12x`` runs FlashInfer's ``B12xMoEWrapper``, which picks a
CuTe-DSL kernel per batch size (direct micro, MMA micro, static or dynamic, each sized to the
GPU's SM count) and compiles it the first time that size is served: 4-13 s per kernel, with
every in-flight request waiting. FlashInfer persists them itself (``jit/cute_dsl_core.py``:
``<kernel>.o`` + ``meta.json`` under ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/
<arch-list>/cached_ops/b12x_moe_<arch>_cute_dsl/``), but only for sizes a process met.

This warmer produces that directory ahead of time, for every batch size of the workload:

1. **Enumerate.** It drives the public wrapper, as vLLM builds it (``use_cuda_graph=True`` and a
   fixed ``max_num_tokens``, which make the kernel choice deterministic), with CPU tensors and
   FlashInfer's kernel building replaced by a recorder; the recorder keeps each kernel's name
   and compile closure and hands back a kernel that does nothing.
2. **Answer the GPU's questions.** The choice and the kernels depend on the target's SM count
   and cluster occupancy (``get_num_sm``, ``get_max_active_clusters``), which come from the
   spec's GPU classes, not from whatever GPU (or none) the warm runs on; on a node without
   CUDA the capture guard and the CUDA version check are answered too.
3. **Compile in parallel.** Each recorded kernel goes through FlashInfer's own
   ``JitSpecCuteDsl.compile_and_persist()`` in forked worker processes (the closures are
   inherited; compiles take no lock, only the commit does).
4. **The kernel FlashInfer does not persist.** The NVFP4 "direct micro" decode kernel is
   compiled in-process on every start; it goes through kernelcache's CuTe-DSL disk layer
   (``files/cute-dsl``), which the serving runtime installs over ``cute.compile``.

The generation is only usable by a serving process whose FlashInfer computes the same keys:
the stamp carries FlashInfer's CuTe-DSL fingerprint, its install path and the SM counts
(``flashinfer/*``, ``gpu/sm_count``), so verify refuses a mismatch before FlashInfer would
silently wipe the directory and compile everything again.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kernelcache import progress
from kernelcache.errors import ColdCompileError, WarmError
from kernelcache.runtime import metrics
from kernelcache.runtime.imports import when_imported
from kernelcache.toolchains.base import Serving, Toolchain, Warmer, WarmerReport, scoped_env
from kernelcache.toolchains.cute_dsl import SUBDIR as CUTE_SUBDIR
from kernelcache.toolchains.flashinfer import (
    SUBDIR,
    cuda_arch_list,
    import_flashinfer,
    parse_build_log,
)

if TYPE_CHECKING:
    from kernelcache.spec import B12xWorkload, GpuClass

_ARCH = re.compile(r"^sm_(12[01])a$")


@dataclass(frozen=True)
class Target:
    """The GPU the kernels are for, as FlashInfer would measure it there."""

    arch: str
    sm_count: int
    max_active_clusters: int

    @property
    def label(self) -> str:
        return f"{self.arch}/{self.sm_count}sm"


def targets_for(arch: str, gpu_classes: list[GpuClass]) -> list[Target]:
    """One target per distinct (SM count, occupancy) among the arch's GPU classes."""
    if _ARCH.match(arch) is None:
        raise WarmError(f"b12x warmer: kernels are for sm_120a or sm_121a, not {arch}")
    found: dict[tuple[int, int], Target] = {}
    for gpu in (g for g in gpu_classes if g.arch == arch):
        if gpu.sm_count is None:
            raise WarmError(
                f"b12x warmer: gpuClasses {gpu.name}: smCount is required (the b12x kernels "
                "are sized to the target's SM count)"
            )
        clusters = gpu.max_active_clusters or gpu.sm_count
        found.setdefault((gpu.sm_count, clusters), Target(arch, gpu.sm_count, clusters))
    return list(found.values())


def arch_list(arch: str) -> str:
    """``FLASHINFER_CUDA_ARCH_LIST`` as FlashInfer picks it on that GPU with CUDA >= 12.9.

    b12x needs CUDA 13, where FlashInfer names an sm_120 GPU "12.0f": the workspace
    directory ("120f") must be the one the serving process looks in.
    """
    return cuda_arch_list(arch).rstrip("af") + "f"


@dataclass
class Recorded:
    """One kernel the wrapper asked for: FlashInfer-persisted, or a direct-micro kernel."""

    name: str
    compile: Callable[[], Any]
    persisted: bool
    target: Target
    seconds: float = 0.0


@dataclass
class B12xReport(WarmerReport):
    """The warm report, plus where the kernels went and what compiling them cost."""

    arch_list: str = ""
    module_dir: str = ""  # relative to files/
    targets: list[str] = field(default_factory=list)
    direct_micro: list[str] = field(default_factory=list)
    workers: int = 0
    compile_seconds: dict[str, float] = field(default_factory=dict)
    serial_seconds: float = 0.0  # the sum of the kernels' compile times
    wall_seconds: float = 0.0  # what the parallel compile took


class B12xWarmer(Warmer):
    type = "b12x"
    report_type = B12xReport
    fills = (SUBDIR, CUTE_SUBDIR)

    @property
    def label(self) -> str:
        workload = self.config.b12x_workload()
        return (
            f"b12x E={workload.experts} top{workload.top_k} "
            f"H={workload.hidden_size} I={workload.intermediate_per_slice}"
        )

    def sources(self) -> dict[str, str]:
        return {}  # FlashInfer's sources are keyed by the flashinfer/* factors

    def measured_factors(self) -> list[str]:
        return ["flashinfer/cute-dsl-fingerprint", "flashinfer/install"]

    def sm_counts(self, arch: str) -> list[int]:
        return [t.sm_count for t in targets_for(arch, self.gpu_classes)]

    def env(self, files_dir: Path, arch: str) -> dict[str, str]:
        return {
            "FLASHINFER_WORKSPACE_BASE": str(files_dir / SUBDIR),
            "FLASHINFER_CUDA_ARCH_LIST": arch_list(arch),
            "CUTE_DSL_ARCH": arch,
        }

    def produce(self, files_dir: Path, arch: str, report: B12xReport) -> None:
        workload = self.config.b12x_workload()
        targets = targets_for(arch, self.gpu_classes)
        report.arch_list = arch_list(arch)
        report.targets = [t.label for t in targets]
        with tempfile.TemporaryDirectory(prefix="kernelcache-b12x-") as tmp:
            log = Path(tmp) / "build-log.jsonl"
            with scoped_env({"FLASHINFER_JIT_BUILD_LOG": str(log)}):
                jit_env = import_flashinfer(files_dir / SUBDIR)
                kernels: dict[str, Recorded] = {}
                for target in targets:
                    with answered_for(target):
                        kernels.update(record(workload, target))
                _progress(f"b12x: {len(kernels)} kernels for {', '.join(report.targets)}")
                report.workers = workload.compile_workers or os.cpu_count() or 1
                cute_dir = files_dir / CUTE_SUBDIR
                wall = time.perf_counter()
                compile_all(list(kernels.values()), report.workers, cute_dir)
                report.wall_seconds = round(time.perf_counter() - wall, 3)
            builds = [r for r in parse_build_log(log) if r.toolchain != "nvcc"]
        module_dir = Path(jit_env.FLASHINFER_JIT_DIR) / f"b12x_moe_{arch.replace('_', '')}_cute_dsl"
        missing = [
            k.name
            for k in kernels.values()
            if k.persisted and not (module_dir / f"{k.name}.o").is_file()
        ]
        if missing:
            raise WarmError(
                f"b12x warmer: kernel {missing[0]} did not appear in {module_dir.name} for "
                f"{arch} ({len(missing)} of {len(kernels)} missing)"
            )
        report.module_dir = module_dir.relative_to(files_dir).as_posix()
        report.kernels = sorted(k.name for k in kernels.values() if k.persisted)
        report.direct_micro = sorted(k.name for k in kernels.values() if not k.persisted)
        report.compile_seconds = {k.name: round(k.seconds, 3) for k in kernels.values()}
        report.serial_seconds = round(sum(k.seconds for k in kernels.values()), 3)
        report.compiled = len(builds) + len(report.direct_micro)


class B12x(Toolchain):
    """FlashInfer's SM12x fused-MoE kernels: files in FlashInfer's workspace and the CuTe-DSL
    disk layer (their cache variables are those toolchains')."""

    def observe(self, serving: Serving) -> None:
        if serving.config.strict:
            refuse_cute_dsl_builds()


def refuse_cute_dsl_builds() -> None:
    """Strict mode: a FlashInfer CuTe-DSL kernel (b12x) missing from the generation is refused.

    FlashInfer looks for the kernel's ``.o`` first and calls ``JitSpecCuteDsl.build`` only on
    a miss; the refusal names the kernel, which ``FLASHINFER_DISABLE_JIT``'s error does not.
    """
    when_imported("flashinfer.jit.cute_dsl_core", _refuse_cute_dsl_builds)


def _refuse_cute_dsl_builds(module: ModuleType) -> None:
    def build(spec: Any) -> None:
        kernel = spec.name  # <module>/<kernel>
        metrics.record_compile("flashinfer", kernel, None)
        raise ColdCompileError(
            f"flashinfer: cold compile of {kernel} in strict mode (not in the generation)"
        )

    module.JitSpecCuteDsl.build = build


TOOLCHAIN = B12x(
    name="b12x",
    warmers=(B12xWarmer,),
    requires=("flashinfer-python", "flashinfer"),
)


# ------------------------------------------------------------------ FlashInfer's b12x modules


def _modules() -> tuple[ModuleType, ModuleType, ModuleType]:
    """(moe_dispatch, moe_direct_micro_kernel, b12x_moe): where the b12x path lives in 0.7.x."""
    try:
        from flashinfer.fused_moe.cute_dsl import b12x_moe
        from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import (
            moe_direct_micro_kernel,
            moe_dispatch,
        )
    except ImportError as exc:
        raise WarmError(f"b12x warmer: this FlashInfer has no b12x fused MoE: {exc}") from exc
    return moe_dispatch, moe_direct_micro_kernel, b12x_moe


@contextlib.contextmanager
def patched(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes for a block, then put the old ones back."""
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


@contextlib.contextmanager
def answered_for(target: Target) -> Iterator[None]:
    """Every question FlashInfer's b12x path asks the GPU, answered for ``target``.

    The SM count and occupancy are always the target's (the warm may run on another GPU);
    the capture guard and CUDA version only where this node has no CUDA to ask.
    """
    import torch
    from flashinfer.jit import cpp_ext
    from packaging.version import Version

    dispatch, direct, _ = _modules()
    real_cutover = dispatch._get_static_compact_cutover_pairs

    def cutover(*args: Any, sm_count: int | None = None, **kwargs: Any) -> Any:
        return real_cutover(*args, sm_count=sm_count or target.sm_count, **kwargs)

    def sm_count(device: Any = None) -> int:
        return target.sm_count

    def clusters(cluster_size: int) -> int:
        return target.max_active_clusters

    sized = {"get_num_sm": sm_count, "get_max_active_clusters": clusters}
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(direct, **sized))
        stack.enter_context(
            patched(
                dispatch,
                **sized,
                _get_static_compact_cutover_pairs=cutover,
                _is_sm120_nvfp4=lambda device, quant: target.arch == "sm_120a" and quant == "nvfp4",
            )
        )
        if not torch.cuda.is_available():
            from cuda.bindings import driver

            stack.enter_context(patched(torch.cuda, is_current_stream_capturing=lambda: False))
            stack.enter_context(patched(cpp_ext, get_cuda_version=lambda: Version("13.0")))
            stack.enter_context(patched(direct, current_cuda_stream=lambda: driver.CUstream(0)))
        yield


class _NoKernel:
    """What the recorder hands back for a kernel: launching it does nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


def record(workload: B12xWorkload, target: Target) -> dict[str, Recorded]:
    """The kernels the wrapper builds for each batch size, by name, without compiling any."""
    dispatch, _, _ = _modules()
    from flashinfer.jit._cute_dsl_source import _hash_source_files
    from flashinfer.jit.cute_dsl_core import JitSpecCuteDsl

    kernels: dict[str, Recorded] = {}
    compile_direct = dispatch.compile_direct_micro_kernel

    def persisted(module: str, name: str, compile_fn: Any, extra_key_files: Any = (), *,
                  enable_tvm_ffi: bool = True) -> _NoKernel:  # fmt: skip
        def build() -> None:
            sources = _hash_source_files(tuple(extra_key_files))
            spec = JitSpecCuteDsl(module, name, compile_fn, sources, enable_tvm_ffi=enable_tvm_ffi)
            spec.compile_and_persist()

        kernels.setdefault(name, Recorded(name, build, True, target))
        return _NoKernel()

    def direct_micro(kernel: Any, *, topk_ids_dtype: Any = None, options: Any = None) -> Any:
        name = f"direct_micro[m_const={int(kernel.m_const)},grid_x={kernel.grid_x},{target.label}]"
        kwargs = {"topk_ids_dtype": topk_ids_dtype} if topk_ids_dtype is not None else {}
        if options is not None:
            kwargs["options"] = options
        kernels.setdefault(
            name, Recorded(name, lambda: compile_direct(kernel, **kwargs), False, target)
        )
        return _NoKernel()

    wrapper = wrapper_for(workload)
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(dispatch, **fresh_memos(dispatch)))
        stack.enter_context(
            patched(
                dispatch,
                build_and_load_cute_dsl_kernel=persisted,
                compile_direct_micro_kernel=direct_micro,
            )
        )
        stack.enter_context(without_launches())
        for m in sorted(set(workload.batch_sizes)):
            wrapper.run(**operands(workload, m))
    return kernels


def wrapper_for(workload: B12xWorkload) -> Any:
    """FlashInfer's MoE wrapper as vLLM builds it: CUDA-graph workspaces sized once, which
    makes the kernel chosen for each batch size deterministic. CPU tensors: never launched."""
    _, _, b12x_moe = _modules()
    return b12x_moe.B12xMoEWrapper(
        num_experts=workload.experts,
        top_k=workload.top_k,
        hidden_size=workload.hidden_size,
        intermediate_size=workload.intermediate_per_slice,
        use_cuda_graph=True,
        max_num_tokens=workload.max_num_tokens,
        num_local_experts=workload.local_experts,
        device="cpu",
        activation=workload.activation,
        quant_mode=workload.quantization,
    )


@contextlib.contextmanager
def without_launches() -> Iterator[None]:
    """Stand-ins for what only the GPU can do: launches, the Triton compaction around them and
    the direct-micro kernel's register probe (which then always accepts)."""
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import triton_compact

    dispatch, direct, _ = _modules()
    with (
        patched(dispatch, compiled_direct_micro_accepts_block_dim=lambda compiled, dim: True),
        patched(triton_compact, compact_topk_ids=lambda *a, **k: None),
        patched(direct.MoEDirectMicroKernel, launch=staticmethod(_NoKernel())),
    ):
        yield


def fresh_memos(module: ModuleType) -> dict[str, dict[Any, Any]]:
    """Empty stand-ins for the module's in-process kernel and workspace memos (``_*_CACHE``).

    They are keyed without the SM count: a second target recorded in one process would be
    answered from the first one's kernels, and nothing would be asked for.
    """
    return {
        name: {}
        for name, value in vars(module).items()
        if name.startswith("_") and name.endswith("_CACHE") and isinstance(value, dict)
    }


def operands(workload: B12xWorkload, tokens: int) -> dict[str, Any]:
    """CPU tensors shaped like the wrapper's operands for ``tokens`` tokens (values unused)."""
    import torch
    from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout

    experts = workload.local_experts or workload.experts
    hidden, inter, top_k = workload.hidden_size, workload.intermediate_per_slice, workload.top_k
    gated = workload.activation != "relu2"
    w1_rows = 2 * inter if gated else inter

    def scales(rows: int, cols: int) -> torch.Tensor:
        padded_rows, padded_cols = -(-rows // 128) * 128, -(-(cols // 16) // 4) * 4
        raw = torch.zeros(experts * padded_rows, padded_cols, dtype=torch.float8_e4m3fn)
        return convert_sf_to_mma_layout(raw, m=rows, k=cols, num_groups=experts)

    ids = (torch.arange(top_k) + torch.arange(tokens)[:, None]) % workload.experts
    return {
        "x": torch.zeros(tokens, hidden, dtype=torch.bfloat16),
        "w1_weight": torch.zeros(experts, w1_rows, hidden // 2, dtype=torch.uint8),
        "w1_weight_sf": scales(w1_rows, hidden),
        "w2_weight": torch.zeros(experts, hidden, inter // 2, dtype=torch.uint8),
        "w2_weight_sf": scales(hidden, inter),
        "token_selected_experts": ids.to(torch.int32),
        "token_final_scales": torch.full((tokens, top_k), 1.0 / top_k),
        "w1_alpha": torch.ones(experts),
        "w2_alpha": torch.ones(experts),
        "fc2_input_scale": torch.ones(1),
    }


# ------------------------------------------------------------------ compiling


_pending: list[Recorded] = []  # what forked workers compile, inherited with the closures
_pending_cute_dir: Path | None = None


def compile_all(kernels: list[Recorded], workers: int, cute_dir: Path) -> None:
    """Compile every recorded kernel, ``workers`` at a time, in forked processes.

    A compile holds no lock and FlashInfer commits each kernel atomically, so workers only
    share the module's ``meta.json`` write. Fork, not spawn: the compile closures are not
    picklable, and a child inherits them with FlashInfer already imported.
    """
    global _pending, _pending_cute_dir
    _pending, _pending_cute_dir = kernels, cute_dir
    fork = multiprocessing.get_context("fork")
    try:
        with ProcessPoolExecutor(max(1, min(workers, len(kernels))), mp_context=fork) as pool:
            futures = [pool.submit(_compile_one, index) for index in range(len(kernels))]
            for done, future in enumerate(as_completed(futures), 1):
                try:
                    index, seconds, error = future.result()
                except BrokenProcessPool:  # a worker killed (out of memory, say)
                    error, index = "a compile worker died (killed, or out of memory)", -1
                if error:
                    pool.shutdown(cancel_futures=True)
                    what = kernels[index].name if index >= 0 else f"{len(kernels) - done + 1} left"
                    raise WarmError(f"b12x warmer: {what}: {error}")
                kernels[index].seconds = seconds
                _progress(f"b12x: [{done}/{len(kernels)}] {kernels[index].name} {seconds:.1f}s")
                progress.compiled("b12x", kernels[index].name, seconds)
    finally:
        _pending, _pending_cute_dir = [], None


def _compile_one(index: int) -> tuple[int, float, str | None]:
    """In a worker: one kernel, FlashInfer-persisted or through the CuTe-DSL disk layer."""
    from kernelcache.runtime import cute as disk

    kernel = _pending[index]
    assert _pending_cute_dir is not None
    start = time.perf_counter()
    try:
        with answered_for(kernel.target):
            if kernel.persisted:
                kernel.compile()
            else:
                disk.install()
                with disk.cache_dir(_pending_cute_dir) as cache:
                    kernel.compile()
                if cache.stats.persisted != 1:
                    return index, 0.0, f"not kept by the CuTe-DSL disk layer ({cache.stats})"
    except Exception as exc:  # reported with the kernel's name by the parent
        return index, 0.0, " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
    return index, time.perf_counter() - start, None


def _progress(line: str) -> None:
    print(line, flush=True)
