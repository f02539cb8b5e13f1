"""Concurrency and load: eight builder processes of one key, and of eight keys, in one store;
the serving runtime's counters fed from many threads at once.

The builders are real processes (the ``kernelcache warm`` CLI, or tests/helpers/store_worker.py)
that finish their imports and then wait for a go file, so that they reach the store together.
The runtime's counters are read from its Prometheus registry, as a scrape would.
"""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kernelcache.runtime import metrics
from kernelcache.store import Store
from kernelcache.toolchains import cute_dsl
from tests.conftest import DEMO_WORKLOAD as WORKLOAD
from tests.conftest import needs_cute, scaled, subprocess_env, write_warmer_spec
from tests.helpers.stores import (
    assert_every_generation_verifies,
    start_worker,
    transient,
    wait_for,
)

BUILDERS = 8
THREADS = 16
EVENTS_PER_THREAD = 2_000
ARCH = "sm_90a"

T = TypeVar("T")

# The real CLI, imports done before the go file (argv[1]) appears; then `kernelcache argv[2:]`.
CLI_AFTER_GO = """
import pathlib, sys, time
from kernelcache import build, cli
print("ready", flush=True)
while not pathlib.Path(sys.argv[1]).exists():
    time.sleep(0.001)
sys.exit(cli.main(sys.argv[2:]))
"""


def command_warmer(content: str) -> dict[str, Any]:
    """A `command` warmer that writes the same bytes on every run."""
    script = (
        "import os, pathlib; "
        "out = pathlib.Path(os.environ['TRITON_CACHE_DIR'], 'k.bin'); "
        f"out.write_bytes({content!r}.encode() * 10_000)"
    )
    return {"type": "command", "command": [sys.executable, "-c", script]}


def run_together(go: Path, commands: list[list[str]]) -> list[str]:
    """Start every command, release them at once with the go file; their stdout, in order."""
    procs = [
        subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for cmd in commands
    ]
    for proc in procs:
        wait_for(proc, b"ready\n")
    go.touch()
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=scaled(300))
        assert proc.returncode == 0, err.decode()
        outputs.append(out.decode())
    return outputs


def warm_together(go: Path, store: Store, specs: list[Path], *flags: str) -> list[tuple[str, str]]:
    """`kernelcache warm` of each spec, all at once; (status, generation) of each."""
    store_args = ["--store", str(store.root), "--arch", ARCH]
    commands = [
        [sys.executable, "-c", CLI_AFTER_GO, str(go), "warm", "-f", str(spec), *store_args, *flags]
        for spec in specs
    ]
    results = []
    for out in run_together(go, commands):
        # "sm_90a: published generation 2c2f7a63… (1 files)"
        _, status, _, generation, *_ = out.split()
        results.append((status, generation))
    return results


