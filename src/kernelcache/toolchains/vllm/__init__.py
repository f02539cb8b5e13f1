"""vLLM: the engine's whole cache warmed through ``vllm serve`` until a fresh server meets no
JIT, its cache root bound to one absolute path, and, in serving, the warmed shapes loaded
before vLLM's JIT monitor arms, in the process where the model runs.

**Warm.** Each pass is a fresh ``vllm serve`` (``drive``: an API server and its engine core
process, as a serving pod runs them) with the spec's engine arguments as its flags,
``VLLM_CACHE_ROOT`` at the workload's ``cacheRoot`` (the path serving uses too: see the cache
root below), Triton, inductor and FlashInfer caches in the staging generation and vLLM's
startup plan on; then a sweep of completions over every declared prompt length and batch
size with vLLM's own JIT monitor in ``warn`` mode. kernelcache's hooks reach vLLM's processes
through the runtime's ``.pth`` hook (``KERNELCACHE_RUNTIME=1``); each process writes what they
saw to ``KERNELCACHE_VLLM_STATE_DIR`` (``dump``). The first pass compiles (cold); each later
pass is set up as serving is (the forward sizes at which the monitor fired so far run before
it arms, ``KERNELCACHE_VLLM_SIZES``) and must see nothing: no monitor event, no compile
counted by kernelcache. After at most ``maxPasses`` servers the warm fails naming the kernel
that still JITs. The cache root (with vLLM's startup plan) is then copied into
``files/vllm``, the recorded sizes into ``files/vllm-warmup/sizes.json``, the FlashInfer
modules the engine loaded into FlashInfer's prebuilt layout (``keep_flashinfer_modules``), and
vLLM's own ``cache_key_factors.json`` into the report.

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
So the fused-MoE specializations the engine's configuration allows are enumerated in the
warm (``coverage``, right after the model loads; with vLLM's fused-MoE tables tuned for the
GPU first where it ships none, ``tuning``) and replayed and checked before the monitor arms
in serving (a missing one fails the start before ready); the warm also records the token
counts of the forwards at which the monitor fired (``WARMUP_FILE``), and in serving one
dummy forward per recorded size runs there too (inside
``Worker.compile_or_warm_up_model``). Strict mode refuses every compile until the monitor
arms (the engine is ready: ``runtime.ready``); after that a compile is served and counted,
and the monitor runs in the mode the engine was given. Every monitor event is counted
(``kernelcache_vllm_jit_events_total``) and kept in ``state.events`` with the token count of
the forward it happened in. The engine's model and the cache root are checked against the
generation's stamp. Whether vLLM applied its startup plan is said (``_plan_checked``): a GPU
with less free memory than the plan recorded profiles instead.

Nothing here imports vLLM: each hook is installed when vLLM's own module is imported.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelcache import learned
from kernelcache.errors import ColdCompileError, StampMismatchError, StorageError, WarmError
from kernelcache.runtime import metrics, ready
from kernelcache.runtime.imports import when_imported
from kernelcache.toolchains import flashinfer, inductor, triton
from kernelcache.toolchains.base import (
    Serving,
    Toolchain,
    Warmer,
    WarmerReport,
    make_cache_dirs,
)
from kernelcache.toolchains.vllm import coverage, tuning
from kernelcache.toolchains.vllm.coverage import Coverage

if TYPE_CHECKING:
    from kernelcache.spec import MoeTuning, VllmWorkload
    from kernelcache.store import Manifest

log = logging.getLogger(__name__)

FACTOR = "vllm/cache_root"
MODEL_FACTOR = "vllm/model"
SUBDIR = "vllm"  # files/vllm: VLLM_CACHE_ROOT's tree, placed back at its root
WARMUP_SUBDIR = "vllm-warmup"
WARMUP_FILE = f"{WARMUP_SUBDIR}/sizes.json"
MARKER = ".kernelcache-vllm-root"
ENV = "VLLM_CACHE_ROOT"
PLAN_DIR = "startup_plan"  # vLLM's startup plans under its cache root, one per fingerprint
TOOLCHAIN_DIRS = (triton.SUBDIR, inductor.CACHE_SUBDIR, flashinfer.SUBDIR)
# Set for every engine pass unless the spec's env says otherwise: no hub, and vLLM's startup
# plan recorded (the compile Job's measured KV-cache size, applied in serving).
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_STARTUP_PLAN": "1"}
_RUNNERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


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
        enumerated: Coverage | None = None
        coverage_file = Path(tempfile.mkdtemp(prefix="kernelcache-vllm-coverage-")) / "c.json"
        tune = workload.moe_tuning if workload.moe_tuning.mode != "off" else None
        serving, counted = False, 0
        kernels: set[str] = set()
        # A pass that tuned MoE tables leaves the enumeration to the next (a fresh engine
        # reading them): it does not count against maxPasses.
        while counted < workload.max_passes:
            result = run_pass(
                workload,
                env,
                sorted(sizes),
                serving,
                self.config.timeout_seconds,
                coverage_file if serving else None,
                tune if not report.passes else None,
            )
            tuned = tuning.tuned(result.get("moe_tuning"))
            counted += 0 if tuned else 1
            report.passes.append(pass_summary(result))
            if not any(p["armed"] and not p["server"] for p in result["processes"]):
                raise WarmError(
                    f"{self.label}: kernelcache's hooks did not run in vLLM's engine core "
                    "process (install kernelcache into vLLM's interpreter: its .pth hook "
                    "loads the runtime in every process vllm serve starts)"
                )
            modules.update(result["flashinfer_modules"])
            if len(report.passes) == 1 and tune:
                report.moe_tuning = result.get("moe_tuning")
            if not serving:
                kernels.update(k for _, k in _compiled(result))
                report.compiled += len(_compiled(result))
                _merge_compiled(report.compiled_by_toolchain, result["compiled_by_toolchain"])
                if result.get("coverage"):
                    enumerated = Coverage(**result["coverage"])
                    coverage_file.write_text(enumerated.to_json())
                    serving = True
                elif not tuned:
                    serving = True  # no coverage to replay: the next pass is serving's all the same
                continue
            if not result["jit_events"] and not result["cold_compiles"]:
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
        if said := tuning.summary(report.moe_tuning):
            report.coverage[f"{coverage.MOE} tables"] = said
        report.cache_key_factors = cache_key_factors(target)
        report.startup_plans = sorted(p.name for p in (target / PLAN_DIR).glob("*.json"))


def _merge_compiled(total: dict[str, dict[str, float]], more: Mapping[str, Any]) -> None:
    """Add one pass's compiles per toolchain (count and seconds) to ``total``."""
    for toolchain, entry in more.items():
        into = total.setdefault(toolchain, {"compiled": 0, "seconds": 0.0})
        into["compiled"] += entry["compiled"]
        into["seconds"] = round(into["seconds"] + entry["seconds"], 3)


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


