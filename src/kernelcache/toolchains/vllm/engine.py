"""One engine process: ``vllm serve`` with the job's engine, driven until ready and through
the declared sweep (``drive``), run as ``python -m kernelcache.toolchains.vllm JOB``; what
kernelcache's hooks in vLLM's processes saw (``hooks.dump``) read back (``read_states``)."""

from __future__ import annotations

import contextlib
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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kernelcache.toolchains.vllm import adapter

log = logging.getLogger(__name__)


def _merge_compiled(total: dict[str, dict[str, float]], more: Mapping[str, Any]) -> None:
    """Add one pass's compiles per toolchain (count and seconds) to ``total``."""
    for toolchain, entry in more.items():
        into = total.setdefault(toolchain, {"compiled": 0, "seconds": 0.0})
        into["compiled"] += entry["compiled"]
        into["seconds"] = round(into["seconds"] + entry["seconds"], 3)


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


def prompts_for(length: int, batch: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` token ids, the same in every process."""
    import random

    rng = random.Random(length * 100_003 + batch)
    return [[rng.randrange(10, 30_000) for _ in range(length)] for _ in range(batch)]


def serve_command(engine: Mapping[str, Any], port: int) -> list[str]:
    """``vllm serve`` with the engine arguments as its flags (``dtype`` -> ``--dtype``)."""
    args = [sys.executable, "-m", adapter.SERVE_MAIN, "serve", str(engine["model"])]
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
            if job.get("coverage"):
                env[contract.VLLM_COVERAGE.name] = job["coverage"]
            if job.get("tune"):
                env[contract.VLLM_MOE_TUNING.name] = json.dumps(job["tune"])
    engine, sweep = job["engine"], job["sweep"]
    port = _free_port()
    server = _Server(serve_command(engine, port), env, started)
    error, ready, first_generate = None, None, None
    outputs: dict[str, list[list[int]]] = {}
    shape_seconds: dict[str, list[float]] = {}  # each request's time, per shape (the bench's)
    try:
        first_generate = _wait_ready(
            server,
            port,
            str(engine["model"]),
            job.get("ready_timeout"),
            lambda: read_states(state_dir, server.proc.pid)["tuning_ended"],
        )
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
    except _TuningEnded:
        pass  # not an error: the pass that tuned ends before its engine is ready
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


class _TuningEnded(Exception):
    """The engine core ended after tuning the MoE tables (``hooks.prepare``)."""


def _wait_ready(server: _Server, port: int, model: str, timeout: float | None, ended: Any) -> float:
    """Until ``/health`` answers 200, then one completion; the seconds that one took.
    ``ended()``: whether the engine core said it ended after tuning (the API server then goes
    down, or waits, without a ready engine)."""
    limit = time.monotonic() + (timeout or 1800)
    while True:
        if ended():
            raise _TuningEnded
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
        "moe_tuning": next((s["moe_tuning"] for s in states if s.get("moe_tuning")), None),
        "tuning_ended": any(one.get("tuning_ended") for one in states),
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
