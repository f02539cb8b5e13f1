"""``timeoutSeconds`` for every warmer, whether it runs in this process or spawns others.

A Python entry point runs inside the warm process, so its deadline is a ``SIGALRM`` that
raises into it. The exception is a ``BaseException``: an entry point's own ``except
Exception`` cannot swallow it. Native code that keeps the interpreter busy (a compile inside
a DSL's compiler) does not see the signal, so a watchdog thread ends the whole warm
``GRACE_SECONDS`` later. Either way every process the warmer started is killed, so nothing
keeps writing into the staging directory and nothing holds the build's pipes open.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from kernelcache.errors import ExitCode, WarmError, one_line

GRACE_SECONDS = 10.0


class DeadlinePassed(BaseException):
    """Raised into the warmer by the alarm; turned into a ``WarmError`` by ``deadline``."""


def descendants(root: int | None = None) -> list[int]:
    """Every live process below ``root`` (default: this one), found through ``/proc``."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path("/proc", entry, "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            ppid = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [os.getpid() if root is None else root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_descendants() -> None:
    for pid in descendants():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def kill_group(pgid: int) -> None:
    """SIGKILL a process group a warmer started (``start_new_session``); gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def deadline(seconds: float, message: str) -> Iterator[None]:
    """Fail the enclosed warmer with ``message`` (exit class "warm failed") after ``seconds``;
    a warmer's own subprocess timeout of the same budget is the same failure."""
    try:
        with _alarm(seconds, message):
            yield
    except subprocess.TimeoutExpired as exc:
        if exc.timeout != seconds:
            raise
        kill_descendants()
        raise WarmError(message) from None
    except DeadlinePassed:
        kill_descendants()
        raise WarmError(message) from None


@contextlib.contextmanager
def _alarm(seconds: float, message: str) -> Iterator[None]:
    """Raise ``DeadlinePassed`` after ``seconds``, and end the process a grace period later.

    Only the main thread can take signals; elsewhere (a warm run from a test's thread) the
    warmers' own subprocess timeouts are all that applies.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise DeadlinePassed

    def hard_stop() -> None:
        print(f"kernelcache: error: {one_line(message)}", file=sys.stderr, flush=True)
        kill_descendants()
        os._exit(int(ExitCode.WARM_FAILED))

    watchdog = threading.Timer(seconds + GRACE_SECONDS, hard_stop)
    watchdog.daemon = True
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    watchdog.start()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        watchdog.cancel()
