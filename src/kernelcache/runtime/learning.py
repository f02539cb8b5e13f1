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

# A key as the record serves it (``spec.LearnedKey``'s JSON): plain dicts, since the serving
# side imports no pydantic.
Key = dict[str, Any]

_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # spec.TIMESTAMP: what the operator accepts
_lock = threading.Lock()
_keys: dict[tuple[Any, ...], Key] = {}
_dropped = 0
_about: dict[str, str] = {}
_shared: Path | None = None


def share(port: int) -> None:
    """Keep this process's record where the process serving ``port`` reads it."""
    global _shared
    _shared = Path(tempfile.gettempdir()) / f"kernelcache-learned-{port}"
    with contextlib.suppress(OSError):
        _shared.mkdir(mode=0o700, exist_ok=True)


def _identity(key: Key) -> tuple[Any, ...]:
    """``learned.identity`` of a key in its JSON form."""
    return (key["toolchain"], key["kernel"], key.get("key") or "", key.get("tokens") or 0)


def note(toolchain: str, kernel: str, key: str | None = None, tokens: int | None = None) -> None:
    """One compile (or JIT event) that serving met."""
    global _dropped
    entry: Key = {"toolchain": toolchain[:64], "kernel": kernel[:200], "count": 1}
    if key:
        entry["key"] = key[:200]
    if tokens and tokens > 0:
        entry["tokens"] = tokens
    entry["firstSeen"] = time.strftime(_TIME_FORMAT, time.gmtime())
    with _lock:
        seen = _keys.get(_identity(entry))
        if seen is not None:
            seen["count"] = min(learned.COUNT_MAX, seen["count"] + 1)
        elif len(_keys) < learned.LIMIT:
            _keys[_identity(entry)] = entry
        else:
            _dropped += 1
        own, dropped = _own()
    if _shared is not None:  # compiles in serving are rare: one small write each
        path = _shared / f"{os.getpid()}.json"
        with contextlib.suppress(OSError):
            path.with_suffix(".tmp").write_text(json.dumps(_document(own, dropped)))
            os.replace(path.with_suffix(".tmp"), path)


def serving(name: str, arch: str, generation: str) -> None:
    """The generation this process serves from: said in the record."""
    _about.update(cache=name, arch=arch, generation=generation)


def _own() -> tuple[list[Key], int]:
    """This process's keys (copies) and dropped count; called under the lock."""
    return [dict(k) for k in _keys.values()], _dropped


def _document(keys: list[Key], dropped: int, **about: Any) -> dict[str, Any]:
    return {"kind": learned.KIND, **about, "keys": keys, "dropped": dropped}


def record() -> dict[str, Any]:
    """The record as served: this process's keys and those its sibling processes shared
    (summed by key, bounded as the operator bounds them; it validates what it reads)."""
    with _lock:
        own, dropped = _own()
    merged = {_identity(k): k for k in own}
    siblings = _shared.glob("*.json") if _shared is not None else []
    for path in siblings:
        if path.stem == str(os.getpid()):
            continue
        try:
            if path.stat().st_size > learned.MAX_RECORD_BYTES:
                continue  # no sibling writes that much: not a record
            data = json.loads(path.read_bytes())
            dropped = min(learned.COUNT_MAX, dropped + max(0, int(data.get("dropped", 0))))
            for key in data["keys"]:
                if not _plausible(key):
                    continue  # the operator would refuse the whole record for it
                seen = merged.get(_identity(key))
                if seen is None:
                    merged[_identity(key)] = dict(key)
                else:
                    seen["count"] = min(learned.COUNT_MAX, seen["count"] + key["count"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a sibling writing or gone: its keys come with the next read
    ranked = sorted(merged.values(), key=lambda k: (-k["count"], _identity(k)))
    kept = sorted(ranked[: learned.LIMIT], key=_identity)
    extra = len(ranked) - len(kept)
    return _document(kept, dropped + extra, pid=os.getpid(), **_about)


def _plausible(key: Any) -> bool:
    """A sibling's key as this process would have written it: counts within the bound,
    a positive token count if any, names of their bounded lengths."""
    count, tokens = key.get("count"), key.get("tokens")
    return (
        isinstance(count, int)
        and 1 <= count <= learned.COUNT_MAX
        and (tokens is None or (isinstance(tokens, int) and 1 <= tokens <= learned.TOKENS_MAX))
        and isinstance(key.get("kernel"), str)
        and len(key["kernel"]) <= 200
        and isinstance(key.get("toolchain"), str)
        and len(key["toolchain"]) <= 64
        and (key.get("key") is None or (isinstance(key["key"], str) and len(key["key"]) <= 200))
        and _timestamp(key.get("firstSeen"))
    )


def _timestamp(value: Any) -> bool:
    if value is None:
        return True
    try:
        time.strptime(value, _TIME_FORMAT)
    except (TypeError, ValueError):
        return False
    return len(value) == 20


def forget() -> None:
    """A forked child keeps its own record: what the parent met is the parent's."""
    global _dropped
    with _lock:
        _keys.clear()
        _dropped = 0


os.register_at_fork(after_in_child=forget)