def outputs_digest(outputs: Mapping[str, Any]) -> str:
    """The sweep's tokens as one digest: a served start is compared with the warm's cold pass."""
    import hashlib

    return hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()[:16]


def output_digests(outputs: Mapping[str, Any]) -> dict[str, str]:
    """Each shape's tokens as a digest of its own, so that a start that answers otherwise
    says which shapes differ (``<prompt length>x<batch size>``)."""
    return {key: outputs_digest({key: tokens}) for key, tokens in sorted(outputs.items())}


def differing_outputs(outputs: Mapping[str, Any], recorded: Mapping[str, str]) -> list[str]:
    """The shapes both answered whose tokens are not the recorded ones."""
    mine = output_digests(outputs)
    return sorted(key for key in mine.keys() & recorded.keys() if mine[key] != recorded[key])


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
    replayed: Path | None = None,
    tune: MoeTuning | None = None,
) -> dict[str, Any]:
    """One engine process (``drive``); its result, or a WarmError with its last line.

    Without ``replayed`` the engine enumerates the fused-MoE coverage right after its model
    loads; with it, it replays that coverage before the JIT monitor arms, as serving does.
    With ``tune`` it first tunes the fused-MoE tables (``tuning``). The engine's log streams
    through as it runs."""
    from kernelcache.toolchains import serving_settings

    with tempfile.TemporaryDirectory(prefix="kernelcache-vllm-") as tmp:
        job: dict[str, Any] = {
            "engine": workload.engine_args(),
            "sweep": sweep_plan(workload),
            "runtime": "warm",
            "preload": sizes,
            "coverage": str(replayed) if replayed is not None else None,
            "tune": tune.model_dump() if tune is not None else None,
            "result": str(Path(tmp) / "result.json"),
        }
        # A later pass is set up as serving from the generation is.
        child_env = {**serving_settings(), **env} if serving else env
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(job_path)],
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


