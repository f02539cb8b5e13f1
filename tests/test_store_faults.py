"""Fault injection against kernelcache.store with real faults, no mocks: a publisher killed
with SIGKILL at over 500 seeded random points (before a step of publishing, after a delay,
and the real ``kernelcache warm``/``build`` commands: the ``*_KILLS`` constants), a re-point
of CURRENT killed before each of its steps, a warm process killed while its warmer lives
on, a full filesystem, a file-size limit, and a lock holder that dies. The store must
always leave CURRENT naming a complete generation that verifies, and the next writer must
clean up whatever a dead one left. Writers racing for a key: tests/test_concurrency.py."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import pytest

from kernelcache.errors import ExitCode, LockedError, StorageError
from kernelcache.store import MANIFEST_NAME, FileEntry, Store, generation_id, verify
from tests.conftest import scaled, subprocess_env, write_warmer_spec
from tests.helpers.store_worker import PHASES, REPOINT_PHASES, publish_random, stamp_for
from tests.helpers.stores import (
    WORKER,
    assert_every_generation_verifies,
    start_worker,
    transient,
    wait_for,
)

KEY = "faults/model/sm_90a"
STAMP = {"digest": "blake3:seed", "compile_digest": "c", "factors": {}, "factor_digests": {}}


def kill9(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()


def seed_generation(store: Store, size: int = 50_000, key: str = KEY) -> str:
    with store.writer(key, timeout=5) as writer:  # the lock is free: fail, never hang
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


def assert_next_writer_cleans_up(store: Store, key: str = KEY, where: str = "") -> None:
    with store.writer(key, timeout=5):
        assert transient(store.key_dir(key)) == [], where


# --------------------------------------------------------------------------- kill -9

KILL_SEED = 1234
STEP_KILLS = 400  # the publisher SIGKILLs itself just before a seeded random step
TIMED_KILLS = 150  # the test SIGKILLs it after a seeded random delay: lands mid-operation
CLI_KILLS = 30  # SIGKILL to a `kernelcache warm` or `kernelcache build` process group
# 580 kill points in all (the reliability target is at least 500).
MAX_KILL_STEP = 270  # a publish cycle of store_worker.py takes about 90 steps
MAX_KILL_DELAY = 0.1  # seconds: a few publish cycles


class Publishers:
    """``store_worker.py serve``: one looping publisher forked per kill, imports paid once."""

    def __init__(self, store: Store, tmp_path: Path, mode: str = "publish") -> None:
        self.trace = tmp_path / "trace"
        self._stderr = tmp_path / "publishers.stderr"
        with self._stderr.open("wb") as stderr:
            self._proc = subprocess.Popen(
                [sys.executable, str(WORKER), "serve", str(store.root), KEY, str(self.trace), mode],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        assert self._read() == "ready"

    def run_until_killed(self, seed: str, kill_at: int = 0, delay: float = 0.0) -> str:
        """Fork a publisher; kill_at > 0: it SIGKILLs itself before that step, else the test
        SIGKILLs it after delay seconds. Returns the phase it died in."""
        pid = int(self._ask(f"{seed} {kill_at}"))
        if not kill_at:
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)  # a zombie until reaped: the pid is still this child's
        status = int(self._ask("reap"))
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            pytest.fail(f"publisher {seed} ended by itself ({status}): {self._stderr_tail()}")
        return self.trace.read_text().strip()

    def run_to_step(self, seed: str, kill_at: int) -> tuple[bool, str]:
        """Fork a child that SIGKILLs itself before step kill_at; (killed, its last phase).
        A child that finishes first must exit 0."""
        self._ask(f"{seed} {kill_at}")
        status = int(self._ask("reap"))
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        if not killed and not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            pytest.fail(f"child {seed} failed ({status}): {self._stderr_tail()}")
        return killed, self.trace.read_text().strip()

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=scaled(60))

    def _ask(self, line: str) -> str:
        assert self._proc.stdin is not None
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()
        return self._read()

    def _read(self) -> str:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            pytest.fail(f"store_worker.py serve exited: {self._stderr_tail()}")
        return line.strip()

    def _stderr_tail(self) -> str:
        return self._stderr.read_text()[-2000:]


@dataclass
class KillTally:
    """Where the kills landed, to show that they hit every part of a publish."""

    phases: Counter[str] = field(default_factory=Counter)
    currents: set[str] = field(default_factory=set)
    with_leftovers: int = 0


@pytest.fixture
def publishers(tmp_path: Path) -> Iterator[tuple[Store, Publishers]]:
    store = Store(tmp_path / "store")
    seed_generation(store)  # so CURRENT must exist after every kill
    workers = Publishers(store, tmp_path)
    yield store, workers
    workers.close()


def kill_publishers(
    store: Store, workers: Publishers, kills: int, seed: int, kill_at_step: bool
) -> KillTally:
    """Kill a fresh publisher `kills` times, checking the store after each kill."""
    rng = random.Random(seed)
    tally = KillTally()
    for round_ in range(kills):
        if kill_at_step:
            kill_at, delay = rng.randint(1, MAX_KILL_STEP), 0.0
            where = f"seed {seed}, round {round_}: killed before step {kill_at}"
        else:
            kill_at, delay = 0, rng.uniform(0, MAX_KILL_DELAY)
            where = f"seed {seed}, round {round_}: killed after {delay:.4f} s"
        phase = workers.run_until_killed(f"r{round_}", kill_at, delay)
        tally.phases[phase] += 1
        tally.currents.add(assert_every_generation_verifies(store, KEY, f"{where} in {phase}"))
        tally.with_leftovers += bool(transient(store.key_dir(KEY)))
        # Every other time the leftovers are left to the next publisher, so that kills also
        # land in its clean-up.
        if round_ % 2 == 0:
            assert_next_writer_cleans_up(store, where=where)
    return tally


@pytest.mark.slow
def test_sigkill_before_seeded_steps_never_exposes_a_partial_generation(
    publishers: tuple[Store, Publishers],
) -> None:
    """Each publisher SIGKILLs itself just before a seeded random step of publishing (a file
    written, digested or fsynced, a manifest, a rename, the CURRENT swap, a removal), so the
    crash point of every round reproduces from the seed."""
    tally = kill_publishers(*publishers, STEP_KILLS, KILL_SEED, kill_at_step=True)
    assert set(tally.phases) == set(PHASES), tally
    assert tally.with_leftovers >= STEP_KILLS // 10, tally
    assert len(tally.currents) >= STEP_KILLS // 10, tally


@pytest.mark.slow
def test_sigkill_after_seeded_delays_never_exposes_a_partial_generation(
    publishers: tuple[Store, Publishers],
) -> None:
    """Kills from outside, after a seeded random delay: these land inside a write, an fsync
    or a tree removal, where a kill before a step cannot. Where they land depends on how fast
    this machine publishes, so what is asserted is what every kill must leave, wherever it
    landed (``kill_publishers``: every generation verifies, CURRENT names one, the next
    writer cleans up), not how many publishes a delay let through; the tally is printed."""
    tally = kill_publishers(*publishers, TIMED_KILLS, KILL_SEED + 1, kill_at_step=False)
    assert sum(tally.phases.values()) == TIMED_KILLS, tally  # every kill checked
    print(
        f"\ntimed kills: {dict(tally.phases)}, {len(tally.currents)} generations current, "
        f"{tally.with_leftovers} leaving leftovers"
    )


@pytest.mark.slow
def test_sigkill_at_every_step_of_a_repoint_leaves_the_previous_current(tmp_path: Path) -> None:
    """Making a kept generation current again (a reverted spec), killed before each of its
    steps in turn until one run finishes: until the CURRENT swap, CURRENT still names the
    previous generation, after it the kept one, and every generation verifies each time."""
    store = Store(tmp_path / "store")
    with store.writer(KEY) as writer:
        kept, dropped, previous = (publish_random(writer, seed) for seed in ("a", "b", "c"))
    workers = Publishers(store, tmp_path, mode="repoint")
    phases: Counter[str] = Counter()
    try:
        for kill_at in range(1, 500):
            with store.writer(KEY) as writer:  # back to c current, b kept (keep=1 drops it)
                publish_random(writer, "b")
                assert writer.make_current_again(str(stamp_for("c")["digest"]), keep=5)
            killed, phase = workers.run_to_step("a", kill_at)
            where = f"killed before step {kill_at}, in {phase}"
            current = assert_every_generation_verifies(store, KEY, where)
            if not killed:
                assert current == kept, where
                break
            phases[phase] += 1
            if phase in ("lock", "verify", "history"):
                assert current == previous, where
            elif phase == "current":
                assert current in (previous, kept), where
            else:
                assert current == kept, where
            assert_next_writer_cleans_up(store, where=where)
        else:
            pytest.fail(f"a re-point never finished: {phases}")
    finally:
        workers.close()
    assert set(phases) == set(REPOINT_PHASES), phases
    print(f"\nre-point: killed before each of its {sum(phases.values())} steps: {dict(phases)}")
    assert not (store.key_dir(KEY) / dropped).exists()  # collected: keep=1 besides the kept


# A `command` warmer: says it started, then writes 2 MB derived from ROUND_SEED.
WARM_SCRIPT = """
import os, pathlib, random
pathlib.Path(os.environ["WARM_STARTED"]).touch()
rng = random.Random(os.environ["ROUND_SEED"])
for i in range(8):
    pathlib.Path(os.environ["TRITON_CACHE_DIR"], f"k{i}.bin").write_bytes(rng.randbytes(250_000))
