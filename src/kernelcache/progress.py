"""Per-kernel progress of a warm, as lines a person reads and ``kernelcache build`` parses.

A warm runs in its own process (``kernelcache warm``, in a compile Job or under ``build``).
With ``kernelcache warm --progress`` (``build`` passes it; compile Jobs set
``KERNELCACHE_PROGRESS=1``) each compile is printed to stderr
as one line, so a log shows an hour-long warm-up kernel by kernel, and the same line lets
``build`` draw progress and a summary of the slowest kernels. Without it stderr keeps to
the one line of a failure. The timings are kept either way, for the warm's JSON result. A
warmer that prints nothing for ``HEARTBEAT_S`` gets a line with its elapsed time and timeout.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

_COMPILED = re.compile(
    r"^kernelcache: compiled (?P<toolchain>\S+) kernel (?P<kernel>.+) in (?P<seconds>[0-9.]+) s$"
)


@dataclass(frozen=True)
class KernelTiming:
    toolchain: str
    kernel: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# A warm's result keeps its slowest kernels only: it is a Job's termination message (4 KiB).
SLOWEST_KEPT = 5

# A step that prints nothing for this long gets a line saying it still runs (a compile Job's
# log, a piped build), with its elapsed time and its timeout.
HEARTBEAT_S = 60.0

_timings: list[KernelTiming] = []
_shown = False
_last_note = time.monotonic()


def show() -> None:
    """Print progress lines from now on (``kernelcache warm --progress``)."""
    global _shown
    _shown = True


def note(line: str) -> None:
    """A step of the warm (a warmer starting, a wait for the lock), when progress is shown."""
    global _last_note
    _last_note = time.monotonic()
    if _shown:
        print(f"kernelcache: {line}", file=sys.stderr, flush=True)


@contextmanager
def heartbeat(step: str, timeout_s: float) -> Iterator[None]:
    """While ``step`` runs, a line every ``HEARTBEAT_S`` without another progress line:
    ``<step>: still running, 5 min 0 s of its 60 min timeout``."""
    start, stop = time.monotonic(), threading.Event()

    def beat() -> None:
        while not stop.wait(max(_last_note + HEARTBEAT_S - time.monotonic(), 0.01)):
            if time.monotonic() - _last_note >= HEARTBEAT_S:
                elapsed = duration(time.monotonic() - start)
                note(f"{step}: still running, {elapsed} of its {duration(timeout_s)} timeout")

    thread = threading.Thread(target=beat, name="kernelcache-heartbeat", daemon=True)
    if _shown:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()


def duration(seconds: float) -> str:
    """``45 s``, ``2 min 30 s``, ``1 h 5 min``: a time a person reads at a glance."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


def compiled(toolchain: str, kernel: str, seconds: float) -> None:
    """One kernel compiled by a warmer: kept for the result, and shown at once."""
    timing = KernelTiming(toolchain, " ".join(kernel.split()), round(seconds, 3))
    _timings.append(timing)
    note(f"compiled {timing.toolchain} kernel {timing.kernel} in {seconds:.2f} s")


def slowest() -> list[KernelTiming]:
    """The ``SLOWEST_KEPT`` slowest kernels compiled in this process so far, slowest first."""
    return sorted(_timings, key=lambda t: -t.seconds)[:SLOWEST_KEPT]


def parse(line: str) -> KernelTiming | None:
    """The timing a progress line reports, or None for any other line."""
    match = _COMPILED.match(line.rstrip("\n"))
    if match is None:
        return None
    return KernelTiming(match["toolchain"], match["kernel"], float(match["seconds"]))
