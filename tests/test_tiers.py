"""The suite's tiers: what ``make test-quick`` leaves out is what ``tests/tiers.py`` and the
markers say, and each name there is a test of its file."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.conftest import REPO, scaled, subprocess_env
from tests.tiers import MEASURED_SLOW


def test_every_test_the_tiers_name_is_a_test_of_its_file() -> None:
    """A renamed or removed test would otherwise slip back into the quick tier unnoticed."""
    for file, names in MEASURED_SLOW.items():
        tree = ast.parse((REPO / "tests" / file).read_text())
        defined = {
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.name.startswith("test_")
        }
        assert not set(names) - defined, f"{file}: no such tests: {sorted(set(names) - defined)}"


def collected(*args: str) -> set[str]:
    """The test functions pytest collects from tests/test_build.py with ``args``."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", *args,
         "tests/test_build.py"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {line.split("::")[1].split("[")[0] for line in proc.stdout.splitlines() if "::" in line}


def test_a_measured_slow_test_is_left_out_of_the_quick_tier_only() -> None:
    """The conftest's hook marks the tests the table names: ``-m "not slow"`` (make test-quick)
    leaves them out, ``-m "not large"`` (make test) keeps them."""
    named = set(MEASURED_SLOW["test_build.py"])
    assert named <= collected("-m", "not large")
    assert not named & collected("-m", "not slow and not large")
