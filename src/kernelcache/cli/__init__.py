"""The ``kernelcache`` command (the console script ``kernelcache.cli:main``): one module per
command group beside a thin ``main``; see ``kernelcache.cli.main``."""

from kernelcache.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
