"""Fault injection against kernelcache.store with real faults, no mocks: a publisher killed
with SIGKILL at random points, a full filesystem, a file-size limit, two writers racing for
one key, and a lock holder that dies. The store must always leave CURRENT naming a complete
generation that verifies, and the next writer must clean up whatever a dead one left."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelcache.errors import ExitCode, LockedError, StorageError
from kernelcache.store import MANIFEST_NAME, Store, verify

WORKER = Path(__file__).parent / "helpers" / "store_worker.py"
KEY = "faults/model/sm_90a"
STAMP = {"digest": "blake3:seed", "compile_digest": "c", "factors": {}, "factor_digests": {}}
TRANSIENT = (".staging-", ".trash-", ".CURRENT.")


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


def kill9(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()


def transient(key_dir: Path) -> list[str]:
    return sorted(n for n in os.listdir(key_dir) if n.startswith(TRANSIENT))


def seed_generation(store: Store, size: int = 50_000) -> str:
    with store.writer(KEY) as writer:
        staging = writer.staging()
        (staging / "triton").mkdir()
        (staging / "triton" / "seed.cubin").write_bytes(random.Random(0).randbytes(size))
        return writer.publish(staging, STAMP, {}).generation


def assert_current_intact(store: Store, expected: str | None = None) -> str:
    gen_dir = store.current(KEY)
    assert gen_dir is not None
    result = verify(gen_dir)
    assert result.ok, result.problems
    if expected is not None:
        assert gen_dir.name == expected
    return gen_dir.name


def assert_next_writer_cleans_up(store: Store) -> None:
    with store.writer(KEY, timeout=5):
        assert transient(store.key_dir(KEY)) == []


# --------------------------------------------------------------------------- kill -9


def test_sigkill_at_random_points_never_exposes_a_partial_generation(tmp_path: Path) -> None:
    rng = random.Random(1234)
    store = Store(tmp_path / "store")
    seed_generation(store)  # so CURRENT must exist after every kill
    key_dir = store.key_dir(KEY)
    currents = set()
    kills_with_leftovers = 0

    for round_ in range(50):
        proc = start_worker("loop", store.root, KEY, f"r{round_}")
        wait_for(proc, b"ready\n")
        time.sleep(rng.uniform(0, 0.3))
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        kill9(proc)

        currents.add(assert_current_intact(store))
        for manifest in store.generations(KEY):  # every generation, not just CURRENT's
            assert verify(key_dir / manifest.generation).ok
        if transient(key_dir):
            kills_with_leftovers += 1
        assert_next_writer_cleans_up(store)

    # The kills did land mid-publish, and publishes did complete between them.
    assert kills_with_leftovers >= 10, kills_with_leftovers
    assert len(currents) >= 10, len(currents)


# --------------------------------------------------------------------------- full disk


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,nr_inodes=2000", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): RLIMIT_FSIZE covers it")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_full_disk_while_copying_in(tiny_tmpfs: Path, tmp_path: Path) -> None:
    store = Store(tiny_tmpfs / "store")
    before = seed_generation(store)
    src = tmp_path / "built"
    (src / "cute").mkdir(parents=True)
    (src / "cute" / "small.o").write_bytes(b"s" * 1000)
    (src / "cute" / "huge.o").write_bytes(random.Random(1).randbytes(3_000_000))

    with store.writer(KEY) as writer, pytest.raises(StorageError) as err:
        writer.publish(src, {**STAMP, "digest": "blake3:new"}, {})

    message = str(err.value)
    assert "ENOSPC" in message and "huge.o" in message and "\n" not in message
    assert_current_intact(store, before)
    assert transient(store.key_dir(KEY)) == []
    assert_next_writer_cleans_up(store)


def test_full_disk_while_writing_the_manifest(tiny_tmpfs: Path) -> None:
    store = Store(tiny_tmpfs / "store")
    before = seed_generation(store)

    with store.writer(KEY) as writer:
        staging = writer.staging()
        with pytest.raises(OSError), (staging / "filler.bin").open("wb") as f:
            f.write(bytes(4_000_000))  # fill the filesystem to the last page
        with pytest.raises(StorageError) as err:
            writer.publish(staging, {**STAMP, "digest": "blake3:new"}, {})

    message = str(err.value)
    assert "ENOSPC" in message and MANIFEST_NAME in message and "\n" not in message
    assert_current_intact(store, before)
    assert_next_writer_cleans_up(store)
    # The space came back: the next publish goes through.
    with store.writer(KEY) as writer:
        staging = writer.staging()
        (staging / "ok.bin").write_bytes(b"ok")
        after = writer.publish(staging, {**STAMP, "digest": "blake3:after"}, {}).generation
    assert_current_intact(store, after)


def test_no_room_for_current_takes_back_the_new_generation(tiny_tmpfs: Path) -> None:
    """The last step that needs space is CURRENT's temporary file: with no inode left for
    it, the already renamed new generation is removed again and CURRENT stays."""
    store = Store(tiny_tmpfs / "store")
    before = seed_generation(store)
    filler = tiny_tmpfs / "filler"
    filler.mkdir()

    with store.writer(KEY) as writer:
        staging = writer.staging()
        (staging / "new.bin").write_bytes(b"new")
        for i in range(os.statvfs(tiny_tmpfs).f_ffree - 1):  # one inode left: MANIFEST.json's
            (filler / str(i)).touch()
        with pytest.raises(StorageError) as err:
            writer.publish(staging, {**STAMP, "digest": "blake3:new"}, {})

    message = str(err.value)
    assert "ENOSPC" in message and ".CURRENT." in message and "\n" not in message
    assert_current_intact(store, before)
    assert [m.generation for m in store.generations(KEY)] == [before]
    assert_next_writer_cleans_up(store)


def test_file_size_limit_fails_cleanly(tmp_path: Path) -> None:
    """The variant that needs no mount: RLIMIT_FSIZE makes writes fail with EFBIG."""
    store = Store(tmp_path / "store")
    before = seed_generation(store)
    src = tmp_path / "built"
    (src / "triton").mkdir(parents=True)
    (src / "triton" / "a.cubin").write_bytes(b"a" * 1000)
    (src / "triton" / "big.cubin").write_bytes(random.Random(2).randbytes(256 * 1024))

    proc = start_worker("fsize", store.root, KEY, src, str(64 * 1024))
    out, err = proc.communicate(timeout=60)

    assert out == b"ready\n"
    assert proc.returncode == ExitCode.IO, err.decode()
    lines = err.decode().splitlines()
    assert len(lines) == 1 and "EFBIG" in lines[0] and "big.cubin" in lines[0], lines
    assert_current_intact(store, before)
    assert transient(store.key_dir(KEY)) == []
    assert_next_writer_cleans_up(store)


# --------------------------------------------------------------------------- concurrency


def test_two_writers_racing_for_a_key_serialise(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    for round_ in range(3):
        go = tmp_path / f"go-{round_}"
        procs = [start_worker("once", store.root, KEY, f"{round_}-{w}", go) for w in "ab"]
        for proc in procs:
            wait_for(proc, b"ready\n")
        go.touch()
        runs = []
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err.decode()
            runs.append(json.loads(out))

        first, second = sorted(runs, key=lambda r: r["acquired"])
        assert first["released"] <= second["acquired"], "both writers held the lock at once"
        assert first["generation"] != second["generation"]
        assert assert_current_intact(store) == second["generation"]
        for run in runs:
            assert verify(store.key_dir(KEY) / run["generation"]).ok
        assert transient(store.key_dir(KEY)) == []


def test_lock_timeout_names_the_holder_and_readers_go_on(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    before = seed_generation(store)
    holder = start_worker("hold", store.root, KEY)
    try:
        wait_for(holder, b"locked\n")
        started = time.monotonic()
        with pytest.raises(LockedError) as err, store.writer(KEY, timeout=0.2):
            pass
        waited = time.monotonic() - started
        assert 0.2 <= waited < 2, waited
        assert f"pid {holder.pid} " in str(err.value)
        assert err.value.code == ExitCode.LOCKED
        assert_current_intact(store, before)  # readers never wait for the lock
    finally:
        kill9(holder)


def test_a_killed_lock_holder_does_not_block_the_next_writer(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    before = seed_generation(store)
    holder = start_worker("hold", store.root, KEY)
    wait_for(holder, b"locked\n")
    assert transient(store.key_dir(KEY)) != []  # it staged a file before dying
    kill9(holder)

    started = time.monotonic()
    with store.writer(KEY, timeout=0):
        acquired = time.monotonic() - started
        assert transient(store.key_dir(KEY)) == []
    assert acquired < 0.5, acquired
    assert_current_intact(store, before)
