"""Store fault helpers shared by the fault-injection and concurrency tests: the publishing
worker process, the transient names a dead writer leaves, and the every-generation check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernelcache.store import Store, verify

WORKER = Path(__file__).parent / "store_worker.py"

TRANSIENT = (".staging-", ".trash-", ".CURRENT.", ".HISTORY.")


def start_worker(*args: str | Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def wait_for(proc: subprocess.Popen[bytes], line: bytes) -> None:
    assert proc.stdout is not None
    got = proc.stdout.readline()
    if got != line:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"worker said {got!r}, not {line!r}: {err.decode()[-2000:]}")


def transient(key_dir: Path) -> list[str]:
    return sorted(n for n in os.listdir(key_dir) if n.startswith(TRANSIENT))


def assert_every_generation_verifies(store: Store, key: str, where: str) -> str:
    """CURRENT names a generation that verifies, and so does every directory under a
    generation id, CURRENT's or not: none is ever partial. Returns CURRENT's id."""
    gen_dir = store.current(key)
    assert gen_dir is not None, f"{where}: no CURRENT"
    key_dir = store.key_dir(key)
    generations = [p for p in key_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert gen_dir in generations, where
    for path in generations:
        result = verify(path)
        assert result.ok, f"{where}: {result.problems}"
    return gen_dir.name
