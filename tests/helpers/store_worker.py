"""A separate process for the store's fault-injection tests (tests/test_store_faults.py).

Real faults need a real process: one that is SIGKILLed mid-publish, that holds a lock when
it dies, that races another for the same key, or that runs under a file-size limit.

    store_worker.py loop  ROOT KEY SEED          publish generation after generation, forever
    store_worker.py once  ROOT KEY SEED GO_FILE  publish once, as soon as GO_FILE exists
    store_worker.py hold  ROOT KEY               take the writer lock, stage a file, sleep
    store_worker.py fsize ROOT KEY SRC LIMIT     publish SRC under RLIMIT_FSIZE=LIMIT bytes

Each prints "ready" once its imports are done, so the test can time its fault from there.
"""

from __future__ import annotations

import json
import random
import resource
import signal
import sys
import time
from pathlib import Path

from kernelcache.errors import KernelCacheError
from kernelcache.store import Store, Writer

STAMP_FACTORS = {"torch": "2.5.1", "cuda": "12.4", "triton": "3.1.0"}


def stamp_for(label: str) -> dict[str, object]:
    return {
        "digest": f"blake3:{label}",
        "compile_digest": f"blake3:compile-{label}",
        "factors": STAMP_FACTORS,
        "factor_digests": {name: f"blake3:{value}" for name, value in STAMP_FACTORS.items()},
    }


def write_random_files(files_dir: Path, rng: random.Random) -> None:
    """Several small files in two toolchain subtrees and one of about 1 MB."""
    for i in range(4):
        sub = files_dir / ("triton" if i % 2 else "cute") / f"k{i}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"kernel{i}.cubin").write_bytes(rng.randbytes(rng.randint(1_000, 16_000)))
    (files_dir / "triton" / "big.bin").write_bytes(rng.randbytes(1_000_000 + rng.randint(0, 4096)))


def publish_random(writer: Writer, seed: str) -> str:
    files_dir = writer.staging()
    write_random_files(files_dir, random.Random(seed))
    manifest = writer.publish(files_dir, stamp_for(seed), {"seed": seed}, keep=2)
    return manifest.generation


def loop(root: str, key: str, seed: str) -> None:
    store = Store(root)
    ready()
    i = 0
    while True:
        # Every third round republishes the previous content: the "same id exists" path.
        content = f"{seed}-{i - 1 if i % 3 == 2 else i}"
        with store.writer(key) as writer:
            publish_random(writer, content)
        i += 1


def once(root: str, key: str, seed: str, go_file: str) -> None:
    store = Store(root)
    ready()
    while not Path(go_file).exists():
        time.sleep(0.001)
    with store.writer(key) as writer:
        acquired = time.time()
        generation = publish_random(writer, seed)
        released = time.time()
    print(json.dumps({"generation": generation, "acquired": acquired, "released": released}))


def hold(root: str, key: str) -> None:
    store = Store(root)
    with store.writer(key) as writer:
        (writer.staging() / "half-written.bin").write_bytes(b"x" * 4096)
        print("locked", flush=True)
        time.sleep(3600)


def fsize(root: str, key: str, src: str, limit: str) -> int:
    store = Store(root)
    # Over the limit, write() then fails with EFBIG instead of the process being killed.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    ready()
    try:
        with store.writer(key) as writer:
            writer.publish(Path(src), stamp_for("fsize"), {}, keep=2)
    except KernelCacheError as exc:
        print(exc.message, file=sys.stderr)
        return int(exc.code)
    return 0


def ready() -> None:
    print("ready", flush=True)


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "loop":
        loop(*args)
    elif command == "once":
        once(*args)
    elif command == "hold":
        hold(*args)
    elif command == "fsize":
        return fsize(*args)
    else:
        raise SystemExit(f"unknown command {command!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