def generation_dirs(store: Store, key: str) -> list[str]:
    key_dir = store.key_dir(key)
    return sorted(p.name for p in key_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def assert_one_verified_generation(store: Store, key: str) -> str:
    """The key holds exactly one generation, CURRENT, that verifies, and nothing transient."""
    current = assert_every_generation_verifies(store, key, key)
    assert generation_dirs(store, key) == [current]
    assert transient(store.key_dir(key)) == []
    return current


# --------------------------------------------------------------------------- builder processes


@pytest.mark.parametrize(
    ("flags", "statuses"),
    [
        ((), {"published": 1, "up-to-date": BUILDERS - 1}),
        (("--force",), {"published": BUILDERS}),
    ],
    ids=["up-to-date-check", "force"],
)
def test_eight_warm_commands_of_one_key_publish_one_generation(
    tmp_path: Path, flags: tuple[str, ...], statuses: dict[str, int]
) -> None:
    """The first builder to get the lock publishes; the others find the stamp already current
    or, forced, publish the same content, which the store keeps as the same generation."""
    spec = write_warmer_spec(tmp_path, command_warmer("same"))
    store = Store(tmp_path / "store")

    results = warm_together(tmp_path / "go", store, [spec] * BUILDERS, *flags)

    assert Counter(status for status, _ in results) == statuses
    current = assert_one_verified_generation(store, f"default/kc/{ARCH}")
    assert {generation for _, generation in results} == {current}


def test_eight_warm_commands_of_eight_keys_in_one_store(tmp_path: Path) -> None:
    """Eight keys built at once in one store (their parent directories created in a race):
    each ends with its own one generation."""
    store = Store(tmp_path / "store")
    specs = []
    for i in range(BUILDERS):
        (tmp_path / f"spec{i}").mkdir()
        specs.append(
            write_warmer_spec(tmp_path / f"spec{i}", command_warmer(f"k{i}"), name=f"kc{i}")
        )

    results = warm_together(tmp_path / "go", store, specs)

    keys = [f"default/kc{i}/{ARCH}" for i in range(BUILDERS)]
    assert store.keys() == sorted(keys)
    for key, (status, generation) in zip(keys, results, strict=True):
        assert status == "published"
        assert assert_one_verified_generation(store, key) == generation


def test_eight_publishers_of_two_contents_on_one_key_serialise_and_dedup(tmp_path: Path) -> None:
    """Eight store writers, four for each of two contents: the lock lets one in at a time,
    and each content is one generation however often it is published."""
    store, key = Store(tmp_path / "store"), "race/model/sm_90a"
    go = tmp_path / "go"
    seeds = [("a", "b")[i % 2] for i in range(BUILDERS)]
    procs = [start_worker("once", store.root, key, seed, go) for seed in seeds]
    for proc in procs:
        wait_for(proc, b"ready\n")
    go.touch()
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=scaled(120))
        assert proc.returncode == 0, err.decode()
        runs.append(json.loads(out))

    by_seed = {
        seed: {r["generation"] for s, r in zip(seeds, runs, strict=True) if s == seed}
        for seed in "ab"
    }
    assert all(len(ids) == 1 for ids in by_seed.values()) and by_seed["a"] != by_seed["b"], by_seed
    ordered = sorted(runs, key=lambda r: r["acquired"])
    for earlier, later in itertools.pairwise(ordered):
        assert earlier["released"] <= later["acquired"], "two writers held the lock at once"
    current = assert_every_generation_verifies(store, key, key)
    assert current == ordered[-1]["generation"]
    assert generation_dirs(store, key) == sorted(by_seed["a"] | by_seed["b"])
    assert transient(store.key_dir(key)) == []


# --------------------------------------------------------------------------- runtime counters


def run_threads(count: int, work: Callable[[int], T]) -> list[T]:
    """work(0), …, work(count - 1), each on its own thread, all released at once.

    The interpreter switches threads every microsecond meanwhile (not every 5 ms), so that a
    read-modify-write without a lock is interrupted often enough to lose updates.
    """
    barrier = threading.Barrier(count)

    def released(index: int) -> T:
        barrier.wait(timeout=scaled(60))
        return work(index)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(max_workers=count) as pool:
            return list(pool.map(released, range(count)))
    finally:
        sys.setswitchinterval(interval)


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def thread_events(thread: int) -> list[tuple[str, str, str]]:
    """(kind, toolchain, kernel) of each event one thread records: compiles, refused
    compiles and hits, on every toolchain and a few kernels that all threads share."""
    kinds = ("compile", "refused", "hit")
    return [
        (
            kinds[i % 3],
            metrics.TOOLCHAINS[(thread + i) % len(metrics.TOOLCHAINS)],
            f"threaded-{i % 5}",
        )
        for i in range(EVENTS_PER_THREAD)
    ]


def moved_samples(kind: str, toolchain: str, kernel: str) -> list[tuple[str, str, str]]:
    """The samples one event adds 1 to, as (name, toolchain, kernel or "")."""
    if kind == "hit":
        return [("kernelcache_cache_hits_total", toolchain, "")]
    moved = [("kernelcache_cold_compiles_total", toolchain, kernel)]
    if kind == "compile":
        moved.append(("kernelcache_compile_seconds_count", toolchain, ""))
    return moved


def read_samples(keys: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], float]:
    return {
        (name, toolchain, kernel): sample(
            name, toolchain=toolchain, **({"kernel": kernel} if kernel else {})
        )
        for name, toolchain, kernel in keys
    }


