"""How the CLI prints: rich tables for people, JSON for scripts, live progress for builds.

Tables and progress go through rich, which writes no escape codes when the stream is not a
terminal; a build then prints one plain line per event, so CI logs stay readable. Every
``--json`` payload has a JSON Schema under ``docs/cli-schemas/<command>.json``.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import re
import select
import sys
import textwrap
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Literal

from kernelcache import progress
from kernelcache.errors import plain

if TYPE_CHECKING:
    from kernelcache.build import ArchResult
    from kernelcache.doctor import Report
    from kernelcache.initcontainer import Outcome
    from kernelcache.spec import KernelCache

SLOWEST_SHOWN = 3


PIPED_WIDTH = 160


def console(stderr: bool = False) -> Any:
    """Rich output; wide when piped (unless ``COLUMNS`` says otherwise), so tables in logs
    and CI keep every column readable."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich's own ends the process with exit 1 (and no line): a reader that went away
            # is the command's to end, quietly and with 141, as for any other write.
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else _columns() or PIPED_WIDTH
    return _Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


def _columns() -> int | None:
    text = os.environ.get("COLUMNS", "")
    return int(text) if text.isdigit() and int(text) > 0 else None


def table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    whole: Collection[str] = (),
    right: Collection[str] = (),
) -> Any:
    """A rich table whose ``whole`` columns (what a reader looks a row up by: a key, an
    arch, a status) are never cut or wrapped; the other columns wrap between words, never
    inside one (a path, a version). Where the width leaves the others too little room for
    that, each row is printed as a record: its whole columns on one line, the others below
    as ``name: value``."""
    return _Table(title, columns, rows, whole, right)


# The fewest characters a wrapping column gets before the table gives way to records.
NARROWEST_WRAPPED = 8


class _Table:
    """Chooses the layout at render time, when the console's width is known."""

    def __init__(
        self,
        title: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        whole: Collection[str],
        right: Collection[str],
    ) -> None:
        self.title, self.columns, self.rows = title, columns, rows
        self.whole, self.right = whole, right

    def _width(self, i: int) -> int:
        return max([len(self.columns[i]), *(len(row[i]) for row in self.rows)])

    def _narrowest(self, i: int) -> int:
        """A column's fewest characters: a whole column's widest cell, a wrapping one's
        longest word (and at least ``NARROWEST_WRAPPED``, when its cells are that wide)."""
        if self.columns[i] in self.whole:
            return self._width(i)
        words = [len(w) for row in self.rows for w in row[i].split()]
        return min(self._width(i), max([NARROWEST_WRAPPED, len(self.columns[i]), *words]))

    def _needed(self) -> int:
        """Characters the table needs: each column at its narrowest, and each cell's border
        and padding."""
        return 1 + sum(3 + self._narrowest(i) for i in range(len(self.columns)))

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.table import Table
        from rich.text import Text

        if self._needed() <= options.max_width:
            t = Table(title=self.title)
            for i, name in enumerate(self.columns):
                justify: Literal["left", "right"] = "right" if name in self.right else "left"
                narrowest = self._narrowest(i)
                if name in self.whole:
                    t.add_column(name, justify=justify, no_wrap=True, min_width=narrowest)
                else:
                    t.add_column(name, justify=justify, overflow="fold", min_width=narrowest)
            for row in self.rows:
                t.add_row(*row)
            yield t
            return
        yield Text(self.title)
        for row in self.rows:
            cells = list(zip(self.columns, row, strict=True))
            yield Text("  ".join(v for name, v in cells if name in self.whole and v))
            for name, value in cells:
                if name not in self.whole and value:  # wrapped between words, indented
                    for line in textwrap.wrap(
                        f"{name}: {value}",
                        width=max(options.max_width, NARROWEST_WRAPPED + 6),
                        initial_indent="    ",
                        subsequent_indent="      ",
                        break_on_hyphens=False,
                    ):
                        yield Text(line, overflow="fold")


