"""The vllm warmer: ``vllm serve`` passes until a fresh engine meets no JIT (``VllmWarmer``), each
pass one engine process (``run_pass``), and what the warm keeps of them."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelcache import learned
from kernelcache.errors import WarmError
from kernelcache.toolchains import flashinfer, inductor, triton
from kernelcache.toolchains.base import (
    Warmer,
    WarmerReport,
    make_cache_dirs,
)
from kernelcache.toolchains.vllm import coverage, tuning
from kernelcache.toolchains.vllm.cache_root import (
    ENV,
    FACTOR,
    MARKER,
    MODEL_FACTOR,
    PLAN_DIR,
    SUBDIR,
    claim,
)
from kernelcache.toolchains.vllm.coverage import Coverage
from kernelcache.toolchains.vllm.engine import _merge_compiled, output_digests, outputs_digest
from kernelcache.toolchains.vllm.hooks import WARMUP_FILE, WARMUP_SUBDIR

if TYPE_CHECKING:
    from kernelcache.spec import MoeTuning, VllmWorkload

log = logging.getLogger(__name__)


TOOLCHAIN_DIRS = (triton.SUBDIR, inductor.CACHE_SUBDIR, flashinfer.SUBDIR)
# Set for every engine pass unless the spec's env says otherwise: no hub, and vLLM's startup
# plan recorded (the compile Job's measured KV-cache size, applied in serving).
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_STARTUP_PLAN": "1"}


@dataclass
class VllmReport(WarmerReport):
    """The warm report plus each pass, the recorded sizes and vLLM's own cache key factors."""

    passes: list[dict[str, Any]] = field(default_factory=list)
    preload_sizes: list[int] = field(default_factory=list)
    compiled_by_toolchain: dict[str, dict[str, float]] = field(default_factory=dict)
    cache_key_factors: dict[str, Any] = field(default_factory=dict)
    # FlashInfer's modules the engine loaded, each laid out prebuilt under files/flashinfer/aot
    # (the init-container refuses a generation lacking one) for the arch list the warm used.
    flashinfer_modules: list[str] = field(default_factory=list)
    arch_list: str = ""
    startup_plans: list[str] = field(default_factory=list)  # under files/vllm/startup_plan
    coverage: dict[str, str] = field(default_factory=dict)  # family -> what was enumerated
    coverage_gaps: list[str] = field(default_factory=list)  # met after ready all the same
    moe_tuning: dict[str, Any] | None = None  # what the fused-MoE tuning did (``tuning``)


