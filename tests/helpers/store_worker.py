"""A separate process for the store's fault-injection and concurrency tests
(tests/test_store_faults.py, tests/test_concurrency.py).

Real faults need a real process: one that is SIGKILLed mid-publish, that holds a lock when
it dies, that races others for the same key, or that runs under a file-size limit.

    store_worker.py serve ROOT KEY TRACE_FILE    fork publishers on request (protocol below)
    store_worker.py serve ROOT KEY TRACE_FILE repoint
                                                 the same, each child making the kept
                                                 generation of stamp SEED current once
    store_worker.py once  ROOT KEY SEED GO_FILE  publish once, as soon as GO_FILE exists
    store_worker.py hold  ROOT KEY               take the writer lock, stage a file, sleep
    store_worker.py fsize ROOT KEY SRC LIMIT     publish SRC under RLIMIT_FSIZE=LIMIT bytes

Each prints "ready" once its imports are done, so the test can time its fault from there.

``serve`` pays the imports once and forks one publisher per kill: for each stdin line
``SEED KILL_AT`` it forks a child that publishes generation after generation, forever, and
prints the child's pid; on the next stdin line (``reap``) it waits for the child and prints
its wait status. Until then the dead child stays a zombie, so its pid cannot be reused by the
time the test sends it SIGKILL. The child traces its progress: wrappers (the wrapped calls
still run) count each file-system call it makes as a step and write the phase of publishing
it is in to TRACE_FILE with pwrite, which a SIGKILL cannot undo. With ``KILL_AT`` > 0 the
child SIGKILLs itself just before step ``KILL_AT``, a crash point a seed reproduces exactly.
"""

from __future__ import annotations

import functools
import json
import os
import random
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernelcache.errors import KernelCacheError
from kernelcache.store import MANIFEST_NAME, Store, Writer
from kernelcache.store import fs as store_fs
from kernelcache.store import writer as store_writer

STAMP_FACTORS = {"torch": "2.5.1", "cuda": "12.4", "triton": "3.1.0"}

# The phases of one publish cycle, in order. "lock": taking the writer lock and removing what
# a dead writer left; "stage": writing the cache files; "seal": digesting and fsyncing them;
# "manifest": MANIFEST.json; "install": renaming staging to its id (or keeping an existing
# copy of the same content); "current": the CURRENT swap; "gc": collecting old generations;
# "release": closing the writer and dropping the lock.
PHASES = ("lock", "stage", "seal", "manifest", "install", "current", "gc", "release")


def stamp_for(label: str) -> dict[str, object]:
    return {
        "digest": f"blake3:{label}",
        "compile_digest": f"blake3:compile-{label}",
        "factors": STAMP_FACTORS,
        "factor_digests": {name: f"blake3:{value}" for name, value in STAMP_FACTORS.items()},
    }


def write_random_files(
    files_dir: Path, rng: random.Random, before_each: Callable[[], None] = lambda: None
) -> None:
    """Several small files in two toolchain subtrees and one of about 256 kB."""
    for i in range(4):
        sub = files_dir / ("triton" if i % 2 else "cute") / f"k{i}"
        sub.mkdir(parents=True, exist_ok=True)
        before_each()
        (sub / f"kernel{i}.cubin").write_bytes(rng.randbytes(rng.randint(1_000, 16_000)))
    before_each()
    (files_dir / "triton" / "big.bin").write_bytes(rng.randbytes(256_000 + rng.randint(0, 4096)))


def publish_random(
    writer: Writer, seed: str, before_each: Callable[[], None] = lambda: None
) -> str:
    files_dir = writer.staging()
    write_random_files(files_dir, random.Random(seed), before_each)
    manifest = writer.publish(files_dir, stamp_for(seed), {"seed": seed}, keep=2)
    return manifest.generation


# --------------------------------------------------------------------------- serve


class Trace:
    """The publisher's phase, in a file that outlives a SIGKILL; optionally that SIGKILL."""

    def __init__(self, path: str, kill_at: int) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._kill_at = kill_at
        self._lock = threading.Lock()  # the store digests files on a thread pool
        self._steps = 0
        self._record(PHASES[0])

    def step(self, phase: str | None = None) -> None:
        """One step of publishing; phase starts a new phase with it."""
        with self._lock:
            if phase is not None:
                self._record(phase)
            self._steps += 1
            if self._steps == self._kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        os.close(self._fd)

    def _record(self, phase: str) -> None:
        os.pwrite(self._fd, phase.encode().ljust(max(map(len, PHASES))), 0)


def _synced_write_phase(path: Path, *_: Any) -> str | None:
    if path.name == MANIFEST_NAME:
        return "manifest"
    return "current" if path.name.startswith(".CURRENT.") else None