_OUTPUTS = (1, 2)  # the process's stdout and stderr, whatever sys.stdout is rebound to


def outputs_closed() -> bool:
    """Whether stdout or stderr is a pipe whose reader has gone (``| head`` has exited): a
    ``BrokenPipeError`` from anything else (a child's pipe) is a failure to report."""
    poller = select.poll()
    for fd in _OUTPUTS:
        poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def detach_closed_outputs() -> None:
    """Point stdout and stderr at /dev/null, so that nothing flushed at exit meets the
    closed pipe again (Python would print "Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in _OUTPUTS:
        os.dup2(devnull, fd)
    os.close(devnull)


def print_json(payload: Any) -> None:
    print(json.dumps(payload, indent=1, sort_keys=True))


def plain_help(doc: str | None) -> str | None:
    """A docstring as help text: dedented, without reStructuredText's literal quotes."""
    if doc is None:
        return None
    text = inspect.cleandoc(doc)
    return re.sub(r"``([^`]+)``|`([^`]+)`", lambda m: m[1] or m[2], text)


def build_json(kc: KernelCache, results: Sequence[ArchResult], exit_code: int) -> dict[str, Any]:
    return {
        "namespace": kc.metadata.namespace,
        "name": kc.metadata.name,
        "exit_code": exit_code,
        "results": [asdict(r) for r in results],
    }


def verify_json(outcome: Outcome) -> dict[str, Any]:
    return {
        "ok": True,
        "key": outcome.key,
        "arch": outcome.arch,
        "generation": outcome.manifest.generation,
        "files": len(outcome.manifest.files),
        "bytes": outcome.manifest.total_bytes,
        "verify_seconds": round(outcome.verify_seconds, 3),
        "materialized": str(outcome.materialized) if outcome.materialized else None,
        "dropped": outcome.dropped,
        "warnings": outcome.warnings,
    }


LIVE_CLOCK = 12  # the live line's spinner, clock and the spaces between them


class BuildView:
    """What ``kernelcache build`` shows while it runs: the warm processes' lines, each kernel
    compiled with the elapsed time, and on a terminal a live line for the arch being warmed."""

    def __init__(self, kc: KernelCache, dry_run: bool = False) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.name, self.dry_run = kc.metadata.name, dry_run
        self.err = console(stderr=True)
        self.live = None
        if self.err.is_terminal:  # a spinner, the kernels so far and a running clock
            columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
            self.live = Progress(*columns, console=self.err, transient=True)
            self.live.start()
        self.task: Any = None
        self.arch = ""
        self.start = time.perf_counter()
        self.compiled = 0

    def _elapsed(self) -> str:
        return f"{time.perf_counter() - self.start:.1f} s"

    def _describe(self) -> str:
        """The live line's text; a narrow terminal shortens it, with an ellipsis, and never
        the clock beside it (the spinner and ``H:MM:SS`` take ``LIVE_CLOCK``)."""
        text = f"warming {self.name} for {self.arch}: {self.compiled} kernel(s) compiled"
        room = self.err.width - LIVE_CLOCK
        return text if len(text) <= room else text[: max(room - 1, 0)] + "…"

    def started(self, arch: str) -> None:
        self.arch, self.start, self.compiled = arch, time.perf_counter(), 0
        if self.live is None:
            doing = "checking (dry run)" if self.dry_run else "warming"
            print(f"{arch}: {doing} {self.name}", file=sys.stderr, flush=True)
            return
        if self.task is not None:
            self.live.remove_task(self.task)
        self.task = self.live.add_task(self._describe(), total=None)

    def line(self, arch: str, line: str) -> None:
        if not self.err.is_terminal:  # piped: a warmer's colours must not reach the log
            line = plain(line)
        timing = progress.parse(line)
        if timing is None:
            line = line.removeprefix("kernelcache: ")
            shown = line if line.startswith(f"{arch}: ") else f"{arch}: {line}"
            self.err.print(shown, markup=False, highlight=False)
        else:
            self.compiled += 1
            self.err.print(
                f"{arch}: [{self.compiled}] {timing.toolchain} {timing.kernel}: "
                f"{timing.seconds:.2f} s (elapsed {self._elapsed()})",
                markup=False,
                highlight=False,
            )
        if self.live is not None and self.task is not None:
            self.live.update(self.task, description=self._describe())

    def done(self, result: ArchResult) -> None:
        if self.dry_run and result.status != "failed":
            return  # the warm's own line said what it would do and why
        if result.status == "failed":
            detail = f"exit {result.exit_code}"
        else:
            detail = f"{result.files} files, {result.compiled} compiled"
        mark = "✗" if result.status == "failed" else "✓"
        self.err.print(
            f"{mark} {result.arch}: {result.status} in {result.seconds:.1f} s ({detail})",
            markup=False,
            highlight=False,
        )

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def plan_line(result: ArchResult) -> str:
    """What a dry run found for an arch, on one line: its status, the stamp, why."""
    running = f"; would run {', '.join(result.would_run)}" if result.would_run else ""
    stamp = str(result.stamp).removeprefix("blake3:")[:16]
    return f"{result.arch}: {result.status} (stamp {stamp}): {result.message}{running}"


