"""Per-kernel progress of a warm, as lines a person reads and ``kernelcache build`` parses.

A warm runs in its own process (``kernelcache warm``, in a compile Job or under ``build``).
With ``kernelcache warm --progress`` (``build`` passes it; compile Jobs set
``KERNELCACHE_PROGRESS=1``) each compile is printed to stderr
as one line, so a log shows an hour-long warm-up kernel by kernel, and the same line lets
``build`` draw progress and a summary of the slowest kernels. Without it stderr keeps to
the one line of a failure. The timings are kept either way, for the warm's JSON result.
"""

from __future__ import annotations

import re
import sys
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

_timings: list[KernelTiming] = []
_shown = False


def show() -> None:
    """Print progress lines from now on (``kernelcache warm --progress``)."""
    global _shown
    _shown = True


def note(line: str) -> None:
    """A step of the warm (a warmer starting, a wait for the lock), when progress is shown."""
    if _shown:
        print(f"kernelcache: {line}", file=sys.stderr, flush=True)


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
