"""Shared test set-up: the repo's examples are importable; CuTe-DSL tests target sm_90a.

CuTe-DSL compiles and exports for any arch on a CPU-only machine, so those tests run in CI.
``CUTE_DSL_ARCH`` must be set before the DSL is imported: it is read at import.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, str(EXAMPLES))

HAVE_CUTE = importlib.util.find_spec("cutlass") is not None
needs_cute = pytest.mark.skipif(not HAVE_CUTE, reason="nvidia-cutlass-dsl is not installed")


def system_tool(name: str) -> str:
    """The path of a program a test drives (``scripts/install-system-tools.sh`` installs it).

    Missing: the test skips, saying so; under CI (``CI`` set) it fails, since there the
    README's test command must have installed it and a skip would hide the gap.
    """
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is not installed (scripts/install-system-tools.sh installs it)"
    if os.environ.get("CI"):
        pytest.fail(f"{message}; under CI that is a failure, not a skip")
    pytest.skip(message)


def subprocess_env(**overrides: str) -> dict[str, str]:
    """The environment for a child Python: examples importable, overrides applied."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(EXAMPLES), str(REPO / "src"), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    env.update(overrides)
    return env


def run_kernelcache(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """The real CLI in a fresh process, as a user or a Job runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kernelcache", *args],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=900,
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The failure's only stderr line; fails the test on a traceback or a multi-line error."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def kernelcache_doc(
    name: str, namespace: str | None = None, arches: tuple[str, ...] = ("sm_90a",), **spec: Any
) -> dict[str, Any]:
    """A KernelCache of one GPU class per arch and the demo CuTe-DSL warmer; ``spec`` adds or
    replaces fields of its spec. Without a namespace, the CLI files it under ``default``."""
    metadata = {"name": name} if namespace is None else {"name": name, "namespace": namespace}
    return {
        "apiVersion": "kernelcache.dev/v1alpha1",
        "kind": "KernelCache",
        "metadata": metadata,
        "spec": {
            "model": "example/model",
            "engine": {"image": "ghcr.io/kernelcache/examples:0.1.0"},
            "gpuClasses": [{"name": a.replace("_", "-"), "arch": a} for a in arches],
            "warmers": [{"type": "cute-dsl", "entryPoints": ["demo_kernels:warm"]}],
            **spec,
        },
    }


def write_warmer_spec(
    tmp_path: Path, warmer: dict[str, Any], arch: str = "sm_90a", name: str = "kc"
) -> Path:
    """A one-arch KernelCache with a single warmer, written to ``tmp_path/kc.yaml``."""
    spec = tmp_path / "kc.yaml"
    spec.write_text(yaml.safe_dump(kernelcache_doc(name, arches=(arch,), warmers=[warmer])))
    return spec


T = TypeVar("T")


def wait_until(
    check: Callable[[], T], timeout: float = 30.0, what: str = "", interval: float = 0.05
) -> T:
    """Poll until ``check`` returns something truthy; fail with its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}: last {value!r}")
        time.sleep(interval)