def build_tables(
    kc: KernelCache, results: Sequence[ArchResult], dry_run: bool = False
) -> list[Any]:
    """The per-arch table and, when anything was compiled, the per-toolchain summary; for a
    dry run, what each arch would do and why."""
    if dry_run:
        return [_plan_table(kc, results)]
    rows = [
        [
            r.arch,
            r.status,
            (r.generation or "-")[:16],
            str(r.files),
            f"{r.bytes:,}",
            str(r.compiled),
            f"{r.seconds:.2f}",
        ]
        for r in results
    ]
    tables = [
        table(
            f"kernelcache build {kc.metadata.namespace}/{kc.metadata.name}",
            ("arch", "status", "generation", "files", "bytes", "compiled", "seconds"),
            rows,
            whole=("arch", "status", "generation"),
            right=("files", "bytes"),
        )
    ]
    summary = [
        [
            r.arch,
            total["toolchain"],
            str(total["compiled"]),
            f"{total['seconds']:.2f}",
            f"{total['bytes']:,}",
            slowest(r.slowest_kernels, total["toolchain"]),
        ]
        for r in results
        for total in r.toolchains
    ]
    if summary:
        tables.append(
            table(
                "compiled per toolchain",
                ("arch", "toolchain", "kernels", "seconds", "bytes", "slowest"),
                summary,
                whole=("arch", "toolchain"),
                right=("bytes",),
            )
        )
    return tables


def _plan_table(kc: KernelCache, results: Sequence[ArchResult]) -> Any:
    rows = [
        [
            r.arch,
            r.status,
            (r.generation or "-")[:16],
            str(r.stamp or "-").removeprefix("blake3:")[:16],
            ", ".join(r.would_run) or "-",
            r.message,
        ]
        for r in results
    ]
    return table(
        f"kernelcache build --dry-run {kc.metadata.namespace}/{kc.metadata.name}",
        ("arch", "status", "generation", "stamp", "would run", "why"),
        rows,
        whole=("arch", "status", "generation"),
    )


def slowest(kernels: Sequence[dict[str, Any]], toolchain: str) -> str:
    """The slowest kernels of one toolchain (``flashinfer`` covers ``flashinfer/nvcc``)."""
    mine = [k for k in kernels if k["toolchain"].split("/", 1)[0] == toolchain]
    mine.sort(key=lambda k: -k["seconds"])
    return ", ".join(f"{k['kernel']} {k['seconds']:.2f} s" for k in mine[:SLOWEST_SHOWN]) or "-"


def doctor_table(report: Report) -> Any:
    rows = [[c.check, c.status, c.detail] for c in report.checks]
    columns = ("check", "status", "detail")
    return table("kernelcache doctor", columns, rows, whole=("check", "status"))