# ---------------------------------------------------------------------------- one engine


def prompts_for(length: int, batch: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` token ids, the same in every process."""
    import random

    rng = random.Random(length * 100_003 + batch)
    return [[rng.randrange(10, 30_000) for _ in range(length)] for _ in range(batch)]


def serve_command(engine: Mapping[str, Any], port: int) -> list[str]:
    """``vllm serve`` with the engine arguments as its flags (``dtype`` -> ``--dtype``)."""
    args = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(engine["model"])]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    for name, value in engine.items():
        flag = "--" + name.replace("_", "-")
        if name == "model" or value is False or value is None:
            continue
        if value is True:
            args.append(flag)
        else:
            args += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return args


_TORCH_COMPILE = re.compile(r"torch\.compile took ([0-9.]+) s in total")


class _Server:
    """``vllm serve`` in its own process group, its output kept with the time of each line."""

    def __init__(self, command: list[str], env: dict[str, str], started: float) -> None:
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        self.lines: list[tuple[float, str]] = []
        self.started = started
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            sys.stderr.write(line)
            self.lines.append((round(time.time() - self.started, 3), line.rstrip()))

    def stop(self) -> None:
        """SIGINT as a pod's stop sends SIGTERM; then the whole group, so no engine lingers."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.reader.join(timeout=10)
        # The engine core outlives the API server for a moment: the next start on this GPU
        # must find its memory free again (vLLM's startup plan compares free memory).
        limit = time.monotonic() + 60
        while _group_running(self.proc.pid) and time.monotonic() < limit:
            time.sleep(0.1)


def _group_running(group: int) -> bool:
    """Whether a process of ``group`` still runs (a zombie does not: it holds no memory)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


def _request(port: int, path: str, body: Mapping[str, Any] | None, timeout: float) -> Any:
    """One HTTP request to the server; the JSON answer, or an OSError naming vLLM's reason."""
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            text = answer.read()
    except urllib.error.HTTPError as exc:
        said = exc.read().decode(errors="replace")
        raise OSError(f"HTTP {exc.code} from {path}: {' '.join(said.split())[:300]}") from None
    return json.loads(text) if text.strip() else None


def _complete(port: int, model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """One completion request for a batch of prompts (vLLM schedules them together)."""
    answer = _request(
        port,
        "/v1/completions",
        {
            "model": model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=600,
    )
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return [list(c.get("token_ids") or []) for c in choices]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def drive(job: dict[str, Any], started: float) -> dict[str, Any]:
    """``vllm serve`` with the job's engine, ready once ``/health`` answers 200 and a completion
    succeeds; then the declared sweep, one batched completion per (prompt length, batch size).

    kernelcache's hooks run inside vLLM's processes (the API server and the engine core,
    where the model runs), installed by the runtime's ``.pth`` hook (``KERNELCACHE_RUNTIME=1``);
    each process writes what they saw to ``KERNELCACHE_VLLM_STATE_DIR`` (``dump``), read here.
    ``runtime``: ``serving`` (the environment given: a pod's), ``warm`` (no generation; the
    sizes recorded so far run before the monitor arms), ``none`` (vLLM alone, only counted).
    """
    from kernelcache import contract

    state_dir = Path(tempfile.mkdtemp(prefix="kernelcache-vllm-state-"))
    env = {**os.environ, contract.RUNTIME.name: "1", contract.VLLM_STATE_DIR.name: str(state_dir)}
    if job["runtime"] != "serving":
        for variable in (contract.DIR, contract.ENV_FILE_PATH, contract.STRICT):
            env.pop(variable.name, None)
        env[contract.VLLM_SIZES.name] = ",".join(str(n) for n in job["preload"])
        env.pop(contract.VLLM_COVERAGE.name, None)
        env.pop(contract.VLLM_MOE_TUNING.name, None)
        if job["runtime"] == "warm":
            env[contract.VLLM_COVERAGE.name] = job.get("coverage") or coverage.ENUMERATE
            if job.get("tune"):
                env[contract.VLLM_MOE_TUNING.name] = json.dumps(job["tune"])
    engine, sweep = job["engine"], job["sweep"]
    port = _free_port()
    server = _Server(serve_command(engine, port), env, started)
    error, ready, first_generate = None, None, None
    outputs: dict[str, list[list[int]]] = {}
    shape_seconds: dict[str, list[float]] = {}  # each request's time, per shape (the bench's)
    try:
        first_generate = _wait_ready(server, port, str(engine["model"]), job.get("ready_timeout"))
        ready = time.time()
        for plan in [sweep, *job.get("more_sweeps", [])]:  # the bench's shapes outside
            for length in plan["prompt_lengths"]:
                for batch in plan["batch_sizes"]:
                    began = time.perf_counter()
                    tokens = _complete(
                        port, str(engine["model"]), prompts_for(length, batch), plan["max_tokens"]
                    )
                    outputs[f"{length}x{batch}"] = tokens
                    seconds = round(time.perf_counter() - began, 4)
                    shape_seconds.setdefault(f"{length}x{batch}", []).append(seconds)
    except (OSError, ValueError, KeyError, TimeoutError) as exc:  # the engine died, or refused
        error = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
    finished = time.time()
    server.stop()
    seen = read_states(state_dir, server.proc.pid)
    shutil.rmtree(state_dir, ignore_errors=True)
    compile_lines = [float(m[1]) for _, line in server.lines if (m := _TORCH_COMPILE.search(line))]
    imported = seen.get("vllm_imported_at")
    return {
        **seen,
        "import_seconds": round(imported - started, 3) if imported else None,
        "ready_at": ready,
        "ready_seconds": round(ready - started, 3) if ready else None,
        "first_generate_seconds": first_generate,
        "sweep_seconds": round(finished - ready, 3) if ready else None,
        "torch_compile_seconds": round(sum(compile_lines), 3) if compile_lines else None,
        "server_pid": server.proc.pid,
        "server_exit": server.proc.returncode,
        "sweep_error": error,
        "outputs": outputs,
        "shape_seconds": shape_seconds,
        "log": server.lines,
    }


def _wait_ready(server: _Server, port: int, model: str, timeout: float | None) -> float:
    """Until ``/health`` answers 200, then one completion; the seconds that one took."""
    limit = time.monotonic() + (timeout or 1800)
    while True:
        if server.proc.poll() is not None:
            said = [line for _, line in server.lines if line.strip()]
            raise OSError(
                f"vllm serve exited ({server.proc.returncode}) before it was ready: "
                f"{said[-1] if said else 'no output'}"
            )
        try:
            _request(port, "/health", None, timeout=5)
            break
        except OSError:
            if time.monotonic() > limit:
                raise TimeoutError("vllm serve did not answer /health in time") from None
            time.sleep(0.2)
    start = time.time()
    _complete(port, model, [[11]], 1)
    return round(time.time() - start, 3)


def read_states(directory: Path, server_pid: int) -> dict[str, Any]:
    """What every vLLM process's hooks wrote (``dump``), merged: events, compiles and the
    monitor's arming from all of them, which process armed it (the engine core)."""
    states = []
    for path in sorted(directory.glob("vllm-*.json")):
        with contextlib.suppress(OSError, ValueError):
            states.append(json.loads(path.read_text()))
    compiles: dict[str, float] = {}
    by_toolchain: dict[str, dict[str, float]] = {}
    for one in states:
        for name, count in one["cold_compiles"].items():
            compiles[name] = compiles.get(name, 0) + count
        _merge_compiled(by_toolchain, one["compiled_by_toolchain"])
    armed = [one for one in states if one["monitor_mode"] is not None]
    engine = armed[0] if armed else {}
    imported = [one["vllm_imported_at"] for one in states if one.get("vllm_imported_at")]
    return {
        "processes": [
            {
                "pid": one["pid"],
                "server": one["pid"] == server_pid,
                "armed": one["monitor_mode"] is not None,
            }
            for one in states
        ],
        "monitor_mode": engine.get("monitor_mode"),
        "preload_sizes": engine.get("sizes", []),
        "preload_seconds": engine.get("preload_seconds", 0.0),
        "coverage": engine.get("coverage"),
        "coverage_seconds": engine.get("coverage_seconds"),
        "moe_tuning": engine.get("moe_tuning"),
        "startup_plan": engine.get("startup_plan"),
        "jit_events": [event for one in states for event in one["events"]],
        "cold_compiles": compiles,
        "compiled_by_toolchain": by_toolchain,
        "flashinfer_modules": sorted({m for one in states for m in one["flashinfer_modules"]}),
        "flashinfer_builds": [b for one in states for b in one["flashinfer_builds"]],
        "vllm_imported_at": min(imported) if imported else None,
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
    """What the hooks saw in this process, written to ``state_dir`` for the warm and bench."""

    sizes: list[int] = field(default_factory=list)  # token counts run before the monitor arms
    coverage: Coverage | None = None  # replayed before the monitor arms (serving)
    enumerate: bool = False  # the warm's first pass: enumerate the coverage instead
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
    worker: Any = None  # the worker warming up, until it has
    startup_plan: dict[str, Any] | None = None  # whether vLLM applied its startup plan
    state_dir: Path | None = None
    vllm_imported_at: float | None = None
    # What the parent process compiled (before a fork), and the tuning's candidates (compiled
    # into a scratch cache): not this process's kernels.
    compiles_not_counted: dict[tuple[str, str], float] = field(default_factory=dict)
    dumped: tuple[Any, ...] = ()


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
    when_imported("vllm.engine.arg_utils", _imported)
    when_imported("vllm.utils.jit_monitor", _hook_monitor)
    when_imported("vllm.v1.worker.gpu_worker", _hook_worker_module)
    for name in _RUNNERS:
        when_imported(name, lambda module: _hook_runner(module.GPUModelRunner))


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
            cover(worker.vllm_config)
        # Ready from here: a compile is served and counted, not refused (``runtime.ready``).
        ready.mark_ready()
        state.monitor_mode = mode
        activate(mode=state.monitor_mode, verbose=verbose)
        dump()

    def handle_counted(
        *, backend: str, event: str, fn_name: str, detail: str | None = None
    ) -> None:
        metrics.record_vllm_jit_event(backend, fn_name, state.forward_tokens)
        state.events.append({"backend": backend, "kernel": fn_name, "tokens": state.forward_tokens})
        dump()
        handle(backend=backend, event=event, fn_name=fn_name, detail=detail)

    module.activate = activate_after_preload
    module._handle_jit_event = handle_counted


def prepare(vllm_config: Any) -> None:
    """The warm's first pass, the model loaded and nothing run yet: tune the MoE tables (when
    asked), then enumerate the fused-MoE coverage, unless a table was written (a fresh engine
    reading it enumerates, in the next pass). Before vLLM's profile run and warm-up, so that
    no MoE kernel is loaded yet and each one's first load is seen."""
    if state.tuning is not None:
        tune_moe(vllm_config, state.tuning)
    if not state.enumerate:
        return
    if tuning.tuned(state.tuned):
        log.info("kernelcache: fused-MoE coverage is enumerated by the next engine process, "
                 "with the tables tuned here")  # fmt: skip
    else:
        state.enumerated = asdict(coverage.enumerate_moe(vllm_config))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # vLLM's memory profile after this sees none of it
    dump(force=True)  # the enumeration changes nothing dump() compares


def cover(vllm_config: Any) -> None:
    """Replay the generation's fused-MoE coverage: a specialization it lacks fails the start
    here, before the engine is ready."""
    if state.coverage is None:
        return
    try:
        state.coverage_seconds = coverage.replay(vllm_config, state.coverage)
    except ColdCompileError as exc:
        metrics.record_verify_failure("coverage")
        if state.strict:
            raise
        log.warning("kernelcache: %s; the engine compiles what is missing", exc)
        return
    log.info(
        "kernelcache: fused-MoE coverage loaded before the engine is ready: %d "
        "specializations in %.2f s",
        len(state.coverage.specializations(coverage.MOE)),
        state.coverage_seconds,
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
    if hasattr(module, "maybe_apply_startup_plan"):  # vLLM 0.26+
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
        state.forward_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            state.forward_tokens = None
            dump()

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


def coverage_lines(report: Mapping[str, Any]) -> list[str]:
    """``family: what was enumerated`` for each vLLM warmer of a generation's warm report."""
    return [
        f"{family}: {line}"
        for warmer in report.get("warmers") or []
        for family, line in sorted((warmer.get("coverage") or {}).items())
    ]


def coverage_diffs(left: Mapping[str, Any], right: Mapping[str, Any]) -> list[str]:
    """The coverage of two generations' warms, family by family, where it differs."""

    def by_family(report: Mapping[str, Any]) -> dict[str, str]:
        return dict(line.split(": ", 1) for line in coverage_lines(report))

    a, b = by_family(left), by_family(right)
    return [
        f"{family}: {a.get(family, '(absent)')} != {b.get(family, '(absent)')}"
        for family in sorted(set(a) | set(b))
        if a.get(family) != b.get(family)
    ]


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

    def check_pod(self, manifest: Manifest, environ: Mapping[str, str]) -> None:
        check_env_root(manifest, environ)

    def place(self, copy: Path, manifest: Manifest, dropped: Sequence[str]) -> dict[str, Any]:
        """vLLM's tree back at the root it was built at (``place``)."""
        root = recorded_root(manifest)
        if root is None:
            return {}
        return {"vllm_cache_root": str(root), "vllm_files": place(copy, manifest, root, dropped)}

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
        config = serving.config
        factors = serving.manifest.stamp.get("factors", {}) if serving.manifest else {}
        if config.vllm_sizes is not None:
            sizes = list(config.vllm_sizes)
        else:
            sizes = read_sizes(serving.files) if serving.files is not None else []
        enumerate_coverage = config.vllm_coverage == coverage.ENUMERATE
        if config.vllm_coverage and not enumerate_coverage:
            recorded: Path | None = Path(config.vllm_coverage)
        else:
            recorded = serving.files / coverage.FILE if serving.files is not None else None
        watch(
            sizes,
            config.strict,
            factors.get(MODEL_FACTOR),
            config.vllm_state_dir,
            Coverage.read(recorded) if recorded is not None and not enumerate_coverage else None,
            enumerate_coverage=enumerate_coverage,
            moe_tuning=json.loads(config.vllm_moe_tuning) if config.vllm_moe_tuning else None,
        )


TOOLCHAIN = Vllm(
    # Not read in place: a warm start writes under its root (torch_aot_compile).
    name="vllm",
    cache_env={ENV: SUBDIR, coverage.TUNED_FOLDER_ENV: tuning.SUBDIR},
    # vLLM applies a startup plan only where its fingerprint (GPU name, total memory, ...)
    # matches; kernelcache scopes the files to the GPU product as it does tuning.
    serving_settings={"VLLM_ENABLE_STARTUP_PLAN": "1"},
    # So are FlashInfer's autotuner results that vLLM keeps under its root, and the fused-MoE
    # tables tuned in the compile Job.
    tuning_prefixes=(
        f"{SUBDIR}/{PLAN_DIR}/",
        f"{SUBDIR}/flashinfer_autotune_cache/",
        f"{tuning.SUBDIR}/",
    ),
    warmers=(VllmWarmer,),
    requires=("vllm", "vllm"),
)