def _trace_calls(
    trace: Trace, owner: Any, name: str, phase: Callable[..., str | None] | str | None = None
) -> None:
    """Make each call of owner.name a step of the trace (that then runs the original)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        trace.step(phase(*args) if callable(phase) else phase)
        return original(*args, **kwargs)

    setattr(owner, name, traced)


# The calls through which the store creates, syncs, renames and removes files (shutil.rmtree
# included): each is a step, so a kill can land between any two of them.
TRACED_OS_CALLS = ("open", "fsync", "mkdir", "rename", "replace", "unlink", "rmdir")


def instrument(trace: Trace) -> None:
    """Make every file-system call of this process a step, and mark where each phase starts."""
    _trace_calls(trace, Writer, "_fill", "seal")
    _trace_calls(trace, Writer, "_install", "install")
    _trace_calls(trace, Store, "_gc_locked", "gc")
    for module in (store_fs, store_writer):
        _trace_calls(trace, module, "write_file_synced", _synced_write_phase)
    for name in TRACED_OS_CALLS:
        _trace_calls(trace, os, name)


# The phases of making a kept generation current again: "lock" (and finding it), "verify"
# (it is checked before it is used), "history" (recording when the outgoing one stopped
# being current), "current" (the CURRENT swap), "gc", "release".
REPOINT_PHASES = ("lock", "verify", "history", "current", "gc", "release")


def _repoint_write_phase(path: Path, *_: Any) -> str | None:
    if path.name.startswith(".HISTORY."):
        return "history"
    return "current" if path.name.startswith(".CURRENT.") else None


def instrument_repoint(trace: Trace) -> None:
    _trace_calls(trace, store_writer, "verify", "verify")
    for module in (store_fs, store_writer):
        _trace_calls(trace, module, "write_file_synced", _repoint_write_phase)
    _trace_calls(trace, Store, "_gc_locked", "gc")
    for name in TRACED_OS_CALLS:
        _trace_calls(trace, os, name)


def repoint_once(root: str, key: str, seed: str, trace: Trace) -> None:
    """Make the kept generation of stamp_for(seed) current, keeping one besides it."""
    with Store(root).writer(key) as writer:
        if writer.make_current_again(str(stamp_for(seed)["digest"]), keep=1) is None:
            raise SystemExit(f"no kept generation of stamp {seed}")
        trace.step("release")


def publish_forever(root: str, key: str, seed: str, trace: Trace) -> None:
    store = Store(root)
    i = 0
    while True:
        # Every third round republishes the previous content: the "same id exists" path.
        content = f"{seed}-{i - 1 if i % 3 == 2 else i}"
        trace.step("lock")
        with store.writer(key) as writer:
            trace.step("stage")
            publish_random(writer, content, before_each=trace.step)
            trace.step("release")
        i += 1


def serve(root: str, key: str, trace_path: str, mode: str = "publish") -> None:
    ready()
    for line in sys.stdin:
        seed, kill_at = line.split()
        trace = Trace(trace_path, int(kill_at))  # a child killed before its first step: "lock"
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if mode == "repoint":
                    instrument_repoint(trace)
                    repoint_once(root, key, seed, trace)
                    code = 0
                else:
                    instrument(trace)
                    publish_forever(root, key, seed, trace)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        trace.close()
        print(pid, flush=True)
        if not sys.stdin.readline():  # "reap"; or the test is gone: take the child along
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        print(status, flush=True)


# --------------------------------------------------------------------------- one-shot modes


def once(root: str, key: str, seed: str, go_file: str) -> None:
    store = Store(root)
    ready()
    while not Path(go_file).exists():
        time.sleep(0.001)
    with store.writer(key) as writer:
        acquired = time.time()
        generation = publish_random(writer, seed)
        released = time.time()
    print(json.dumps({"generation": generation, "acquired": acquired, "released": released}))


def hold(root: str, key: str) -> None:
    store = Store(root)
    with store.writer(key) as writer:
        (writer.staging() / "half-written.bin").write_bytes(b"x" * 4096)
        print("locked", flush=True)
        time.sleep(3600)


def fsize(root: str, key: str, src: str, limit: str) -> int:
    store = Store(root)
    # Over the limit, write() then fails with EFBIG instead of the process being killed.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    ready()
    try:
        with store.writer(key) as writer:
            writer.publish(Path(src), stamp_for("fsize"), {}, keep=2)
    except KernelCacheError as exc:
        print(exc.message, file=sys.stderr)
        return int(exc.code)
    return 0


def ready() -> None:
    print("ready", flush=True)


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "serve":
        serve(*args)
    elif command == "once":
        once(*args)
    elif command == "hold":
        hold(*args)
    elif command == "fsize":
        return fsize(*args)
    else:
        raise SystemExit(f"unknown command {command!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
