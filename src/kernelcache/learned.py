"""What serving compiled, as keys the next warm compiles: the record both sides read.

A serving process keeps every compile it still made after its engine was ready (kernelcache's
counter, vLLM's JIT monitor) as a key here, bounded in number, and serves the record beside
its metrics (``PATH``); Prometheus keeps only bounded labels (toolchain, kernel). The operator
reads the record from its ready serving pods into ``status.learned``; the next compile Job
(and ``kernelcache build --learned FILE``) warms those keys. A live pod's cache files are never
read or trusted: only what serving met travels, and the warm compiles it itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kernelcache.documents import load_json
from kernelcache.errors import SpecError

if TYPE_CHECKING:  # the serving side imports this module and no pydantic (its record is JSON)
    from kernelcache.spec import LearnedKey

PATH = "/kernelcache/learned"  # served by the runtime's metrics server
LIMIT = 256  # distinct keys a record or a status holds; the rest are counted as dropped
KIND = "KernelCacheLearned"

Identity = tuple[str, str, str, int]


def identity(key: LearnedKey) -> Identity:
    """What makes two keys the same specialization (their counts and times aside)."""
    return (key.toolchain, key.kernel, key.key or "", key.tokens or 0)


def bounded(keys: Iterable[LearnedKey], limit: int = LIMIT) -> tuple[list[LearnedKey], int]:
    """The most met ``limit`` keys in a stable order, and how many were left out."""
    ranked = sorted(keys, key=lambda k: (-k.count, identity(k)))
    kept = sorted(ranked[:limit], key=identity)
    return kept, len(ranked) - len(kept)


def merge(
    previous: Iterable[LearnedKey], records: Iterable[Iterable[LearnedKey]], limit: int = LIMIT
) -> tuple[list[LearnedKey], int]:
    """``previous`` with the keys of each record (one per pod) added, bounded.

    A pod's counts are its totals since it started, read again each time: a key's count is
    the larger of what was kept and what the pods report now (summed over them), never a
    sum over reads. The earliest ``first_seen`` is kept.
    """
    now: dict[Identity, LearnedKey] = {}
    for record in records:
        for key in record:
            seen = now.get(identity(key))
            if seen is None:
                now[identity(key)] = key
            else:
                now[identity(key)] = seen.model_copy(
                    update={
                        "count": seen.count + key.count,
                        "first_seen": _earliest(seen.first_seen, key.first_seen),
                    }
                )
    merged = {identity(k): k for k in previous}
    for ident, key in now.items():
        kept = merged.get(ident)
        if kept is not None:
            key = key.model_copy(
                update={
                    "count": max(kept.count, key.count),
                    "first_seen": _earliest(kept.first_seen, key.first_seen),
                }
            )
        merged[ident] = key
    return bounded(merged.values(), limit)


def _earliest(a: str | None, b: str | None) -> str | None:
    return min(x for x in (a, b) if x) if a or b else None


def sizes(keys: Iterable[LearnedKey]) -> list[int]:
    """The forward token counts serving met a JIT in: the vLLM warm runs them before its
    monitor arms, so they are compiled in the warm and preloaded in serving."""
    return sorted({k.tokens for k in keys if k.tokens})


def document(keys: list[LearnedKey], dropped: int, **about: Any) -> dict[str, Any]:
    """The record as served and as ``--learned`` reads it; ``about``: what serves it."""
    return {
        "kind": KIND,
        **about,
        "keys": [k.model_dump(mode="json", by_alias=True, exclude_none=True) for k in keys],
        "dropped": dropped,
    }


def parse(text: str | bytes, source: str) -> tuple[list[LearnedKey], int]:
    """The keys and dropped count of a record (or of a ``status.learned``); bad input is one
    ``SpecError`` line naming ``source`` and the field."""
    try:
        data = load_json(text, source, SpecError)
    except ValueError as exc:
        raise SpecError(f"{source}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("keys", []), list):
        raise SpecError(f"{source}: not a learned record (expected an object with keys: [...])")
    from pydantic import ValidationError

    from kernelcache.spec import LearnedKey

    keys = []
    for index, entry in enumerate(data.get("keys", [])):
        try:
            keys.append(LearnedKey.model_validate(entry))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = "".join(f".{p}" for p in first["loc"])
            raise SpecError(f"{source}: keys[{index}]{where}: {first['msg']}") from None
    dropped = data.get("dropped", 0)
    if not isinstance(dropped, int) or dropped < 0:
        raise SpecError(f"{source}: dropped: expected a count, got {dropped!r}")
    kept, over = bounded(keys)
    return kept, dropped + over
