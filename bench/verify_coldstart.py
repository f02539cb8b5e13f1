"""The init-container's cost: `kernelcache verify --materialize` against `cp -r` + `b3sum`.

A serving pod waits for its init-container, so the verify-and-copy step must cost about what
the least a careful operator would do costs: copy the cache out of the volume and hash it.
This builds a synthetic generation with a realistic file-size mix (many KB-size ``.o`` and
``.json`` kernels and metadata, some MB-size ``.so``/``.cubin`` modules; ~85% of the bytes in
the big files), publishes it, and times with the page cache warm (every file read once
first), best of N, the copy removed and the disk synced between runs (untimed):

- baseline: ``cp -r files/ DST`` then ``b3sum`` over every copied file (all cores);
- ``kernelcache verify --materialize DST``: the whole command in a fresh process, as the
  init-container runs it (interpreter start-up, manifest, signature, paths, sizes and
  unlisted files checked in the volume, then a parallel copy that checks every digest of the
  bytes as it copies them, not fsynced (an emptyDir does not outlive a crash), and the env
  file);
- for the breakdown: ``cp -r`` alone, ``b3sum`` alone, and ``kernelcache verify`` without
  ``--materialize``.

Targets: verify --materialize within 1.2x of the baseline, and at least 1 GB/s on 2 cores.

    python bench/verify_coldstart.py [--size-mb 2048] [--repeat 3] [--target-dir DIR]

``--target-dir`` puts the copies elsewhere (e.g. ``/dev/shm``, as an emptyDir with
``medium: Memory``); by default they go next to the store, on the same disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from synthetic import publish_generation

KEY = "bench/coldstart/sm_90a"


def best_of(repeat: int, fn: Callable[[], object], reset: Callable[[], None]) -> float:
    """Best wall time of fn over repeat runs, after one untimed warm-up; reset (untimed)
    after every run removes what it wrote and syncs, so no run pays for another's writeback."""
    fn()
    reset()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        reset()
    return min(times)


def sh(command: str) -> None:
    subprocess.run(["sh", "-c", command], check=True, stdout=subprocess.DEVNULL)


def kernelcache(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "kernelcache", *args], check=True, stdout=subprocess.DEVNULL
    )


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f} (1 min), {five:.2f} (5 min)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=2048, help="cache size (default 2048)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per row (best of)")
    parser.add_argument("--target-dir", type=Path, help="where copies go (default: next to store)")
    args = parser.parse_args()
    if shutil.which("b3sum") is None:
        print("b3sum is not installed (Debian/Ubuntu: apt-get install b3sum)", file=sys.stderr)
        return 1
    cores = len(os.sched_getaffinity(0))
    load_before = load()
    with tempfile.TemporaryDirectory(prefix="kc-coldstart-") as tmp:
        gen, count, total = publish_generation(Path(tmp), KEY, args.size_mb)
        files = gen / "files"
        targets = Path(tempfile.mkdtemp(prefix="kc-coldstart-dst-", dir=args.target_dir or tmp))
        dst = targets / "dst"

        def reset() -> None:
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()

        def nothing() -> None:
            pass

        hash_all = f"find {dst} -type f -print0 | xargs -0 b3sum"
        verify_args = ("verify", "--store", str(Path(tmp) / "store"), "--key", KEY)
        try:
            sh(f"cp -r {files} {dst}")  # a copy for the b3sum-alone row
            rows = [
                ("b3sum alone (copied tree)", best_of(args.repeat, lambda: sh(hash_all), nothing))
            ]
            reset()
            rows += [
                ("cp -r alone", best_of(args.repeat, lambda: sh(f"cp -r {files} {dst}"), reset)),
                (
                    "baseline: cp -r + b3sum",
                    best_of(args.repeat, lambda: sh(f"cp -r {files} {dst} && {hash_all}"), reset),
                ),
                (
                    "kernelcache verify (no copy)",
                    best_of(args.repeat, lambda: kernelcache(*verify_args), nothing),
                ),
                (
                    "kernelcache verify --materialize",
                    best_of(
                        args.repeat,
                        lambda: kernelcache(*verify_args, "--materialize", str(dst)),
                        reset,
                    ),
                ),
            ]
        finally:
            shutil.rmtree(targets, ignore_errors=True)
    baseline = dict(rows)["baseline: cp -r + b3sum"]
    ours = dict(rows)["kernelcache verify --materialize"]
    print(
        f"{count} files, {total / 1e9:.2f} GB; {cores} cores; page cache warm, best of "
        f"{args.repeat}; copies in {args.target_dir or 'the store filesystem'}"
    )
    print(f"load average before {load_before}, after {load()}")
    print(f"{'':36} {'seconds':>8} {'GB/s':>6} {'x baseline':>10}")
    for name, seconds in rows:
        print(f"{name:36} {seconds:8.3f} {total / seconds / 1e9:6.2f} {seconds / baseline:10.2f}")
    ratio, rate = ours / baseline, total / ours / 1e9
    met = {True: "met", False: "NOT met"}
    print(f"verify --materialize / baseline: {ratio:.2f}x (target <= 1.2x: {met[ratio <= 1.2]})")
    print(f"verify --materialize throughput: {rate:.2f} GB/s (target >= 1 GB/s: {met[rate >= 1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
