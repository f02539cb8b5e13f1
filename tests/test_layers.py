"""The import layers of pyproject.toml hold, and a break of one fails (``lint-imports``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import scaled

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(src: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )


def test_the_tree_keeps_every_layer() -> None:
    proc = lint_imports(REPO / "src", REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_import_across_a_layer_fails_naming_the_contract(tmp_path: Path) -> None:
    shutil.copytree(REPO / "src" / "kernelcache", tmp_path / "src" / "kernelcache")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    spec = tmp_path / "src" / "kernelcache" / "spec" / "common.py"
    spec.write_text(spec.read_text() + "\nfrom kernelcache import cli  # noqa: E402\n")
    proc = lint_imports(tmp_path / "src", tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "kernelcache.spec is not allowed to import kernelcache.cli" in proc.stdout
