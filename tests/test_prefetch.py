"""A node's prefetched copies under the faults a node meets: signing on, a copy damaged on
disk, two prefetches at once on one disk bound, a ``.wanted`` entry edited to point one
KernelCache's pods at another's copy. Each is asserted as the pod or the prefetch sees it:
the exit code, the line, and what is on the node afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kernelcache import prefetch
from kernelcache.contract import LOCAL_DAMAGED
from kernelcache.errors import ExitCode
from kernelcache.store import generate_keypair, verify
from kernelcache.store.layout import FILES_DIR, SIGNATURE_NAME
from kernelcache.store.prefetched import find, wanted_path
from tests.conftest import one_line_error, run_kernelcache, scaled, subprocess_env
from tests.helpers.generations import ARCH, COMPILED, KEY, NS, PRODUCT, publish

OTHER = f"{NS}/other/{ARCH}"


def pod(local: Path, key: str, token: str, *extra: str) -> subprocess.CompletedProcess:
    """A serving pod's init-container reading only this node's copy."""
    _, name, arch = key.split("/")
    return run_kernelcache(
        "verify", "--namespace", NS, "--name", name, "--arch", arch, "--gpu-product", PRODUCT,
        "--local", str(local), "--want", f"{arch}={token}", "--local-only",
        "--materialize", str(local.parent / f"pod-{name}"), *extra,
    )  # fmt: skip


def test_a_copy_from_the_store_carries_its_signature_and_signed_pods_start_from_it(
    tmp_path: Path,
) -> None:
    private, public = generate_keypair(tmp_path / "keys")
    gen = publish(tmp_path / "shared", signing_key=private)
    local = tmp_path / "node"
    done = run_kernelcache(
        "prefetch", "--root", str(local), "--key", KEY, "--want", gen.name,
        "--store", str(tmp_path / "shared"), "--limit", "1000000000",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (local / KEY / gen.name / SIGNATURE_NAME).read_bytes() == (
        gen / SIGNATURE_NAME
    ).read_bytes()
    started = pod(local, KEY, gen.name, "--public-key", str(public), "--require-signature")
    assert started.returncode == 0, started.stderr
    assert "from this node's prefetched copy" in started.stdout


def test_a_damaged_copy_is_not_already_here_it_is_fetched_again(tmp_path: Path) -> None:
    gen = publish(tmp_path / "shared")
    local = tmp_path / "node"
    prefetch.sync(local, KEY, gen.name, limit_bytes=10**9, store=tmp_path / "shared")
    damaged = local / KEY / gen.name / FILES_DIR / next(iter(COMPILED))
    damaged.chmod(0o644)
    damaged.write_bytes(b"rot" + damaged.read_bytes()[3:])

    again = prefetch.sync(local, KEY, gen.name, limit_bytes=10**9, store=tmp_path / "shared")
    assert again.fetched and again.repaired is not None and "digest" in again.repaired
    assert "fetched again (the copy here did not verify" in again.summary
    assert verify(local / KEY / gen.name, key=KEY).ok
    assert not list((local / KEY).glob(".damaged-*"))
    kept = prefetch.sync(local, KEY, gen.name, limit_bytes=10**9, store=tmp_path / "shared")
    assert not kept.fetched and kept.summary.count("already here, verified") == 1


# A prefetch on a slow disk: each copy takes a second, the window two admissions race in.
CONCURRENT = """
import sys, time
from kernelcache import prefetch
from kernelcache.cli import main
copy = prefetch.materialize
def slow(*args, **kwargs):
    time.sleep(1)
    return copy(*args, **kwargs)
