"""The command line's words: the parser every command shares (no abbreviations, typos named
with the nearest option), argument types, and the options several commands take alike."""

from __future__ import annotations

import argparse
import decimal
import difflib
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernelcache import contract, learned, output
from kernelcache.errors import SpecError, one_line

Command = Callable[[argparse.Namespace], int]
Failed = Callable[[argparse.Namespace, int, str, float], Any]


def path(text: str) -> Path:
    """A path argument; an empty one would silently mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return Path(text)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


_BYTES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_BYTES.update({f"{p}i": 2 ** (10 * n) for n, p in enumerate("KMGTPE", start=1)})
_QUANTITY = re.compile(r"(?P<number>\+?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?)(?P<suffix>[A-Za-z]*)")


def byte_quantity(text: str) -> int:
    """A size in bytes, as a Kubernetes quantity (``10Gi``, ``500M``, ``1.5Ti``, ``1e9``)
    or a plain number: what the chart's values and a PVC's size are written as. A fraction
    of a byte is rounded up, as the API server rounds a quantity."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None or match["suffix"] not in _BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: a number of bytes or a quantity such as 10Gi or 500M "
            "(suffixes Ki Mi Gi Ti Pi Ei, k M G T P E)"
        )
    value = decimal.Decimal(match["number"]) * _BYTES[match["suffix"]]
    return int(value.to_integral_value(rounding=decimal.ROUND_CEILING))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's, but an option's help never breaks inside a word: textwrap's default
    splits at hyphens, so ``--plain-http`` or ``/dev/termination-log`` read as two words
    (``/dev/termination-`` then ``log``) on a narrow terminal. Descriptions (docstrings)
    keep their own lines."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is a failure like every other (``main`` reports it);
    no option is taken by an abbreviation (as kubectl and helm take none), an unknown option
    is named before anything else the words lack, and a mistyped option, command or choice
    gets the nearest one suggested."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str) -> Any:
        # main's line already begins "kernelcache: error:": name the command, not the program
        # again ("kernelcache: error: kernelcache build: ...").
        command = self.prog.partition(" ")[2]
        raise SpecError(f"{command}: {one_line(message)}" if command else one_line(message))

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        words = sys.argv[1:] if args is None else list(args)
        for word in words:
            if word == "--" or (self._subparsers is not None and not word.startswith("-")):
                break  # past the options: positionals, or the command's own words
            if word.startswith("-") and not _NUMBER.match(word):
                name = word.split("=", 1)[0] if word.startswith("--") else word[:2]
                if name not in self._option_string_actions:
                    self.error(f"unknown option {self._unknown(word, name)}")
        return super().parse_known_args(args, namespace)

    def _unknown(self, word: str, name: str) -> str:
        """The unknown option as typed, with the nearest known one: ``-json`` is one word
        (no short option ``-j`` takes ``son``), most likely ``--json`` with a dash lost."""
        if word.startswith("--") or len(word) == 2:
            return f"{name}{did_you_mean(name, self._known_options())}"
        word = word.split("=", 1)[0]
        return f"{word}{did_you_mean('-' + word, self._known_options())}"

    def _known_options(self) -> list[str]:
        return [o for o in self._option_string_actions if o.startswith("--")]

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            choices = [str(c) for c in action.choices]
            raise argparse.ArgumentError(
                action,
                f"invalid choice: {value!r}{did_you_mean(str(value), choices)} "
                f"(choose from {', '.join(choices)})",
            )


_NUMBER = re.compile(r"^-\d")  # a negative number is a value, not an option


def did_you_mean(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def add_command(
    sub: Any, name: str, func: Command, help_text: str, failed: Failed | None = None
) -> Any:
    """A subcommand whose description is its function's docstring; ``failed`` turns a
    failure into the command's own ``--json`` object (``warm``'s result)."""
    p = sub.add_parser(
        name,
        help=help_text,
        description=output.plain_help(func.__doc__),
        epilog="exit codes: see kernelcache --help",
        formatter_class=HelpFormatter,
    )
    p.set_defaults(func=func, failed=failed)
    return p


def store_arg(p: Any) -> None:
    p.add_argument("--store", type=path, required=True, help="store root (the PV mount)")


def registry_args(p: Any) -> None:
    p.add_argument(
        "--authfile",
        type=path,
        help="docker config or .dockerconfigjson with the registry's credentials",
    )
    p.add_argument("--ca-file", type=path, help="CA bundle the registry's TLS must chain to")
    p.add_argument(
        "--plain-http",
        action="store_true",
        help="speak plain HTTP to the registry: only a loopback one (localhost, 127.0.0.1, "
        "::1) or one named in KERNELCACHE_PLAIN_HTTP_HOSTS",
    )


def registry_access(args: argparse.Namespace) -> dict[str, Any]:
    """What ``registry_args`` parsed, as the distribution functions take it."""
    return {"auth": args.authfile, "ca_file": args.ca_file, "plain_http": args.plain_http}


def json_arg(p: Any, schema: str) -> None:
    p.add_argument(
        "--json", action="store_true", help=f"print JSON (schema: docs/cli-schemas/{schema})"
    )


def dry_run_arg(p: Any) -> None:
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="compile nothing: say what would be compiled, from which stamp, and why",
    )


def trusted_arg(p: Any) -> None:
    p.add_argument(
        "--public-key",
        type=path,
        help="the public key(s) pods verify with (PEM, several during a rotation): the "
        "signing key must be one; a generation signed by another is re-signed, not rebuilt",
    )


def learned_arg(p: Any) -> None:
    p.add_argument(
        "--learned",
        type=path,
        metavar="FILE",
        help=f"a learned record (JSON, what a serving pod serves at {learned.PATH}, or "
        f"{contract.LEARNED.name}): its keys are warmed too",
    )