@pytest.fixture
def quiet_runtime_log(caplog: pytest.LogCaptureFixture) -> None:
    """Each compile in serving logs a warning: tens of thousands of them here."""
    caplog.set_level(logging.ERROR, logger="kernelcache")


@pytest.mark.usefixtures("quiet_runtime_log")
def test_compile_and_hit_counters_lose_no_event_from_sixteen_threads() -> None:
    expected = Counter(
        moved
        for t in range(THREADS)
        for event in thread_events(t)
        for moved in moved_samples(*event)
    )
    before = read_samples(list(expected))

    def record(thread: int) -> None:
        for kind, toolchain, kernel in thread_events(thread):
            if kind == "hit":
                metrics.record_hit(toolchain)
            else:
                metrics.record_compile(toolchain, kernel, 0.3 if kind == "compile" else None)

    run_threads(THREADS, record)

    after = read_samples(list(expected))
    assert {key: after[key] - before[key] for key in expected} == expected


REFUSED_PER_THREAD = 4  # each is a real trace: the DSL's, one at a time


@needs_cute
@pytest.mark.usefixtures("quiet_runtime_log")
def test_disk_layer_counts_every_refusal_from_sixteen_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CuTe-DSL disk layer in strict mode, from sixteen threads: each call traces a kernel
    the cache does not hold and is refused before compiling; every refusal shows in the
    runtime's cold-compile counter."""
    import demo_kernels

    from kernelcache.runtime import cute

    monkeypatch.setattr(cute, "on_event", cute_dsl.on_event)
    cache = cute.CuteDiskCache(tmp_path, strict=True)
    _, fn, args = next(iter(demo_kernels.specializations(WORKLOAD)))
    name = "demo_kernels:add"
    before = sample("kernelcache_cold_compiles_total", toolchain="cute-dsl", kernel=name)

    def call(thread: int) -> int:
        refused = 0
        for _ in range(REFUSED_PER_THREAD):
            try:
                cache.compile(fn, *args)
            except cute.ColdCompileError:
                refused += 1
        return refused

    refusals = run_threads(THREADS, call)

    calls = THREADS * REFUSED_PER_THREAD
    assert sum(refusals) == calls
    assert (cache.stats.misses, cache.stats.hits) == (0, 0)
    counted = sample("kernelcache_cold_compiles_total", toolchain="cute-dsl", kernel=name)
    assert counted - before == calls


@needs_cute
def test_eight_threads_on_one_missing_kernel_compile_it_once_and_load_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight threads ask for one kernel: one real compile, counted once. A fresh cache on the
    same directory (the next process) asked by eight threads: one load, counted once."""
    import demo_kernels

    from kernelcache.runtime import cute

    monkeypatch.setattr(cute, "on_event", cute_dsl.on_event)
    _, fn, args = next(iter(demo_kernels.specializations(WORKLOAD)))
    name = "demo_kernels:add"

    def counts() -> tuple[float, float]:
        """(cold compiles of the kernel, cache hits) as the runtime exports them."""
        return (
            sample("kernelcache_cold_compiles_total", toolchain="cute-dsl", kernel=name),
            sample("kernelcache_cache_hits_total", toolchain="cute-dsl"),
        )

    def from_eight_threads() -> tuple[tuple[int, int], tuple[float, ...]]:
        """(misses, hits) of a fresh cache asked by eight threads, and the counters' growth."""
        cache = cute.CuteDiskCache(tmp_path)
        before = counts()
        compiled = run_threads(BUILDERS, lambda _: cache.compile(fn, *args))
        assert all(c is compiled[0] for c in compiled)
        grown = tuple(a - b for a, b in zip(counts(), before, strict=True))
        return (cache.stats.misses, cache.stats.hits), grown

    assert from_eight_threads() == ((1, 0), (1, 0))  # compiled once, one cold compile
    assert from_eight_threads() == ((0, 1), (0, 1))  # loaded once, one hit
    assert len(list(tmp_path.glob("*.o"))) == 1
