"""Pulling a generation from a registry: `kernelcache pull` against `skopeo copy` to a dir.

A node that pulls a generation must not pay much more than the least an independent client
pays to fetch the same artifact and check its digests. This publishes a synthetic generation
(``synthetic.make_files``: the realistic size mix), pushes it to a real registry (Debian's
docker-registry with TLS and basic auth, as the tests start it), then times, alternately and
in one run, each in a fresh process:

- ``skopeo copy docker://REPO@sha256:… dir:DST``: every blob fetched, its digest checked,
  written to a directory (skopeo's own client, Go);
- ``kernelcache pull REPO@sha256:… --store DST --public-key K --require-signature``: the
  signature checked, every blob streamed and unpacked into the store's staging (sha256 of
  every blob, blake3 of every file against MANIFEST.json, every tar entry checked), fsynced,
  verified and published as the key's CURRENT generation (interpreter start-up included).

Between runs the copy is removed and the disk synced (untimed). Target: pull ≤ 1.1× skopeo,
as the median of each round's ratio (the two sides back to back, under the same load: on a
shared machine the load drifts between rounds more than between the two runs of one), with
the medians of each side and the CPU each used beside it.

    python bench/oci_pull.py [--size-mb 1024] [--repeat 5] [--gzip]
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
from pathlib import Path

from synthetic import publish_generation

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers.registry import PASSWORD, USER, running_registry  # noqa: E402

from kernelcache.distribution import push  # noqa: E402
from kernelcache.store import generate_keypair  # noqa: E402

KEY = "bench/oci/sm_90a"
SIDES = ("skopeo copy", "kernelcache pull")


def timed(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its threads)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{command[0]} failed: {done.stderr.strip()[-2000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return seconds, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--gzip", action="store_true", help="compressed layers (level 1)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kc-oci-bench-") as scratch:
        work = Path(scratch)
        private, public = generate_keypair(work / "keys")
        _, files, total = publish_generation(work, KEY, args.size_mb)
        with running_registry(work / "registry") as registry:
            started = time.perf_counter()
            pushed = push(
                work / "store", KEY, registry.repo("bench/oci"), auth=registry.authfile,
                ca_file=registry.ca_file, signing_key=private, gzip=args.gzip,
            )  # fmt: skip
            push_s = time.perf_counter() - started
            print(
                f"generation: {files} files, {total / 1e9:.2f} GB, {pushed.layers} layers "
                f"({pushed.bytes / 1e9:.2f} GB in the registry); push {push_s:.2f} s"
            )
            path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
            env = {**os.environ, "PYTHONPATH": path}
            skopeo = [
                "skopeo", "copy", "--src-cert-dir", str(registry.cert_dir),
                "--src-creds", f"{USER}:{PASSWORD}", f"docker://{pushed.ref_digest}",
            ]  # fmt: skip
            pull = [
                sys.executable, "-m", "kernelcache", "pull", pushed.ref_digest,
                "--authfile", str(registry.authfile), "--ca-file", str(registry.ca_file),
                "--public-key", str(public), "--require-signature", "--store",
            ]  # fmt: skip
            times: dict[str, list[tuple[float, float]]] = {
                "skopeo copy": [],
                "kernelcache pull": [],
            }
            for _ in range(args.repeat + 1):  # the first round warms the registry's page cache
                for side, command in (
                    ("skopeo copy", [*skopeo, f"dir:{work / 'dir'}"]),
                    ("kernelcache pull", [*pull, str(work / "pulled")]),
                ):
                    times[side].append(timed(command, env))
                    for out in ("dir", "pulled"):
                        shutil.rmtree(work / out, ignore_errors=True)
                    os.sync()
    print(f"load average {os.getloadavg()[0]:.1f}; median and best of {args.repeat}:")
    medians = {}
    for side, runs in times.items():
        wall = [w for w, _ in runs[1:]]
        cpu = statistics.median(c for _, c in runs[1:])
        medians[side] = statistics.median(wall)
        print(
            f"  {side:18} {medians[side]:6.2f} s  best {min(wall):6.2f} s  "
            f"{total / medians[side] / 1e9:5.2f} GB/s  CPU {cpu:5.2f} s"
        )
    ratio = medians["kernelcache pull"] / medians["skopeo copy"]
    rounds = [p[0] / s[0] for s, p in zip(times[SIDES[0]][1:], times[SIDES[1]][1:], strict=True)]
    print(
        f"kernelcache pull / skopeo copy: {ratio:.2f}x (medians), "
        f"{statistics.median(rounds):.2f}x (median of each round's ratio: the two sides ran "
        f"back to back, under the same load); target <= 1.1x"
    )


if __name__ == "__main__":
    main()
