"""vLLM's cache root: bound to the absolute path it was built at (its artifacts name it), so
the generation keeps its tree under ``files/vllm`` with that root as the stamp factor
``vllm/cache_root``, and the init-container copies it back to exactly that path, writable
(``place``). A root is only ever emptied when it is kernelcache's own (``MARKER``, written
before anything else): a path that holds something else is refused, never cleared. Pure
Python, no vLLM: the init-container runs this."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kernelcache.errors import StampMismatchError, StorageError

if TYPE_CHECKING:
    from kernelcache.store import Manifest

log = logging.getLogger(__name__)


FACTOR = "vllm/cache_root"
MODEL_FACTOR = "vllm/model"
SUBDIR = "vllm"  # files/vllm: VLLM_CACHE_ROOT's tree, placed back at its root
MARKER = ".kernelcache-vllm-root"
ENV = "VLLM_CACHE_ROOT"
PLAN_DIR = "startup_plan"  # vLLM's startup plans under its cache root, one per fingerprint


def recorded_root(manifest: Manifest) -> Path | None:
    """The cache root the generation was built at, or None when it holds no vLLM cache."""
    factors = manifest.stamp.get("factors")
    value = factors.get(FACTOR) if isinstance(factors, Mapping) else None
    return Path(value) if isinstance(value, str) and value else None


def check_env_root(manifest: Manifest, environ: Mapping[str, str]) -> None:
    """Refuse when ``VLLM_CACHE_ROOT`` here names another root than the one built at."""
    root = recorded_root(manifest)
    here = environ.get(ENV)
    if root is not None and here and Path(os.path.expanduser(here)) != root:
        raise StampMismatchError(
            f"stamp mismatch: {FACTOR}: {root} != {here} ({ENV}; vLLM's compile cache holds "
            f"absolute paths: set {ENV}={root} in the pod, as in the compile Job)"
        )


def claim(root: Path) -> None:
    """Make ``root`` an empty directory of kernelcache's own, or refuse a foreign one."""
    from kernelcache.store import io_errors

    if not root.is_absolute() or root == Path(root.anchor):
        raise StorageError(f"{root}: a vLLM cache root must be an absolute path below /")
    with io_errors(root):
        root.mkdir(parents=True, exist_ok=True)
        entries = [entry for entry in root.iterdir() if entry.name != MARKER]
        if entries and not (root / MARKER).is_file():
            raise StorageError(
                f"{root}: vLLM cache root is not empty and not kernelcache's "
                f"(holds {entries[0].name}; give the pod an empty volume there)",
                path=str(root),
            )
        (root / MARKER).write_text("kernelcache materializes vLLM's cache here\n")
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    if not os.access(root, os.W_OK):
        raise StorageError(f"{root}: vLLM cache root is not writable (vLLM writes into it)")


def place(
    generation_copy: Path, manifest: Manifest, root: Path, dropped: Iterable[str] = ()
) -> int:
    """Copy the generation's ``files/vllm`` to ``root`` (claimed first); the files copied.

    ``dropped``: files of the generation the copy left out on purpose (tuning of another GPU).
    """
    from kernelcache.store import FILES_DIR, io_errors

    claim(root)
    source = generation_copy / FILES_DIR / SUBDIR
    with io_errors(root):
        if source.is_dir():
            shutil.copytree(source, root, dirs_exist_ok=True, copy_function=shutil.copyfile)
    if lost := sorted(set(missing(manifest, root)) - set(dropped)):
        raise StorageError(
            f"{root}: {len(lost)} file(s) of the vLLM cache missing after the copy, e.g. {lost[0]}"
        )
    return sum(1 for e in manifest.files if e.path.startswith(f"{SUBDIR}/")) - len(
        [d for d in dropped if d.startswith(f"{SUBDIR}/")]
    )


def missing(manifest: Manifest, root: Path) -> list[str]:
    """The generation's vLLM files that ``root`` lacks or holds with another size."""
    lost = []
    for entry in manifest.files:
        if not entry.path.startswith(f"{SUBDIR}/"):
            continue
        path = root / entry.path.removeprefix(f"{SUBDIR}/")
        try:
            if path.stat().st_size != entry.size:
                lost.append(entry.path)
        except OSError:
            lost.append(entry.path)
    return lost
