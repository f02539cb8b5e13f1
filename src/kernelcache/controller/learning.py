"""Learn from serving: what a KernelCache's ready serving pods still compiled, in its status.

Each resync reads the learned record (``learned.PATH``) from every ready pod labelled with the
KernelCache that names a ``kc-metrics`` port, and merges the keys into ``status.learned``.
What a pod sends is untrusted input, so one pod's report costs the operator a fixed budget:
all pods are read at once against one deadline for the whole read (``peer``: connect, headers
and body; a pod that trickles bytes is cut off there), at most ``learned.MAX_RECORD_BYTES``
each, no redirect followed; values are bounded by the CRD schema and the engine's
configuration (a token count past what one forward runs refuses the record); each pod gets a
fair share of the bounded keys, so its counts cannot evict another pod's keys; and a key is
attributed to the pods that reported it and ages out once none of them exists. Nothing from a
pod's cache is read: only the keys travel. The next compile Job of the KernelCache (a spec or
engine-image change) gets them in its spec ConfigMap and warms them; learning alone starts no
build, so a pod meeting a key the warm cannot reproduce costs no rebuild loop.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

from kernelcache import learned
from kernelcache.contract import LABEL_CACHE, PORT_METRICS
from kernelcache.controller import peer
from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.kube import Kube, path
from kernelcache.controller.manifests import LEARNED_FILE
from kernelcache.controller.state import Event
from kernelcache.errors import SpecError
from kernelcache.spec import LEARNED_PODS_MAX, KernelCache, LearnedKey, LearnedStatus

MAX_PARALLEL = 16  # pods read at once: all of them share one deadline

log = logging.getLogger(__name__)

# (url, seconds left): the answer's body, or a ``peer.PeerError``.
Fetch = Callable[[str, float], bytes]

# A pod whose last answer was not a record is left alone this long, doubling with each
# failure up to the most: a pod that trickles costs a worker one deadline per back-off,
# not one per resync, so a few such pods cannot take a share of the workers that every
# other KernelCache needs.
BACKOFF_FIRST_S, BACKOFF_MOST_S = 60.0, 900.0


class Backoff:
    """The pods (by URL) whose last read failed, and until when they are not read. Bounded:
    an entry goes once its pod answers, or once its back-off has long passed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._until: dict[str, tuple[float, float]] = {}  # url -> (until, last delay)

    def left(self, url: str) -> float:
        with self._lock:
            until, _ = self._until.get(url, (0.0, 0.0))
            return max(0.0, until - self._clock())

    def failed(self, url: str) -> float:
        with self._lock:
            now = self._clock()
            for stale in [
                u for u, (until, _) in self._until.items() if until + BACKOFF_MOST_S < now
            ]:
                del self._until[stale]
            _, last = self._until.get(url, (0.0, 0.0))
            delay = min(BACKOFF_MOST_S, 2 * last) if last else BACKOFF_FIRST_S
            self._until[url] = (now + delay, delay)
            return delay

    def answered(self, url: str) -> None:
        with self._lock:
            self._until.pop(url, None)


BACKOFF = Backoff()


def endpoints(pods: Iterable[dict[str, Any]]) -> dict[str, str]:
    """The record's URL of each ready, running pod with a ``kc-metrics`` port, by pod name."""
    found = {}
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        ip = status.get("podIP")
        port = next(
            (
                p.get("containerPort")
                for c in (pod.get("spec") or {}).get("containers") or []
                for p in c.get("ports") or []
                if p.get("name") == PORT_METRICS
            ),
            None,
        )
        if ready and ip and port and status.get("phase") == "Running":
            host = f"[{ip}]" if ":" in ip else ip
            found[pod["metadata"]["name"]] = f"http://{host}:{port}{learned.PATH}"
    return found


def _get(url: str, budget: float) -> bytes:
    return peer.get(url, budget, learned.MAX_RECORD_BYTES)


