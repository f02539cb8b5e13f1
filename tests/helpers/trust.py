"""A spec whose compile is one command (cheap, counted), and an attacker's edit of a kept
generation: what the signing tests of the store and the operator share."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import blake3

from kernelcache.store import MANIFEST_NAME, FileEntry, generation_id
from kernelcache.store.manifest import load_manifest

KERNEL = "triton/k.bin"  # what the command warmer writes, under files/


def warmer(version: str) -> dict[str, object]:
    """A command warmer writing one kernel and counting its runs (a compile) in a file."""
    code = (
        "import os, pathlib; "
        f"pathlib.Path(os.environ['TRITON_CACHE_DIR'], 'k.bin').write_text('kernel {version}'); "
        "open(os.environ['KC_TEST_RUNS'], 'a').write('run\\n')"
    )
    return {"type": "command", "command": [sys.executable, "-c", code]}


def forge(gen_dir: Path, rel: str, data: bytes) -> Path:
    """An attacker's edit of a kept generation, not signed: the file changed and the
    manifest rewritten to match it (digest, checksum, generation id), under the new id, in
    place of the original."""
    manifest = load_manifest(gen_dir)
    digest = "blake3:" + blake3.blake3(data).hexdigest()
    files = tuple(
        FileEntry(e.path, len(data), digest) if e.path == rel else e for e in manifest.files
    )
    forged = dataclasses.replace(
        manifest, files=files, generation=generation_id(manifest.stamp["digest"], files)
    )
    dst = gen_dir.parent / forged.generation
    shutil.copytree(gen_dir / "files", dst / "files")
    (dst / "files" / rel).write_bytes(data)
    (dst / MANIFEST_NAME).write_bytes(forged.to_bytes())
    shutil.rmtree(gen_dir)
    return dst