"""


def warmed_generation_id(stamp_digest: str, seed: str) -> str:
    """The id WARM_SCRIPT's files for seed get under stamp_digest."""
    rng = random.Random(seed)
    entries = []
    for i in range(8):
        data = rng.randbytes(250_000)
        digest = "blake3:" + blake3.blake3(data).hexdigest()
        entries.append(FileEntry(f"triton/k{i}.bin", len(data), digest))
    return generation_id(stamp_digest, entries)


def start_cli(command: str, spec: Path, store: Store, seed: str, started: Path) -> subprocess.Popen:
    """The real CLI in its own process group, as a Job's container runs it."""
    started.unlink(missing_ok=True)
    args = [command, "-f", str(spec), "--store", str(store.root), "--arch", "sm_90a", "--force"]
    return subprocess.Popen(
        [sys.executable, "-m", "kernelcache", *args],
        env=subprocess_env(ROUND_SEED=seed, WARM_STARTED=str(started)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def wait_until_warming(proc: subprocess.Popen, started: Path) -> float:
    """Block until the warmer runs (the CLI then holds the key's lock); returns that moment."""
    while not started.exists():
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} before warming: {proc.stderr.read()}")
        time.sleep(0.002)
    return time.monotonic()


@pytest.mark.slow
def test_sigkill_of_the_warm_and_build_commands_keeps_a_verified_current(tmp_path: Path) -> None:
    """SIGKILL to the whole process group of ``kernelcache warm`` or ``kernelcache build``
    (as a Job's container is killed, warmer included) at a seeded random moment from the
    warmer's start to a little past the end. CURRENT stays the previous generation or is
    the new one, complete: never anything else."""
    spec = write_warmer_spec(
        tmp_path, {"type": "command", "command": [sys.executable, "-c", WARM_SCRIPT]}
    )
    store, key = Store(tmp_path / "store"), "default/kc/sm_90a"
    started = tmp_path / "warming"
    # From the warmer's start to the CURRENT swap, the shorter of two runs: the first also
    # pays a cold start (byte-compiling, caches), so a span of its own alone would let most
    # kills land after the command finished.
    spans = []
    for name in ("first", "second"):
        current_file = store.key_dir(key) / "CURRENT"
        before = current_file.read_bytes() if current_file.exists() else b""
        run = start_cli("warm", spec, store, name, started)
        since = wait_until_warming(run, started)
        while run.poll() is None and (
            not current_file.exists() or current_file.read_bytes() == before
        ):
            time.sleep(0.001)
        spans.append(time.monotonic() - since)
        _, err = run.communicate(timeout=scaled(120))
        assert run.returncode == 0, err
    span = min(spans)
    previous = assert_every_generation_verifies(store, key, "first runs")
    stamp_digest = store.current_manifest(key).stamp["digest"]

    rng = random.Random(KILL_SEED + 2)
    outcomes: Counter[str] = Counter()
    for round_ in range(CLI_KILLS):
        command = ("warm", "build")[round_ % 2]
        fraction = rng.uniform(0, 1.5)
        where = f"seed {KILL_SEED + 2}, round {round_}: {command} killed {fraction:.3f} spans in"
        proc = start_cli(command, spec, store, f"r{round_}", started)
        wait_until_warming(proc, started)
        time.sleep(fraction * span)
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=scaled(60))
        assert proc.returncode in (0, -signal.SIGKILL), f"{where}: {err}"

        current = assert_every_generation_verifies(store, key, where)
        new = warmed_generation_id(stamp_digest, f"r{round_}")
        assert current in (previous, new), where
        if proc.returncode == 0:
            outcome = "finished"
        else:
            outcome = "killed after the swap" if current == new else "killed before the swap"
        outcomes[outcome] += 1
        outcomes["left leftovers"] += bool(transient(store.key_dir(key)))
        assert_next_writer_cleans_up(store, key, where)
        previous = current

    assert outcomes["killed before the swap"] >= CLI_KILLS // 5, outcomes
    assert outcomes["left leftovers"] >= CLI_KILLS // 5, outcomes


