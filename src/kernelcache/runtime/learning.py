"""This serving process's compiles with their full keys, for the next build (``learned``).

Prometheus gets bounded labels only (toolchain, kernel: ``metrics``); the key a compile was
for (Triton's hash, the token count of the vLLM forward it happened in) is kept here instead,
at most ``learned.LIMIT`` distinct keys and a count of the rest, and served as JSON beside
``/metrics`` at ``learned.PATH`` for the operator (or ``curl``) to read.

An engine runs in several processes (``vllm serve``: an API server and an engine core) and
only the first binds the metrics port, so each process that would serve one also writes its
record to a directory they share (``share``: one per port, under the temp dir) and the record
served is the union of them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kernelcache import learned
from kernelcache.errors import SpecError
from kernelcache.spec import LearnedKey

_lock = threading.Lock()
_keys: dict[learned.Identity, LearnedKey] = {}
_dropped = 0
_about: dict[str, str] = {}
_shared: Path | None = None


def share(port: int) -> None:
    """Keep this process's record where the process serving ``port`` reads it."""
    global _shared
    _shared = Path(tempfile.gettempdir()) / f"kernelcache-learned-{port}"
    with contextlib.suppress(OSError):
        _shared.mkdir(mode=0o700, exist_ok=True)


def note(toolchain: str, kernel: str, key: str | None = None, tokens: int | None = None) -> None:
    """One compile (or JIT event) that serving met."""
    global _dropped
    entry = LearnedKey(
        toolchain=toolchain,
        kernel=kernel[:200],
        key=key[:200] if key else None,
        tokens=tokens if tokens and tokens > 0 else None,
        first_seen=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    with _lock:
        seen = _keys.get(learned.identity(entry))
        if seen is not None:
            seen.count += 1
        elif len(_keys) < learned.LIMIT:
            _keys[learned.identity(entry)] = entry
        else:
            _dropped += 1
        own, dropped = _own()
    if _shared is not None:  # compiles in serving are rare: one small write each
        path = _shared / f"{os.getpid()}.json"
        with contextlib.suppress(OSError):
            path.with_suffix(".tmp").write_text(json.dumps(learned.document(own, dropped)))
            os.replace(path.with_suffix(".tmp"), path)


def serving(name: str, arch: str, generation: str) -> None:
    """The generation this process serves from: said in the record."""
    _about.update(cache=name, arch=arch, generation=generation)


def _own() -> tuple[list[LearnedKey], int]:
    """This process's keys (copies) and dropped count; called under the lock."""
    return [k.model_copy() for k in _keys.values()], _dropped


def record() -> dict[str, Any]:
    """The record as served: this process's keys and those its sibling processes shared."""
    with _lock:
        own, dropped = _own()
    records = [own]
    siblings = _shared.glob("*.json") if _shared is not None else []
    for path in siblings:
        if path.stem == str(os.getpid()):
            continue
        with contextlib.suppress(OSError, SpecError):
            keys, over = learned.parse(path.read_bytes(), str(path))
            records.append(keys)
            dropped += over
    keys, over = learned.merge([], records)
    return learned.document(keys, dropped + over, pid=os.getpid(), **_about)


def forget() -> None:
    """A forked child keeps its own record: what the parent met is the parent's."""
    global _dropped
    with _lock:
        _keys.clear()
        _dropped = 0


os.register_at_fork(after_in_child=forget)
