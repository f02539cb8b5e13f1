"""Verify throughput against b3sum and sha256sum on the same files.

Builds a synthetic generation with a realistic file-size mix (many KB-size ``.o``/``.json``
kernels, some MB-size ``.so``/``.cubin`` modules), then times, side by side in one run and
with the page cache warm (each tool reads the files once before timing; best of N):

- ``b3sum`` and ``sha256sum`` over every file, pinned to one core, and b3sum on all cores;
- ``kernelcache.store.verify`` (every digest, sizes, unlisted files, path safety) pinned to
  one core with one worker, and on all cores;
- ``cp -r`` of the generation (one thread, hashing nothing) against verify + materialize as
  the init-container runs them (checks, then the one-pass copy: each file read once, hashed,
  written; a thread pool over runs of one directory's files), each into a fresh directory on
  the same filesystem; best of N, and the median of the round-by-round ratios.

Targets: verify on one core within 1.25x of ``b3sum`` on one core, and scaling with cores;
verify + materialize at most 0.9x of ``cp -r``. It needs kernelcache importable (the
installed package, or ``PYTHONPATH=src``), ``cp``, ``sha256sum`` and ``taskset``; ``b3sum``
is optional; nothing from the network. The first line printed names the date, the machine
and the load average, for the record in docs/BENCHMARKS.md.

    python bench/verify_throughput.py [--size-mb 1024] [--repeat 3] [--workers N]
        [--copy-to DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from synthetic import publish_generation

KEY = "bench/throughput/sm_90a"


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    fn()  # warm the page cache and any lazy imports
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_tool(cmd: list[str], files: list[str], cpus: str | None) -> None:
    prefix = ["taskset", "-c", cpus] if cpus else []
    subprocess.run(prefix + cmd + files, check=True, stdout=subprocess.DEVNULL)


def verify_pinned(gen: Path, workers: int, cpus: set[int] | None) -> None:
    """Verify in a child process pinned to ``cpus`` (affinity is per process)."""
    code = (
        "import os,sys; from pathlib import Path; from kernelcache.store import verify\n"
        f"os.sched_setaffinity(0, {cpus!r}) if {cpus!r} else None\n"
        f"r = verify(Path({str(gen)!r}), workers={workers}); sys.exit(0 if r.ok else 1)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def copy_tree(gen: Path, target: Path, key: str | None, workers: int) -> None:
    """``cp -r`` (key None) or verify + materialize (in a child, as the init-container)."""
    if key is None:
        subprocess.run(["cp", "-r", str(gen), str(target)], check=True)
        return
    code = (
        "from pathlib import Path; from kernelcache.store import materialize, verify\n"
        f"r = verify(Path({str(gen)!r}), key={key!r}, digests=False, workers={workers})\n"
        f"materialize(r, Path({str(target)!r}), workers={workers}, durable=False)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def children_cpu() -> float:
    """CPU seconds (user + system) of the children waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_copies(
    repeat: int, gen: Path, work: Path, workers: int
) -> dict[str | None, list[tuple[float, float]]]:
    """(seconds, CPU seconds) of ``cp -r`` (key None) and of verify + materialize over
    repeat rounds (after one untimed), taken in turns, each into an empty place after the
    previous copy's dirty pages were written back (untimed), so neither pays for the
    other's writeback."""
    times: dict[str | None, list[tuple[float, float]]] = {None: [], KEY: []}
    for _ in range(repeat + 1):
        for key in times:
            shutil.rmtree(work / "copy", ignore_errors=True)
            os.sync()
            cpu, start = children_cpu(), time.perf_counter()
            copy_tree(gen, work / "copy", key, workers)
            times[key].append((time.perf_counter() - start, children_cpu() - cpu))
    shutil.rmtree(work / "copy", ignore_errors=True)
    return {key: runs[1:] for key, runs in times.items()}


def machine(copies: Path) -> str:
    """What the numbers were taken on: CPU, usable cores, memory, the copies' filesystem."""
    model = "unknown CPU"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{model}, {len(os.sched_getaffinity(0))} of {os.cpu_count()} cores usable, "
        f"{memory:.0f} GiB, copies on {filesystem(copies)}"
    )