def read(
    urls: dict[str, str],
    timeout: float,
    fetch: Fetch = _get,
    max_tokens: int | None = None,
    backoff: Backoff = BACKOFF,
) -> tuple[dict[str, list[LearnedKey]], int, list[str]]:
    """Each pod's keys, the keys they dropped, and one line per pod that did not answer a
    whole record by the deadline (``timeout`` after the read began, for all pods together)
    or answered something else than a record (``max_tokens``: the engine's most tokens per
    forward); such a pod is not read again until its ``backoff`` passes."""
    deadline = time.monotonic() + timeout

    def one(item: tuple[str, str]) -> tuple[str, list[LearnedKey] | str, int]:
        pod, url = item
        if wait := backoff.left(url):
            return (
                pod,
                f"pod {pod} {url}: not read for {wait:.0f} s more (its last answer failed)",
                0,
            )
        left = deadline - time.monotonic()
        if left <= 0:  # more pods than readers, and the deadline passed before its turn
            return pod, f"pod {pod} {url}: not read: the {timeout:g} s deadline passed", 0
        try:
            keys, dropped = learned.parse(fetch(url, left), f"pod {pod} {url}", max_tokens)
        except (SpecError, peer.PeerError) as exc:
            why = exc.message if isinstance(exc, SpecError) else f"pod {pod} {url}: {exc}"
            return pod, f"{why}; not read for {backoff.failed(url):.0f} s", 0
        backoff.answered(url)
        return pod, keys, dropped

    records: dict[str, list[LearnedKey]] = {}
    problems: list[str] = []
    dropped = 0
    if not urls:
        return records, dropped, problems
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(urls))) as pool:
        for pod, answer, over in pool.map(one, sorted(urls.items())):
            if isinstance(answer, str):
                problems.append(answer)
            else:
                records[pod], dropped = answer, min(learned.COUNT_MAX, dropped + over)
    return records, dropped, problems


def _stamp(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def merged(
    previous: dict[str, Any] | None,
    records: dict[str, list[LearnedKey]],
    dropped: int,
    now: datetime,
    alive: Collection[str] | None = None,
    forget_seconds: float = 0,
) -> dict[str, Any] | None:
    """``status.learned`` with the pods' keys added (None: nothing learned, ever). ``alive``:
    the KernelCache's pods now; a key none of whose pods is among them ages out
    ``forget_seconds`` after it was last reported.

    ``updatedAt`` moves only when the keys do, so a resync that learns nothing new writes
    no status."""
    before = LearnedStatus.model_validate(previous) if previous else LearnedStatus()
    keys, over = learned.merge(
        before.keys,
        records,
        now=_stamp(now),
        alive=alive,
        forget_before=_stamp(now - timedelta(seconds=forget_seconds)),
    )
    if not keys and not before.keys:
        return None
    after = LearnedStatus(
        keys=keys,
        dropped=min(learned.COUNT_MAX, max(before.dropped, dropped + over)),
        pods=sorted(records)[:LEARNED_PODS_MAX] or before.pods,
        updated_at=before.updated_at,
    )
    if after.keys != before.keys:
        after.updated_at = _stamp(now)
    return after.model_dump(mode="json", by_alias=True, exclude_none=True)


def keys_of(status_learned: dict[str, Any] | None) -> list[LearnedKey]:
    return LearnedStatus.model_validate(status_learned).keys if status_learned else []


def events(previous: dict[str, Any] | None, current: dict[str, Any] | None) -> list[Event]:
    """One Normal event when keys appeared that the status did not hold."""
    new = learned.identities(keys_of(current)) - learned.identities(keys_of(previous))
    if not new:
        return []
    return [
        Event(
            "Normal",
            "Learned",
            f"learned {len(new)} specialization{'s' if len(new) != 1 else ''} from serving: "
            "the next build warms them",
        )
    ]


def configmap_data(status_learned: dict[str, Any] | None) -> dict[str, str]:
    """What the spec ConfigMap of the next build holds of it (nothing when nothing was
    learned); the compile Job reads it through ``KERNELCACHE_LEARNED``."""
    keys = keys_of(status_learned)
    if not keys:
        return {}
    return {LEARNED_FILE: json.dumps(learned.document(keys, 0), sort_keys=True)}


def learn(
    kube: Kube,
    config: OperatorConfig,
    kc: KernelCache,
    previous: dict[str, Any] | None,
    now: datetime,
) -> dict[str, Any] | None:
    """``status.learned`` after reading the KernelCache's ready serving pods (``previous`` as
    it is when ``learn_timeout_seconds`` is 0: learning off)."""
    if not config.learn_timeout_seconds:
        return previous
    namespace, name = kc.metadata.namespace, kc.metadata.name
    pods = kube.list(path("v1", "pods", namespace), f"{LABEL_CACHE}={name}")
    records, dropped, problems = read(
        endpoints(pods), config.learn_timeout_seconds, max_tokens=kc.spec.max_forward_tokens()
    )
    for problem in problems:
        log.info("%s/%s: not learned from %s", namespace, name, problem)
    alive = {pod["metadata"]["name"] for pod in pods}
    return merged(previous, records, dropped, now, alive, config.learn_forget_seconds)
