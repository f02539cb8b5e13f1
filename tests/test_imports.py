"""The verify path runs in a slim init-container image: it must work with no torch or DSL."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kernelcache.store import Store
from tests.conftest import scaled, subprocess_env

HEAVY = ("torch", "cutlass", "triton", "flashinfer", "tvm_ffi", "numpy")

# A child interpreter in which importing any heavy package fails, as in the slim image.
BLOCKER = textwrap.dedent(
    f"""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {HEAVY!r}:
                raise ImportError(f"{{name}} is not in the slim image")
    sys.meta_path.insert(0, Block())
    from kernelcache.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def slim_kernelcache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER, *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )


def test_verify_and_materialize_run_without_torch_or_dsl(tmp_path):
    files = tmp_path / "files" / "cute-dsl"
    files.mkdir(parents=True)
    (files / "k.o").write_bytes(b"\x7fELF" + bytes(1000))
    store = Store(tmp_path / "store")
    with store.writer("default/demo/sm_90a") as writer:
        writer.publish(
            tmp_path / "files", {"digest": "blake3:" + "1" * 64, "factors": {"arch": "sm_90a"}}, {}
        )
    target = tmp_path / "serve"
    target.mkdir()
    proc = slim_kernelcache(
        "verify", "--store", str(store.root), "--key", "default/demo/sm_90a",
        "--materialize", str(target),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "verified: 1 files" in proc.stdout
    (generation,) = [p for p in target.iterdir() if p.is_dir()]
    assert (generation / "files" / "cute-dsl" / "k.o").exists()

    inspected = slim_kernelcache("inspect", "--store", str(store.root), "--json")
    assert inspected.returncode == 0, inspected.stderr


def test_help_runs_without_torch_or_dsl():
    proc = slim_kernelcache("--help")
    assert proc.returncode == 0 and "exit codes" in proc.stdout
