"""The materialize target under the faults a pod's volume meets: a symlink to a directory
holding someone's files, a symlink that points at itself, and a verify killed midway whose
leftovers the next run must remove (and a live run's, which it must not)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kernelcache.contract import ENV_FILE, REPORT_FILE
from kernelcache.errors import ExitCode
from tests.conftest import one_line_error, run_kernelcache, scaled, subprocess_env
from tests.helpers.generations import KEY, PRODUCT, publish


def verify_into(store: Path, target: Path) -> subprocess.CompletedProcess:
    return run_kernelcache(
        "verify", "--store", str(store), "--key", KEY, "--gpu-product", PRODUCT,
        "--materialize", str(target),
    )  # fmt: skip


def test_a_target_that_is_a_symlink_to_a_directory_is_refused_and_nothing_in_it_touched(
    tmp_path: Path,
) -> None:
    publish(tmp_path / "store")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for name in (ENV_FILE, REPORT_FILE, ".partial-x", "data"):
        (theirs / name).write_text("not kernelcache's")
    (tmp_path / "target").symlink_to(theirs)

    refused = verify_into(tmp_path / "store", tmp_path / "target")
    assert refused.returncode == ExitCode.UNSAFE_PATH, refused.stderr
    assert "is a symlink" in one_line_error(refused)
    assert sorted(os.listdir(theirs)) == sorted([ENV_FILE, REPORT_FILE, ".partial-x", "data"])


def test_a_target_that_is_a_symlink_to_itself_is_an_unsafe_path(tmp_path: Path) -> None:
    publish(tmp_path / "store")
    (tmp_path / "target").symlink_to("target")
    refused = verify_into(tmp_path / "store", tmp_path / "target")
    assert refused.returncode == ExitCode.UNSAFE_PATH, refused.stderr
    assert "is a symlink (to 'target')" in one_line_error(refused)


# A verify whose copy stalls (a slow disk) once it has begun: killed there, as a node kills
# an init-container.
STALLING = """
import sys, time
from kernelcache.store import materialization
from kernelcache.cli import main
def stall(*args, **kwargs):
    time.sleep(600)
materialization._copy_batch = stall
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_verify_leaves_nothing_the_next_run_keeps(tmp_path: Path) -> None:
    publish(tmp_path / "store")
    target = tmp_path / "pod"
    killed = subprocess.Popen(
        [sys.executable, "-c", STALLING, "verify", "--store", str(tmp_path / "store"),
         "--key", KEY, "--gpu-product", PRODUCT, "--materialize", str(target)],
        env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + scaled(60)
    while not list(target.glob(".partial-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=scaled(30))
    assert list(target.glob(".partial-*"))
    # What else a run killed at other points leaves: an old copy moved aside, a report and
    # an env file not yet renamed into place.
    for name in (".stale-dead", f".{REPORT_FILE}.dead", f".{ENV_FILE}.dead"):
        (target / name).mkdir() if name.startswith(".stale") else (target / name).write_text("")

    done = verify_into(tmp_path / "store", target)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in target.iterdir() if p.name.startswith(".")) == []


def test_a_live_runs_files_are_left_alone(tmp_path: Path) -> None:
    """Another run holds the target (its shared lock): its copy in progress stays."""
    publish(tmp_path / "store")
    target = tmp_path / "pod"
    target.mkdir()
    (target / ".partial-live").mkdir()
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        done = verify_into(tmp_path / "store", target)
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr
    assert (target / ".partial-live").is_dir()
