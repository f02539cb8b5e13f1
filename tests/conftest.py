"""Shared test set-up: the repo's examples are importable; CuTe-DSL tests target sm_90a.

CuTe-DSL compiles and exports for any arch on a CPU-only machine, so those tests run in CI.
``CUTE_DSL_ARCH`` must be set before the DSL is imported: it is read at import.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, str(EXAMPLES))

HAVE_CUTE = importlib.util.find_spec("cutlass") is not None
needs_cute = pytest.mark.skipif(not HAVE_CUTE, reason="nvidia-cutlass-dsl is not installed")


def subprocess_env(**overrides: str) -> dict[str, str]:
    """The environment for a child Python: examples importable, overrides applied."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(EXAMPLES), str(REPO / "src"), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    env.update(overrides)
    return env
