"""``operator``: the Kubernetes operator (kopf), installed with ``kernelcache[operator]``."""

from __future__ import annotations

import argparse
from typing import Any

from kernelcache.cli import options
from kernelcache.errors import NotInstalledError


def cmd_operator(args: argparse.Namespace) -> int:
    """Run the Kubernetes operator until stopped; it is configured by KERNELCACHE_OPERATOR_*."""
    try:
        from kernelcache.controller.main import run
    except ModuleNotFoundError as exc:
        missing = f"operator: {exc.name} is not installed; install kernelcache[operator]"
        raise NotInstalledError(missing) from None
    return run(verbose=args.verbose)


def register(sub: Any) -> None:
    p = options.add_command(sub, "operator", cmd_operator, "run the Kubernetes operator (kopf)")
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