class VllmWarmer(Warmer):
    type = "vllm"
    report_type = VllmReport
    fills = (*TOOLCHAIN_DIRS, SUBDIR, WARMUP_SUBDIR, tuning.SUBDIR)

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
            "FLASHINFER_CUDA_ARCH_LIST": self.config.env.get(
                "FLASHINFER_CUDA_ARCH_LIST", flashinfer.cuda_arch_list(arch)
            ),
        }

    def produce(self, files_dir: Path, arch: str, report: VllmReport) -> None:
        workload = self.workload
        root = Path(workload.cache_root)
        claim(root)
        env = dict(os.environ)
        # What serving met after an earlier generation was ready runs before the monitor arms
        # from the first pass on: compiled here, recorded, preloaded in serving.
        bound = workload.max_num_batched_tokens
        sizes: set[int] = {n for n in learned.sizes(self.learned) if not bound or n <= bound}
        modules: set[str] = set()
        kernels: set[str] = set()
        enumerated: Coverage | None = None
        coverage_file = Path(tempfile.mkdtemp(prefix="kernelcache-vllm-coverage-")) / "c.json"
        tune = workload.moe_tuning if workload.moe_tuning.mode != "off" else None
        # The passes: a cold one (it compiles; first it tunes the MoE tables when asked, and
        # when the tuning ran layers from outside, that engine ends and does not count); one
        # set up as serving that enumerates the coverage before the monitor arms; then ones
        # set up as serving that replay it, until one meets no JIT or maxPasses is spent.
        counted = 0
        while counted < workload.max_passes:
            enumerating = counted == 1
            serving = counted >= 1
            mode = coverage.ENUMERATE if enumerating else str(coverage_file) if serving else None
            result = run_pass(
                workload,
                env,
                sorted(sizes),
                serving,
                self.config.timeout_seconds,
                mode,
                tune if not report.passes else None,
            )
            report.passes.append(pass_summary(result))
            if not report.moe_tuning and result.get("moe_tuning"):
                report.moe_tuning = result["moe_tuning"]
            if result.get("tuning_ended"):
                continue  # a fresh engine reads the tables: the cold pass is the next
            counted += 1
            if not any(p["armed"] and not p["server"] for p in result["processes"]):
                raise WarmError(
                    f"{self.label}: kernelcache's hooks did not run in vLLM's engine core "
                    "process (install kernelcache into vLLM's interpreter: its .pth hook "
                    "loads the runtime in every process vllm serve starts)"
                )
            modules.update(result["flashinfer_modules"])
            if not serving or enumerating:  # their compiles are the generation's kernels
                kernels.update(k for _, k in _compiled(result))
                report.compiled += len(_compiled(result))
                _merge_compiled(report.compiled_by_toolchain, result["compiled_by_toolchain"])
            if enumerating:
                if not result.get("coverage"):
                    raise WarmError(f"{self.label}: the engine did not enumerate its coverage")
                enumerated = Coverage(**result["coverage"])
                enumerated.full_coverage_required = workload.require_full_coverage
                coverage_file.write_text(enumerated.to_json())
                if not result["jit_events"] and counted >= workload.max_passes:
                    break
                sizes |= {e["tokens"] for e in result["jit_events"] if e["tokens"]}
                continue
            if serving and not result["jit_events"] and not result["cold_compiles"]:
                break
            sizes |= {e["tokens"] for e in result["jit_events"] if e["tokens"]}
        else:
            if enumerated is None:
                raise WarmError(
                    f"{self.label}: maxPasses {workload.max_passes} left no pass to enumerate "
                    "the coverage in"
                )
            families = {s.kernel: s.family for s in enumerated.specializations()}
            enumerated.gaps = gaps(report.passes[-1], families)
            log.warning(
                "%s: %d kernel(s) still met after ready in the last of %d engine processes, "
                "named in the generation as gaps: %s",
                self.label,
                len(enumerated.gaps),
                workload.max_passes,
                "; ".join(enumerated.gap_lines()[:3]),
            )
        report.kernels = sorted(kernels)
        report.preload_sizes = sorted(sizes)
        report.arch_list = env.get("FLASHINFER_CUDA_ARCH_LIST", "")
        report.flashinfer_modules = keep_flashinfer_modules(files_dir, sorted(modules))
        self._keep(files_dir, root, report, enumerated)
        shutil.rmtree(coverage_file.parent, ignore_errors=True)

    def _keep(
        self, files_dir: Path, root: Path, report: VllmReport, enumerated: Coverage | None
    ) -> None:
        """vLLM's tree into files/vllm (its marker left out), the sizes and the enumerated
        coverage beside it."""
        target = files_dir / SUBDIR
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(root, target, ignore=shutil.ignore_patterns(MARKER))
        sizes_file = files_dir / WARMUP_FILE
        sizes_file.parent.mkdir(parents=True, exist_ok=True)
        sizes_file.write_text(json.dumps({"sizes": report.preload_sizes}) + "\n")
        if enumerated is not None:
            (files_dir / coverage.FILE).write_text(enumerated.to_json())
            report.coverage = enumerated.summary()
            report.coverage_gaps = enumerated.gap_lines()
        if said := tuning.summary(report.moe_tuning):
            report.coverage[f"{coverage.MOE} tables"] = said
        report.cache_key_factors = cache_key_factors(target)
        report.startup_plans = sorted(p.name for p in (target / PLAN_DIR).glob("*.json"))


def gaps(last: Mapping[str, Any], families: Mapping[str, str]) -> list[dict[str, Any]]:
    """What a pass still met after ready (vLLM's monitor's events, then compiles it did not
    see), one entry per kernel: family (as the coverage named a kernel of that name, else
    by its name), kernel, the batch it was met in."""
    found: dict[str, dict[str, Any]] = {}
    for event in last["jit_events"]:
        kernel = str(event["kernel"])
        batch = event.get("batch") or (
            f"a served forward of {event['tokens']} tokens"
            if event.get("tokens")
            else "outside a forward"
        )
        found.setdefault(kernel, {
            "family": families.get(kernel) or coverage.family(kernel, ""), "kernel": kernel,
            "tokens": event.get("tokens"), "batch": batch,
        })  # fmt: skip
    for name in last["cold_compiles"]:
        toolchain, _, kernel = str(name).partition("/")
        found.setdefault(kernel, {
            "family": toolchain, "kernel": kernel, "tokens": None,
            "batch": "compiled after the coverage was replayed",
        })  # fmt: skip
    return list(found.values())