def filesystem(path: Path) -> str:
    """The type of the filesystem path lies on (the longest mount point above it)."""
    best, kind = "", "?"
    real = str(path.resolve())
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(
                best
            ):
                best, kind = point, fields[2]
    return kind


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--copy-to",
        type=Path,
        help="make the copies under this directory (e.g. a tmpfs, as an emptyDir of medium "
        "Memory; default: beside the store)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="materialize's threads (default: one per usable core)",
    )
    args = parser.parse_args()
    ncpu = len(os.sched_getaffinity(0))
    workers = args.workers or ncpu
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = load()
    with tempfile.TemporaryDirectory(prefix="kc-verify-bench-") as tmp:
        gen, count, total = publish_generation(Path(tmp), KEY, args.size_mb)
        files = sorted(str(p) for p in (gen / "files").rglob("*") if p.is_file())
        # In-process overhead of a child (interpreter start + import) is measured and removed.
        cpu_before = children_cpu()
        startup = best_of(
            args.repeat,
            lambda: subprocess.run([sys.executable, "-c", "import kernelcache.store"], check=True),
        )
        startup_cpu = (children_cpu() - cpu_before) / (args.repeat + 1)
        rows: list[tuple[str, float]] = []
        have_b3 = shutil.which("b3sum") is not None
        if have_b3:
            rows.append(
                (
                    "b3sum, 1 core",
                    best_of(
                        args.repeat, lambda: run_tool(["b3sum", "--num-threads", "1"], files, "0")
                    ),
                )
            )
        rows.append(
            ("sha256sum, 1 core", best_of(args.repeat, lambda: run_tool(["sha256sum"], files, "0")))
        )
        rows.append(
            (
                "kernelcache verify, 1 core",
                best_of(args.repeat, lambda: verify_pinned(gen, 1, {0})) - startup,
            )
        )
        if have_b3:
            rows.append(
                (
                    f"b3sum, {ncpu} cores",
                    best_of(args.repeat, lambda: run_tool(["b3sum"], files, None)),
                )
            )
        rows.append(
            (
                f"kernelcache verify, {ncpu} cores",
                best_of(args.repeat, lambda: verify_pinned(gen, ncpu, None)) - startup,
            )
        )
        work = Path(tempfile.mkdtemp(prefix="kc-copies-", dir=args.copy_to or tmp))
        where = machine(work)
        copies = timed_copies(args.repeat, gen, work, workers)
        cp_times, copy_times = [t for t, _ in copies[None]], [t for t, _ in copies[KEY]]
        cp, materialized = min(cp_times), min(copy_times) - startup
        cp_cpu = statistics.median(c for _, c in copies[None])
        copy_cpu = statistics.median(c for _, c in copies[KEY]) - startup_cpu
        rows.append(("cp -r, 1 thread, no hash", cp))
        shutil.rmtree(work, ignore_errors=True)
        rows.append((f"kernelcache verify + materialize, {workers} threads", materialized))
    print(f"{started}; {where}; load average {load_before} before, {load()} after")
    print(f"{count} files, {total / 1e9:.2f} GB (page cache warm, best of {args.repeat})")
    print(f"{'':32} {'seconds':>8} {'GB/s':>7}")
    for name, seconds in rows:
        print(f"{name:32} {seconds:8.3f} {total / seconds / 1e9:7.2f}")
    by_name = dict(rows)
    if have_b3:
        one = by_name["kernelcache verify, 1 core"] / by_name["b3sum, 1 core"]
        print(f"verify / b3sum on one core: {one:.2f}x (target <= 1.25x)")
    scale = by_name["kernelcache verify, 1 core"] / by_name[f"kernelcache verify, {ncpu} cores"]
    print(f"verify scaling 1 -> {ncpu} cores: {scale:.2f}x")
    ratio = materialized / cp
    print(f"verify + materialize / cp -r: {ratio:.2f}x (target <= 0.9x)")
    rounds = sorted((m - startup) / c for m, c in zip(copy_times, cp_times, strict=True))
    print(
        f"  round by round (each against the cp -r just before it): median "
        f"{statistics.median(rounds):.2f}x, {' '.join(f'{r:.2f}' for r in rounds)}"
    )
    print(
        f"  with the interpreter's start-up ({startup:.3f} s): {(materialized + startup) / cp:.2f}x"
    )
    print(
        f"  CPU (user + system, median): cp -r {cp_cpu:.3f} s, verify + materialize "
        f"{copy_cpu:.3f} s ({copy_cpu / cp_cpu:.2f}x; start-up's {startup_cpu:.3f} s removed): "
        f"0.9x of cp -r needs {copy_cpu / cp_cpu / 0.9:.1f} cores busy on the copy for cp's one"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
