"""``vllm serve MODEL [flags]``: an API server (``/health``, ``/v1/completions`` with token-id
prompts) and an engine core process, as vLLM 0.26.0 runs them."""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm.entrypoints")


def steps(prompts: list[list[int]], max_tokens: int, budget: int) -> list[Any]:
    """The steps vLLM's scheduler forms for these prompts: chunked prefill in order within the
    token budget (a request continued in a later step has its earlier chunks as context), one
    decode step per generated token, then the requests finished."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    ids = [f"req-{i}" for i in range(len(prompts))]
    computed = [0] * len(prompts)
    batches = []
    while any(done < len(p) for done, p in zip(computed, prompts, strict=True)):
        left, step = budget, SchedulerOutput.make_empty()
        for index, prompt in enumerate(prompts):
            take = min(len(prompt) - computed[index], left)
            if take <= 0:
                continue
            if computed[index] == 0:
                step.scheduled_new_reqs.append(NewRequestData(ids[index], prompt, ([],), 0))
            else:
                step.scheduled_cached_reqs.req_ids.append(ids[index])
                step.scheduled_cached_reqs.num_computed_tokens.append(computed[index])
            step.num_scheduled_tokens[ids[index]], left = take, left - take
            computed[index] += take
        step.total_num_scheduled_tokens = budget - left
        batches.append(step)
    for generated in range(max_tokens):
        step = SchedulerOutput.make_empty()
        step.scheduled_cached_reqs = CachedRequestData(
            list(ids),
            [len(p) + generated for p in prompts],
            [None] * len(ids),
            [generated] * len(ids),
        )
        step.num_scheduled_tokens = dict.fromkeys(ids, 1)
        step.total_num_scheduled_tokens = len(ids)
        batches.append(step)
    finish = SchedulerOutput.make_empty()
    finish.finished_req_ids = set(ids)
    return [*batches, finish]


def engine_core(conn: Any, args: argparse.Namespace) -> None:
    """The engine core process: workers built, compiled, warmed up; then requests."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server shuts it down
    from vllm.v1.worker.gpu_worker import Worker

    root = Path(os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT", "~/.cache/vllm")))
    workers = [
        Worker(
            args.model,
            root,
            args.dtype,
            rank,
            args.tensor_parallel_size,
            args.max_num_batched_tokens,
            args.max_num_seqs,
            args.max_model_len,
        )
        for rank in range(args.tensor_parallel_size)
    ]
    try:
        for worker in workers:
            worker.load_model()
        compiled = all([worker.load_or_compile() for worker in workers])
        log.info("torch.compile took %.2f s in total", 0.01 if compiled else 0.5)
        for worker in workers:
            worker.determine_available_memory()
            worker.jit_monitor_mode = args.jit_monitor_mode
            worker.compile_or_warm_up_model()
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    conn.send({"ready": True})
    runner = workers[0].model_runner
    while True:
        request = conn.recv()
        try:
            prompts, max_tokens = request["prompts"], request["max_tokens"]
            for batch in steps(prompts, max_tokens, args.max_num_batched_tokens):
                runner.execute_model(batch)
            if os.environ.get("FAKE_VLLM_SAMPLER_KERNEL"):  # a kernel no warm-up loads
                from vllm.model_executor.layers.fused_moe import load

                load("sampler_kernel[top_p=True]")
        except Exception as exc:  # the engine core dies, as vLLM's does
            conn.send({"error": f"EngineCore died: {type(exc).__name__}: {exc}"})
            return
        conn.send({"token_ids": [[(sum(p) + i) % 32000 for i in range(max_tokens)]
                                 for p in prompts]})  # fmt: skip


class _Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork")
        context = multiprocessing.get_context(method)
        self.conn, child = context.Pipe()
        self.proc = context.Process(target=engine_core, args=(child, args), daemon=True)
        self.proc.start()
        self.lock = threading.Lock()
        self.ready = False
        self.dead: str | None = None
        threading.Thread(target=self._wait_ready, daemon=True).start()

    def _wait_ready(self) -> None:
        try:
            answer = self.conn.recv()
        except EOFError:  # the engine core exited while starting, as vLLM's API server sees it
            answer = {"error": "Engine core initialization failed. See root cause above."}
        if "error" in answer:
            self.dead = answer["error"]
            log.error("Engine core initialization failed: %s", self.dead)
            os._exit(1)
        self.ready = True

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        with self.lock:
            if self.dead:
                return {"error": self.dead}
            self.conn.send({"prompts": prompts, "max_tokens": max_tokens})
            answer: dict[str, Any] = self.conn.recv()
            if "error" in answer:
                self.dead = answer["error"]
            return answer


def serve(args: argparse.Namespace) -> None:
    import vllm.engine.arg_utils  # noqa: F401  (vLLM's own import order)

    engine = _Engine(args)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def _answer(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                code = 500 if engine.dead else 200 if engine.ready else 503
                self._answer(code, {})
            else:
                self._answer(404, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompts = body["prompt"]
            prompts = prompts if prompts and isinstance(prompts[0], list) else [prompts]
            answer = engine.generate(prompts, int(body["max_tokens"]))
            if "error" in answer:
                self._answer(500, {"error": {"message": answer["error"]}})
                return
            choices = [{"index": i, "text": "", "token_ids": t}
                       for i, t in enumerate(answer["token_ids"])]  # fmt: skip
            self._answer(200, {"choices": choices})

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    log.info("Starting vLLM API server on http://%s:%d", args.host, args.port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        log.info("Shutting down")
    finally:
        engine.proc.terminate()


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: vllm serve MODEL [flags]")
    parser = argparse.ArgumentParser(prog="vllm serve")
    parser.add_argument("model")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--jit-monitor-mode", default="warn")
    args, _ = parser.parse_known_args(sys.argv[2:])
    serve(args)


if __name__ == "__main__":
    main()
