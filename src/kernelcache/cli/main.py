"""The ``kernelcache`` command: build, warm, verify, prefetch, explain, doctor, inspect, gc,
push, pull, keygen, operator, completion.

Each subcommand lives in the module of its group (``kernelcache.cli.<group>``: its handler
and its options, beside each other) and makes one library call. This module only assembles
the parser and runs a command: every failure prints one line naming the file, factor or
field at fault and exits with the code of its class (listed in ``--help``); an unexpected
error is reported the same way, never as a traceback. How results are printed (tables,
``--json``, build progress) lives in ``kernelcache.output``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator

from kernelcache import __version__, output
from kernelcache.cli import (
    build,
    completion,
    explain,
    keygen,
    operator,
    options,
    registry,
    store,
    verify,
)
from kernelcache.errors import EXIT_CODE_HELP, ExitCode, error_line, error_object, exit_code_of


def build_parser() -> argparse.ArgumentParser:
    parser = options.Parser(
        prog="kernelcache",
        description="Compile GPU kernels ahead of time, store them stamped, verify before serving.",
        epilog=_exit_codes_epilog(),
        formatter_class=options.HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kernelcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The order of `kernelcache --help`: the build, the node, the why, the store, the registry.
    build.register(sub)
    verify.register(sub)
    explain.register(sub)
    store.register(sub)
    registry.register(sub)
    operator.register(sub)
    keygen.register(sub)
    completion.register(sub, parser)
    return parser


def _exit_codes_epilog() -> str:
    rows = "\n".join(f"  {int(code):>3}  {text}" for code, text in EXIT_CODE_HELP.items())
    return f"exit codes (every command):\n{rows}"


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure, a bad command line included, is reported here and
    only here: its one line on stderr, the exit code of its class and, when ``--json`` was
    asked for, one failure object on stdout (the command's own, else ``error_object``), so a
    new subcommand gets all three without a line of its own.

    A reader that stops reading (``| head``, a closed ``less``) ends the command quietly with
    141, as a command killed by SIGPIPE exits in a shell: no line, no traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        try:
            return _run(argv)
        finally:  # what is still buffered meets a closed pipe here, not at interpreter exit
            sys.stdout.flush()
    except BrokenPipeError:
        output.detach_closed_outputs()
        return int(ExitCode.BROKEN_PIPE)


def _run(argv: list[str]) -> int:
    args = None
    start = time.perf_counter()
    with _interrupts() as interrupted:
        try:
            parser = build_parser()
            if not argv:  # what there is to run, rather than one line that a COMMAND is missing
                parser.print_help(sys.stderr)
                return int(ExitCode.USAGE)
            args = parser.parse_args(argv)
            return int(args.func(args))
        except (Exception, KeyboardInterrupt) as exc:  # a bug too: one line, its class
            if isinstance(exc, BrokenPipeError) and output.outputs_closed():
                raise  # the reader went away: main ends quietly
            # A Ctrl-C is the cause of whatever failure it led to on its way out (a warmer's
            # child ended by it first, a pipe it closed): the exit is 130 all the same.
            failure: BaseException = KeyboardInterrupt() if interrupted else exc
            line, code = error_line(failure), exit_code_of(failure)
    print(line, file=sys.stderr)
    failed = getattr(args, "failed", None)
    payload = failed(args, code, line, time.perf_counter() - start) if failed else None
    if _wants_json(argv):
        output.print_json(payload if payload is not None else error_object(failure))
    return code


@contextlib.contextmanager
def _interrupts() -> Iterator[list[int]]:
    """Record every SIGINT this process gets (and raise ``KeyboardInterrupt`` as Python
    does) while a command runs; only the main thread can take signals."""
    seen: list[int] = []
    on_main = threading.current_thread() is threading.main_thread()
    if not on_main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield seen  # not ours to take (a process started with SIGINT ignored keeps it so)
        return

    def on_sigint(signum: int, frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def _wants_json(argv: list[str]) -> bool:
    """``--json`` among the options (read from the words, since a failed parse has no args)."""
    return "--json" in (argv[: argv.index("--")] if "--" in argv else argv)