# A `command` warmer that writes on and on, re-creating its directory as cache managers do;
# it names its pid once it has written a thousand files.
ENDLESS_WARMER = """
import os, pathlib
out = pathlib.Path(os.environ["TRITON_CACHE_DIR"], "kernels")
started = pathlib.Path(os.environ["WARM_STARTED"])
for i in range(10**9):
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"k{i}.bin").write_bytes(b"k" * 100)
    except FileNotFoundError:
        pass
    if i == 1000:
        started.with_suffix(".tmp").write_text(str(os.getpid()))
        started.with_suffix(".tmp").rename(started)
"""


def wait_until_dead(pid: int) -> None:
    """Until pid runs no more code (exited, or a zombie that nothing reaped yet)."""
    stat = Path(f"/proc/{pid}/stat")
    while True:
        try:
            state = stat.read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)


def test_a_warm_process_killed_alone_does_not_block_the_next_writer(tmp_path: Path) -> None:
    """SIGKILL to the `kernelcache warm` process only: its command warmer lives on as an
    orphan, still writing into the dead writer's staging directory, which the next writer
    then cannot remove. That writer must publish all the same; one after the orphan is gone
    removes what is left."""
    spec = write_warmer_spec(
        tmp_path, {"type": "command", "command": [sys.executable, "-c", ENDLESS_WARMER]}
    )
    store, key = Store(tmp_path / "store"), "default/kc/sm_90a"
    started = tmp_path / "warming"
    proc = start_cli("warm", spec, store, "orphaned", started)
    orphan = None
    try:
        wait_until_warming(proc, started)
        orphan = int(started.read_text())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=scaled(60))  # not communicate(): the orphan holds its stderr open
        assert transient(store.key_dir(key)) != []

        generation = seed_generation(store, key=key)

        assert assert_every_generation_verifies(store, key, "after the kill") == generation
    finally:
        # The command warmer runs in a session of its own (so that a deadline kills all it
        # started): the CLI's process group does not hold it, so its own group is killed.
        # Left alone it would write until the disk is full.
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if orphan is not None:
            with suppress(ProcessLookupError):
                os.killpg(orphan, signal.SIGKILL)
        proc.communicate(timeout=scaled(60))
    assert orphan is not None
    wait_until_dead(orphan)
    assert_next_writer_cleans_up(store, key)


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
    # Files are copied concurrently: whichever write met the full disk is the one named.
    assert "ENOSPC" in message and "\n" not in message
    assert message.split(": ")[0].endswith(("cute/huge.o", "cute/small.o")), message
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
    """The last step that needs space is CURRENT's temporary file (after HISTORY.json's):
    with no inode left for it, the already renamed new generation is removed again and
    CURRENT stays."""
    store = Store(tiny_tmpfs / "store")
    before = seed_generation(store)
    filler = tiny_tmpfs / "filler"
    filler.mkdir()

    with store.writer(KEY) as writer:
        staging = writer.staging()
        (staging / "new.bin").write_bytes(b"new")
        # Two inodes left: MANIFEST.json's and HISTORY.json's (the first one, recording the
        # seed generation as replaced).
        for i in range(os.statvfs(tiny_tmpfs).f_ffree - 2):
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
    out, err = proc.communicate(timeout=scaled(60))

    assert out == b"ready\n"
    assert proc.returncode == ExitCode.IO, err.decode()
    lines = err.decode().splitlines()
    assert len(lines) == 1 and "EFBIG" in lines[0] and "big.cubin" in lines[0], lines
    assert_current_intact(store, before)
    assert transient(store.key_dir(KEY)) == []
    assert_next_writer_cleans_up(store)


# --------------------------------------------------------------------------- the writer lock


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
