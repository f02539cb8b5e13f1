"""Real wheels for the key tests: built reproducibly, installed by pip.

A stamp describes an installed distribution by its version and its RECORD, so a test that
moves or keeps a key must install the way an image build does: pip writes RECORD, INSTALLER,
REQUESTED, ``direct_url.json`` (the wheel's URL) and bytecode, and every one of those differs
between two installs of the same wheel. Each wheel holds one stand-in module
(``kcwheel_<name>``), so it never shadows the real package of the same distribution name.
"""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from tests.conftest import scaled

# Every member gets the same timestamp, so the same inputs give the same wheel bytes.
_ZIP_TIME = (2020, 1, 1, 0, 0, 0)


def _escaped(name: str) -> str:
    """The distribution name as wheel file names and .dist-info folders spell it."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def build_wheel(out_dir: Path, name: str, version: str, build: str = "1") -> Path:
    """A pure-Python wheel of ``name`` ``version``; another ``build`` changes one module byte."""
    stem = f"{_escaped(name)}-{version}"
    info = f"{stem}.dist-info"
    files = {
        f"kcwheel_{_escaped(name)}/__init__.py": f'BUILD = "{build}"\n'.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: kernelcache-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    rows = [f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items()]
    files[f"{info}/RECORD"] = "".join([*rows, f"{info}/RECORD,,\n"]).encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path, data in files.items():
            member = zipfile.ZipInfo(path, _ZIP_TIME)
            member.external_attr = 0o644 << 16
            archive.writestr(member, data, compress_type=zipfile.ZIP_DEFLATED)
    return wheel


def pip_install(target: Path, wheels: Iterable[Path], *, compile_bytecode: bool = True) -> Path:
    """Install wheel files into ``target`` with pip, offline and ignoring user configuration."""
    cmd = [
        sys.executable, "-m", "pip", "install", "--isolated", "--no-index", "--no-deps",
        "--disable-pip-version-check", "--no-cache-dir", "--quiet", "--target", str(target),
    ]  # fmt: skip
    if not compile_bytecode:
        cmd.append("--no-compile")
    proc = subprocess.run(
        [*cmd, *map(str, wheels)], capture_output=True, text=True, timeout=scaled(300), check=False
    )
    assert proc.returncode == 0, proc.stderr
    return target
