"""Fetch the Python sources of the vLLM releases the compatibility tests read.

``tests/test_vllm_adapter.py`` checks, by reading vLLM's sources (``ast``, no import: vLLM
needs a GPU build of torch), that every internal the vllm toolchain binds exists in each
release the toolchain declares (``kernelcache.toolchains.vllm.adapter.CHECKED_RELEASES``).
This puts those sources under ``.cache/vllm-sources/<version>/`` (git-ignored): the release's
source archive from the package index, its sha256 checked against the index's, and only its
``vllm/**/*.py`` files kept. Idempotent: a release already there is not fetched again.

Why the source archive and not the wheel: it is 38-51 MB where a wheel is 239-336 MB (its
CUDA libraries), and the tests read only Python files. Why not ``pip download
--no-binary :all:``: pip prepares an sdist's metadata before it keeps the file, installing
vLLM's build dependencies (torch, CMake) first: minutes, on every fresh machine. The archive
is fetched as pip fetches it: the index's simple API (PEP 691), the file it lists, its hash.

Usage: python scripts/fetch-vllm-sources.py [VERSION ...] [--into DIR]
(no version: every release ``CHECKED_RELEASES`` names; ``PIP_INDEX_URL`` picks the index).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_INTO = REPO / ".cache" / "vllm-sources"
TIMEOUT_S = 120  # one request: the index page, or one archive
COMPLETE = ".complete"  # written last: a release directory without it is refetched


def _get(url: str, accept: str | None = None) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
        return bytes(answer.read())


def archive_of(index: str, version: str) -> tuple[str, str, int]:
    """(url, sha256, size) of vLLM ``version``'s source archive, as the index lists it."""
    page = json.loads(
        _get(f"{index.rstrip('/')}/vllm/", accept="application/vnd.pypi.simple.v1+json")
    )
    name = f"vllm-{version}.tar.gz"
    for entry in page.get("files", []):
        if entry.get("filename") == name:
            return entry["url"], entry["hashes"]["sha256"], int(entry.get("size") or 0)
    raise SystemExit(f"fetch-vllm-sources: {index} lists no {name}")


def fetch(version: str, into: Path, index: str) -> str:
    """The release's ``vllm/**/*.py`` under ``into/<version>``; what was done, in words."""
    target = into / version
    if (target / COMPLETE).is_file():
        return f"vllm {version}: already at {target}"
    url, sha256, size = archive_of(index, version)
    began = time.monotonic()
    data = _get(url)
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise SystemExit(f"fetch-vllm-sources: {url}: sha256 {got} != the index's {sha256}")
    fetched = time.monotonic() - began
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=into))
    kept = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                # vllm-X/vllm/...py only: no tests, no docs, no CUDA sources.
                if len(parts) < 3 or parts[1] != "vllm" or not member.name.endswith(".py"):
                    continue
                if not member.isfile() or ".." in parts:
                    continue
                path = staging.joinpath(*parts[1:])
                path.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                path.write_bytes(source.read())
                kept += 1
        (staging / COMPLETE).write_text(json.dumps({"url": url, "sha256": sha256}) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return (
        f"vllm {version}: {len(data) / 1e6:.1f} MB archive (index: {size / 1e6:.1f} MB) in "
        f"{fetched:.1f} s, {kept} Python files kept, {time.monotonic() - began:.1f} s in all"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*")
    parser.add_argument("--into", type=Path, default=DEFAULT_INTO)
    args = parser.parse_args(argv)
    versions = args.versions
    if not versions:
        sys.path.insert(0, str(REPO / "src"))
        from kernelcache.toolchains.vllm.adapter import CHECKED_RELEASES

        versions = list(CHECKED_RELEASES)
    index = os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
    args.into.mkdir(parents=True, exist_ok=True)
    for version in versions:
        print(fetch(version, args.into, index), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
