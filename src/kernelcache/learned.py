"""What serving compiled, as keys the next warm compiles: the record both sides read.

A serving process keeps every compile it still made after its engine was ready (kernelcache's
counter, vLLM's JIT monitor) as a key here, bounded in number, and serves the record beside
its metrics (``PATH``); Prometheus keeps only bounded labels (toolchain, kernel). The operator
reads the record from its ready serving pods into ``status.learned``; the next compile Job
(and ``kernelcache build --learned FILE``) warms those keys. A live pod's cache files are never
read or trusted: only what serving met travels, and the warm compiles it itself.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kernelcache.documents import load_json
from kernelcache.errors import SpecError

if TYPE_CHECKING:  # the serving side imports this module and no pydantic (its record is JSON)
    from kernelcache.spec import LearnedKey

PATH = "/kernelcache/learned"  # served by the runtime's metrics server
LIMIT = 256  # distinct keys a record or a status holds; the rest are counted as dropped
KIND = "KernelCacheLearned"
# The most bytes a record may be: 256 keys at their longest are ~150 KB; past this it is
# refused as too large, unread (a pod's answer is untrusted input).
MAX_RECORD_BYTES = 1 << 20
KEY_PODS = 8  # pods a key names (``spec.LearnedKey.pods``); a test ties the two
COUNT_MAX = 2**53 - 1  # counts saturate here (``spec.COUNT_MAX``; a test ties the two)
TOKENS_MAX = 2**31 - 1  # ``spec.TOKENS_MAX``, for the serving side (no pydantic there)
# Attribution the operator writes: a pod's own record never sets it.
_ATTRIBUTION = {"pods", "gone_since"}

Identity = tuple[str, str, str, int]


def identities(keys: Iterable[LearnedKey]) -> set[Identity]:
    return {identity(k) for k in keys}


def identity(key: LearnedKey) -> Identity:
    """What makes two keys the same specialization (their counts and times aside)."""
    return (key.toolchain, key.kernel, key.key or "", key.tokens or 0)


def _ranked(keys: Iterable[LearnedKey]) -> list[LearnedKey]:
    return sorted(keys, key=lambda k: (-k.count, identity(k)))


def bounded(keys: Iterable[LearnedKey], limit: int = LIMIT) -> tuple[list[LearnedKey], int]:
    """At most ``limit`` keys in a stable order, and how many were left out: each pod a
    fair share (round robin over the pods a key is attributed to, each pod's own most met
    first), so no pod's counts can push out another pod's keys. Keys of no pod (one
    record, ``--learned``) are one share."""
    keys = list(keys)
    shares: dict[str, list[LearnedKey]] = {}
    for key in keys:
        for pod in key.pods or [""]:
            shares.setdefault(pod, []).append(key)
    queues = [_ranked(share) for _, share in sorted(shares.items())]
    kept: dict[Identity, LearnedKey] = {}
    depth = 0
    while len(kept) < limit and any(depth < len(q) for q in queues):
        for queue in queues:
            if depth < len(queue) and len(kept) < limit:
                kept.setdefault(identity(queue[depth]), queue[depth])
        depth += 1
    return sorted(kept.values(), key=identity), len(keys) - len(kept)


def merge(
    previous: Iterable[LearnedKey],
    records: Mapping[str, Iterable[LearnedKey]],
    *,
    now: str | None = None,
    alive: Collection[str] | None = None,
    forget_before: str | None = None,
    limit: int = LIMIT,
) -> tuple[list[LearnedKey], int]:
    """``previous`` with the keys of each pod's record added, attributed, aged and bounded.

    A pod's counts are its totals since it started, read again each time: a key's count is
    the larger of what was kept and what the pods report now (summed over them, saturating
    at ``COUNT_MAX``), never a sum over reads. The earliest ``first_seen`` is kept. A key is
    attributed to the pods that report it and those of its pods still ``alive`` (None: no
    pod list, attribution kept as it is); once none is, ``gone_since`` is ``now``, and it
    ages out when that is before ``forget_before``. Only a change of pods changes a key's
    attribution: reading the same pods again changes nothing.
    """
    reported: dict[Identity, LearnedKey] = {}
    for pod, record in sorted(records.items()):
        for key in record:
            seen = reported.get(identity(key))
            if seen is None:
                reported[identity(key)] = key.model_copy(update={"pods": [pod]})
            else:
                reported[identity(key)] = seen.model_copy(
                    update={
                        "count": min(COUNT_MAX, seen.count + key.count),
                        "first_seen": _earliest(seen.first_seen, key.first_seen),
                        "pods": sorted({*seen.pods, pod}),
                    }
                )
    merged: dict[Identity, LearnedKey] = {}
    for key in previous:
        pods = [p for p in key.pods if alive is None or p in alive]
        gone_since = None if pods else key.gone_since or now
        if gone_since is not None and forget_before is not None and gone_since < forget_before:
            continue  # its pods are gone, and have been for long enough
        merged[identity(key)] = key.model_copy(update={"pods": pods, "gone_since": gone_since})
    for ident, key in reported.items():
        kept = merged.get(ident)
        if kept is not None:
            key = key.model_copy(
                update={
                    "count": max(kept.count, key.count),
                    "first_seen": _earliest(kept.first_seen, key.first_seen),
                    "pods": sorted({*key.pods, *kept.pods}),
                }
            )
        merged[ident] = key.model_copy(update={"pods": key.pods[:KEY_PODS], "gone_since": None})
    return bounded(merged.values(), limit)


def _earliest(a: str | None, b: str | None) -> str | None:
    return min(x for x in (a, b) if x) if a or b else None


def sizes(keys: Iterable[LearnedKey]) -> list[int]:
    """The forward token counts serving met a JIT in: the vLLM warm runs them before its
    monitor arms, so they are compiled in the warm and preloaded in serving."""
    return sorted({k.tokens for k in keys if k.tokens})


def document(keys: list[LearnedKey], dropped: int, **about: Any) -> dict[str, Any]:
    """The record as served and as ``--learned`` reads it; ``about``: what serves it. Which
    pods reported a key is the status's business, not the build's: left out."""
    return {
        "kind": KIND,
        **about,
        "keys": [
            k.model_dump(mode="json", by_alias=True, exclude_none=True, exclude=_ATTRIBUTION)
            for k in keys
        ],
        "dropped": dropped,
    }


def parse(
    text: str | bytes, source: str, max_tokens: int | None = None
) -> tuple[list[LearnedKey], int]:
    """The keys and dropped count of a record (or of a ``status.learned``); bad input is one
    ``SpecError`` line naming ``source`` and the field. ``max_tokens``: the engine's most
    tokens per forward; a key past it is no forward of that engine, and refuses the record.
    What a record says of attribution is dropped: the operator attributes."""
    if len(text) > MAX_RECORD_BYTES:
        raise SpecError(f"{source}: too large: more than {MAX_RECORD_BYTES >> 20} MiB")
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
            key = LearnedKey.model_validate(entry)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = "".join(f".{p}" for p in first["loc"])
            got = first.get("input")
            shown = f", got {got!r:.40}" if isinstance(got, (str, int, float)) else ""
            raise SpecError(f"{source}: keys[{index}]{where}: {first['msg']}{shown}") from None
        if max_tokens is not None and key.tokens is not None and key.tokens > max_tokens:
            raise SpecError(
                f"{source}: keys[{index}].tokens: {key.tokens} is more than the engine runs in "
                f"one forward ({max_tokens}, maxNumBatchedTokens)"
            )
        keys.append(key.model_copy(update={"pods": [], "gone_since": None}))
    dropped = data.get("dropped", 0)
    if not isinstance(dropped, int) or isinstance(dropped, bool) or not 0 <= dropped <= COUNT_MAX:
        raise SpecError(f"{source}: dropped: expected a count, got {dropped!r:.40}")
    kept, over = bounded(keys)
    return kept, min(COUNT_MAX, dropped + over)