def keep_flashinfer_modules(files_dir: Path, modules: list[str]) -> list[str]:
    """Lay out the FlashInfer modules vLLM built in the warm as FlashInfer loads prebuilt ones
    (``files/flashinfer/aot/<name>/<name>.so``: see ``toolchains.flashinfer``), so serving
    runs with ``FLASHINFER_DISABLE_JIT=1``; a loaded module with no library fails the warm."""
    base = files_dir / flashinfer.SUBDIR
    built: list[str] = []
    for jit_dir in sorted(base.glob(f".cache/flashinfer/*/*/{flashinfer.JIT_SUBDIR}")):
        built += flashinfer.aot_layout(jit_dir.parent, base / flashinfer.AOT_SUBDIR)
    if lost := [m for m in modules if m not in built]:
        raise WarmError(
            f"vllm warmer: FlashInfer module {lost[0]} was loaded but no library of it was "
            f"built under {flashinfer.SUBDIR}/.cache (built: {', '.join(built) or 'none'})"
        )
    return modules


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
    keep = (
        "serving",
        "preload_sizes",
        "ready_seconds",
        "import_seconds",
        "sweep_seconds",
        "torch_compile_seconds",
        "coverage_seconds",
        "tuning_ended",
        "processes",
        "startup_plan",
        "flashinfer_modules",
        "flashinfer_builds",
    )
    summary = {name: result.get(name) for name in keep}
    summary.update(
        jit_events=result["jit_events"],
        cold_compiles=result["cold_compiles"],
        preload_seconds=result.get("preload_seconds", 0.0),
        outputs_digest=outputs_digest(result["outputs"]),
        output_digests=output_digests(result["outputs"]),
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
    coverage_mode: str | None = None,
    tune: MoeTuning | None = None,
) -> dict[str, Any]:
    """One engine process (``drive``); its result, or a WarmError with its last line.

    ``coverage_mode``: ``coverage.ENUMERATE`` (the engine enumerates its coverage before the
    JIT monitor arms), a coverage file's path (it replays that one there, as serving does), or
    None (neither: the cold pass).
    With ``tune`` it first tunes the fused-MoE tables (``tuning``). The engine's log streams
    through as it runs."""
    from kernelcache.toolchains import serving_settings

    with tempfile.TemporaryDirectory(prefix="kernelcache-vllm-") as tmp:
        job: dict[str, Any] = {
            "engine": workload.engine_args(),
            "sweep": sweep_plan(workload),
            "runtime": "warm",
            "preload": sizes,
            "coverage": coverage_mode,
            "tune": tune.model_dump() if tune is not None else None,
            "result": str(Path(tmp) / "result.json"),
        }
        # A later pass is set up as serving from the generation is.
        child_env = {**serving_settings(), **env} if serving else env
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.Popen(
            [sys.executable, "-m", "kernelcache.toolchains.vllm", str(job_path)],
            env=child_env,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        said: list[str] = []
        reader = threading.Thread(target=_relay, args=(proc, said), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            proc.wait()
            raise WarmError(f"vllm warmer: an engine pass ran past {timeout} s") from exc
        finally:
            reader.join(timeout=10)
        result_path = Path(job["result"])
        result: dict[str, Any] = json.loads(result_path.read_text()) if result_path.exists() else {}
        if proc.returncode != 0 or not result:
            last = result.get("sweep_error") or (
                said[-1].strip() if said else f"exit status {proc.returncode}"
            )
            raise WarmError(f"vllm warmer: engine pass failed: {last}")
    result["serving"] = serving
    return result


def _relay(proc: subprocess.Popen[str], said: list[str]) -> None:
    """The engine's log to ours as it comes (the Job's log shows the tuning's progress), its
    non-blank lines kept for the error that names the last one."""
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        if line.strip():
            said[:] = [*said[-99:], line]
