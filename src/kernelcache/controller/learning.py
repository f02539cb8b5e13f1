"""Learn from serving: what a KernelCache's ready serving pods still compiled, in its status.

Each resync reads the learned record (``learned.PATH``) from every ready pod labelled with the
KernelCache that names a ``kc-metrics`` port, each with its own deadline (a pod that does not
answer is skipped, never waited for past it), and merges the keys into ``status.learned``
(deduplicated, bounded). Nothing from a pod's cache is read: only the keys travel. The next
compile Job of the KernelCache (a spec or engine-image change) gets them in its spec
ConfigMap and warms them; learning alone starts no build, so a pod meeting a key the warm
cannot reproduce costs no rebuild loop.
"""

from __future__ import annotations

import http.client
import json
import logging
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

from kernelcache import learned
from kernelcache.contract import LABEL_CACHE, PORT_METRICS
from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.kube import Kube, path
from kernelcache.controller.manifests import LEARNED_FILE
from kernelcache.controller.state import Event
from kernelcache.errors import SpecError, one_line
from kernelcache.spec import KernelCache, LearnedKey, LearnedStatus

MAX_PARALLEL = 8  # pods read at once

log = logging.getLogger(__name__)

Fetch = Callable[[str, float], bytes]


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


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return bytes(answer.read(1 << 20))


def read(
    urls: dict[str, str], timeout: float, fetch: Fetch = _get
) -> tuple[dict[str, list[LearnedKey]], int, list[str]]:
    """Each pod's keys, the keys they dropped, and one line per pod that did not answer
    within ``timeout`` or answered something else than a record."""

    def one(item: tuple[str, str]) -> tuple[str, list[LearnedKey] | str, int]:
        pod, url = item
        try:
            keys, dropped = learned.parse(fetch(url, timeout), f"pod {pod} {url}")
        except SpecError as exc:
            return pod, exc.message, 0
        except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts: OSError
            return pod, f"pod {pod} {url}: {one_line(exc)}", 0
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
                records[pod], dropped = answer, dropped + over
    return records, dropped, problems


def merged(
    previous: dict[str, Any] | None,
    records: dict[str, list[LearnedKey]],
    dropped: int,
    now: datetime,
) -> dict[str, Any] | None:
    """``status.learned`` with the pods' keys added (None: nothing learned, ever).

    ``updatedAt`` moves only when the keys do, so a resync that learns nothing new writes
    no status."""
    before = LearnedStatus.model_validate(previous) if previous else LearnedStatus()
    keys, over = learned.merge(before.keys, records.values())
    if not keys and not before.keys:
        return None
    after = LearnedStatus(
        keys=keys,
        dropped=max(before.dropped, dropped + over),
        pods=sorted(records) or before.pods,
        updated_at=before.updated_at,
    )
    if after.keys != before.keys:
        after.updated_at = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return after.model_dump(mode="json", by_alias=True, exclude_none=True)


def _identities(keys: Iterable[LearnedKey]) -> set[learned.Identity]:
    return {learned.identity(k) for k in keys}


def keys_of(status_learned: dict[str, Any] | None) -> list[LearnedKey]:
    return LearnedStatus.model_validate(status_learned).keys if status_learned else []


def events(previous: dict[str, Any] | None, current: dict[str, Any] | None) -> list[Event]:
    """One Normal event when keys appeared that the status did not hold."""
    new = _identities(keys_of(current)) - _identities(keys_of(previous))
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
    records, dropped, problems = read(endpoints(pods), config.learn_timeout_seconds)
    for problem in problems:
        log.info("%s/%s: not learned from %s", namespace, name, problem)
    return merged(previous, records, dropped, now)
