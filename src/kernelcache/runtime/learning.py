"""This serving process's compiles with their full keys, for the next build (``learned``).

Prometheus gets bounded labels only (toolchain, kernel: ``metrics``); the key a compile was
for (Triton's hash, the token count of the vLLM forward it happened in) is kept here instead,
at most ``learned.LIMIT`` distinct keys and a count of the rest, and served as JSON beside
``/metrics`` at ``learned.PATH`` for the operator (or ``curl``) to read.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from kernelcache import learned
from kernelcache.spec import LearnedKey

_lock = threading.Lock()
_keys: dict[learned.Identity, LearnedKey] = {}
_dropped = 0
_about: dict[str, str] = {}


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


def serving(name: str, arch: str, generation: str) -> None:
    """The generation this process serves from: said in the record."""
    _about.update(cache=name, arch=arch, generation=generation)


def record() -> dict[str, Any]:
    """The record as served."""
    with _lock:
        keys = sorted((k.model_copy() for k in _keys.values()), key=learned.identity)
        dropped = _dropped
    return learned.document(keys, dropped, pid=os.getpid(), **_about)


def forget() -> None:
    """A forked child keeps its own record: what the parent met is the parent's."""
    global _dropped
    with _lock:
        _keys.clear()
        _dropped = 0


os.register_at_fork(after_in_child=forget)
