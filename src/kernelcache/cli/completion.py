"""``completion``: a shell completion script generated from the whole parser, which ``main``
hands over (this module imports no other command)."""

from __future__ import annotations

import argparse
from typing import Any

from kernelcache.cli import options


def cmd_completion(args: argparse.Namespace) -> int:
    """Print a completion script generated from this parser.

    bash: eval "$(kernelcache completion bash)"; zsh: eval "$(kernelcache completion zsh)".
    """
    from kernelcache.completion import script

    print(script(args.root_parser, args.shell))
    return 0


def register(sub: Any, root: argparse.ArgumentParser) -> None:
    p = options.add_command(sub, "completion", cmd_completion, "print a shell completion script")
    p.add_argument("shell", choices=["bash", "zsh"], help="the shell to complete for")
    p.set_defaults(root_parser=root)