prefetch.materialize = slow
sys.exit(main(sys.argv[1:]))
"""


def test_two_prefetches_at_once_stay_within_the_limit(tmp_path: Path) -> None:
    """Two KernelCaches' copies of 6 MB each under a 9 MB limit, fetched at the same time:
    one lands, the other is refused in one line, and the disk holds at most the limit."""
    shared, local = tmp_path / "shared", tmp_path / "node"
    big = {f"triton/k{i}.cubin": bytes([i]) * (1 << 20) for i in range(6)}
    gens = {key: publish(shared, key=key, files=big).name for key in (KEY, OTHER)}
    limit = 9 << 20
    runs = []
    for key, gen in gens.items():
        command = ["prefetch", "--root", str(local), "--key", key, "--want", gen,
                   "--store", str(shared), "--limit", str(limit)]  # fmt: skip
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", CONCURRENT, *command],
                env=subprocess_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = [(run.wait(timeout=scaled(120)), run.communicate()[1]) for run in runs]
    assert sorted(code for code, _ in results) == [0, ExitCode.IO], results
    refused = next(err for code, err in results if code)
    assert "does not fit the prefetch limit" in refused and len(refused.splitlines()) == 1
    assert prefetch.used(local) <= limit
    assert sum(find(local, key, gen) is not None for key, gen in gens.items()) == 1


def test_a_wanted_entry_naming_another_kernelcaches_copy_serves_nothing(tmp_path: Path) -> None:
    shared, local = tmp_path / "shared", tmp_path / "node"
    ours = publish(shared, key=KEY).name
    theirs = publish(shared, key=OTHER, files={"triton/theirs.cubin": b"theirs"}).name
    for key, gen in ((KEY, ours), (OTHER, theirs)):
        prefetch.sync(local, key, gen, limit_bytes=10**9, store=shared)
    # Someone with the node's disk points our key at their copy, under the token our pods want.
    wanted_path(local, KEY).write_text(
        json.dumps({"token": ours, "key": OTHER, "generation": theirs})
    )
    refused = pod(local, KEY, ours)
    assert refused.returncode == ExitCode.MISSING_GENERATION, refused.stderr
    assert f"no prefetched copy of {ours} on this node" in one_line_error(refused)
    assert not (local.parent / "pod-demo").exists() or not list(
        (local.parent / "pod-demo").glob("*/files/triton/theirs.cubin")
    )


def _tree_bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def test_what_a_sigkilled_prefetch_left_is_removed_and_said_by_the_next(tmp_path: Path) -> None:
    """A prefetch killed while it copied a 220 MB generation left its ``.partial-*`` behind,
    which no later prefetch removed or counted (481.6 MB on disk, 251.7 MB reported)."""
    big = publish(tmp_path / "shared", files={"triton/big.cubin": os.urandom(220 * 10**6)})
    small = publish(tmp_path / "other-shared", key=OTHER)
    local = tmp_path / "node"
    prefetch.sync(local, OTHER, small.name, limit_bytes=10**9, store=tmp_path / "other-shared")
    argv = [
        "prefetch", "--root", str(local), "--key", KEY, "--want", big.name,
        "--store", str(tmp_path / "shared"), "--limit", "1000000000",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelcache", *argv],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + scaled(120)
        while not any(p.stat().st_size > 10**6 for p in local.glob(f"{KEY}/.partial-*/**/*")):
            assert proc.poll() is None, "the prefetch finished before it could be killed"
            assert time.monotonic() < deadline, "no .partial-* copy appeared"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    [left] = local.glob(f"{KEY}/.partial-*")
    left_bytes = _tree_bytes(left)
    synced = prefetch.sync(
        local, OTHER, small.name, limit_bytes=10**9, store=tmp_path / "other-shared"
    )
    assert not left.exists() and synced.leftovers >= left_bytes > 10**6
    assert "a killed prefetch had left" in synced.summary
    # What is on the disk is what is reported: copies, their manifests and the node's files.
    on_disk = _tree_bytes(local)
    assert synced.used_bytes <= on_disk < synced.used_bytes + 100_000


def test_a_damaged_node_copy_falls_back_to_the_store_and_says_so(tmp_path: Path) -> None:
    """The node's copy rots after it was fetched: a pod that may fall back starts from the
    store (it failed with exit 5 before), says why, and leaves the line in its termination
    log, where the operator reads it into status.nodes; a local-only pod is refused."""
    gen = publish(tmp_path / "shared")
    local = tmp_path / "node"
    prefetch.sync(local, KEY, gen.name, limit_bytes=10**9, store=tmp_path / "shared")
    damaged = local / KEY / gen.name / FILES_DIR / next(iter(COMPILED))
    damaged.chmod(0o644)
    damaged.write_bytes(b"rot" + damaged.read_bytes()[3:])
    log = tmp_path / "termination-log"
    _, name, arch = KEY.split("/")
    started = run_kernelcache(
        "verify", "--namespace", NS, "--name", name, "--arch", arch, "--gpu-product", PRODUCT,
        "--local", str(local), "--want", f"{arch}={gen.name}", "--store", str(tmp_path / "shared"),
        "--materialize", str(tmp_path / "pod"), "--termination-log", str(log),
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert "from this node's prefetched copy" not in started.stdout  # the store's
    line = log.read_text().strip()
    assert line.startswith(f"{KEY}: {LOCAL_DAMAGED} (") and "read from its source instead" in line
    assert line in started.stderr
    refused = pod(local, KEY, gen.name)  # --local-only: the node's copy or nothing
    assert refused.returncode == ExitCode.INTEGRITY, refused.stderr
