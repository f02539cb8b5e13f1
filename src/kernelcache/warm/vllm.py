"""The vllm warmer: start the engine as the serving pod will, drive the declared traffic, and
keep vLLM's whole cache, until a fresh engine serving from it meets no JIT at all.

Each pass is a fresh process (``drive``) running ``vllm.LLM`` with the spec's engine arguments,
``VLLM_CACHE_ROOT`` at the workload's ``cacheRoot`` (the path serving uses too: vLLM's cache
holds absolute paths, ``kernelcache.vllm_root``) and Triton, inductor and FlashInfer caches in
the staging generation, then a sweep of requests over every declared prompt length and batch
size with vLLM's own JIT monitor in ``warn`` mode. The first pass compiles (cold); each later
pass is set up as serving is (``runtime.vllm``: the forward sizes at which the monitor fired
so far run before it arms) and must see nothing: no monitor event, no compile counted by
kernelcache. After at most ``maxPasses`` processes the warm fails naming the kernel that still
JITs. The cache root is then copied into ``files/vllm``, with the recorded sizes in
``files/vllm-warmup/sizes.json`` and vLLM's own ``cache_key_factors.json`` in the report.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelcache import vllm_root
from kernelcache.errors import WarmError
from kernelcache.spec import VllmWorkload
from kernelcache.warm import Warmer, WarmerReport, cache_env, record_growth, snapshot

TOOLCHAIN_DIRS = ("triton", "inductor", "flashinfer")
# Set by vLLM's own warm-up; left as vLLM chooses them unless the spec's env says otherwise.
_ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class VllmReport(WarmerReport):
    """The warm report plus each pass, the recorded sizes and vLLM's own cache key factors."""

    passes: list[dict[str, Any]] = field(default_factory=list)
    preload_sizes: list[int] = field(default_factory=list)
    compiled_by_toolchain: dict[str, dict[str, float]] = field(default_factory=dict)
    cache_key_factors: dict[str, Any] = field(default_factory=dict)


class VllmWarmer(Warmer):
    type = "vllm"

    @property
    def workload(self) -> VllmWorkload:
        return self.config.vllm_workload()

    @property
    def label(self) -> str:
        return f"vllm {self.workload.model}"

    def measured_factors(self) -> list[str]:
        return ["vllm/install"]

    def path_factors(self) -> dict[str, str]:
        return {vllm_root.FACTOR: self.workload.cache_root, "vllm/model": self.workload.model}

    def run(self, files_dir: Path, arch: str) -> WarmerReport:
        workload = self.workload
        root = Path(workload.cache_root)
        vllm_root.claim(root)
        before = snapshot(files_dir, [*TOOLCHAIN_DIRS, vllm_root.SUBDIR])
        env = {
            **os.environ,
            **_ENGINE_ENV,
            **self.config.env,
            **cache_env(files_dir),
            vllm_root.ENV: str(root),
            "CUTE_DSL_ARCH": arch,
        }
        report = VllmReport(warmer=self.label)
        start = time.perf_counter()
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
        report.seconds = round(time.perf_counter() - start, 3)
        after = snapshot(files_dir, [*TOOLCHAIN_DIRS, vllm_root.SUBDIR, "vllm-warmup"])
        record_growth(report, files_dir, {p: n for p, n in after.items() if before.get(p) != n})
        return report

    def _keep(self, files_dir: Path, root: Path, report: VllmReport) -> None:
        """vLLM's tree into files/vllm (its marker left out), the sizes beside it."""
        target = files_dir / vllm_root.SUBDIR
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(root, target, ignore=shutil.ignore_patterns(vllm_root.MARKER))
        sizes_file = files_dir / "vllm-warmup" / "sizes.json"
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


def run_pass(
    workload: VllmWorkload,
    env: dict[str, str],
    sizes: list[int],
    serving: bool,
    timeout: int,
) -> dict[str, Any]:
    """One engine process (``drive``); its result, or a WarmError with its last line."""
    from kernelcache.runtime import SERVING_SETTINGS

    with tempfile.TemporaryDirectory(prefix="kernelcache-vllm-") as tmp:
        job: dict[str, Any] = {
            "engine": workload.engine_args(),
            "sweep": sweep_plan(workload),
            "runtime": "warm",
            "preload": sizes,
            "result": str(Path(tmp) / "result.json"),
        }
        # A later pass is set up as serving from the generation is.
        child_env = {**SERVING_SETTINGS, **env} if serving else env
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
    from kernelcache.runtime import hooks, metrics, observe_torch
    from kernelcache.runtime import vllm as serving

    if job["runtime"] == "serving":  # as the serving image's .pth hook does
        from kernelcache.runtime import autoinstall

        autoinstall()
    elif job["runtime"] == "warm":
        hooks.watch_triton(strict=False)
        observe_torch(None, strict=False)
        serving.watch(job["preload"], strict=False)
    else:  # an engine of its own: only vLLM's monitor is counted
        serving.watch([], strict=False)
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
        "monitor_mode": serving.state.monitor_mode,
        "preload_sizes": serving.state.sizes,
        "preload_seconds": serving.state.preload_seconds,
        "jit_events": serving.state.events,
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
