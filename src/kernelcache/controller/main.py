"""kopf registrations: the only module of the operator that knows kopf.

Each handler is a few lines that hand plain arguments to ``handlers/`` and turn the answer
into kopf's terms (events to post, errors that mean "retry later"). Run with
``kernelcache operator`` or ``kopf run -m kernelcache.controller.main``; either way the
configuration comes from ``KERNELCACHE_OPERATOR_*`` (see ``config``), peering included.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

import kopf

from kernelcache.contract import (
    LABEL_CACHE,
    LABEL_CACHE_UID,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    MANAGED_BY,
)
from kernelcache.controller import manifests, metrics, webhook
from kernelcache.controller.config import ENV_PREFIX, OperatorConfig
from kernelcache.controller.handlers.handle_delete_kernelcache import Cleanup, delete_kernelcache
from kernelcache.controller.handlers.handle_reconcile_kernelcache import (
    ConflictError,
    Reconciled,
    reconcile_kernelcache,
)
from kernelcache.controller.handlers.handle_start_operator import ensure_peering
from kernelcache.controller.handlers.handle_update_job import reconcile_job_owner
from kernelcache.controller.handlers.handle_update_nodes import LABELS as NODE_MAP_LABELS
from kernelcache.controller.handlers.handle_update_nodes import publish_node_map
from kernelcache.controller.handlers.handle_update_secret import reconcile_secret_users
from kernelcache.controller.kube import ApiError, Kube, path
from kernelcache.controller.manifests import COMPILE
from kernelcache.errors import StorageError
from kernelcache.nodemap import gpu_labels
from kernelcache.spec import GROUP, PLURAL, VERSION

CONFIG = OperatorConfig.from_env()
KC = (GROUP, VERSION, PLURAL)
COMPILE_JOBS = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_COMPONENT: COMPILE}

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _configure(settings: kopf.OperatorSettings) -> None:
    """Apply CONFIG to kopf: peering, persistence under our own names, threads, events.

    A priority or reporting instance already set (``kopf run --priority``, or settings
    handed to kopf by whoever runs it) is kept when CONFIG does not name one.
    """
    defaults = kopf.OperatorSettings()
    if CONFIG.peering:
        settings.peering.name = CONFIG.peering
        if CONFIG.priority is not None:
            settings.peering.priority = CONFIG.priority
        elif settings.peering.priority == defaults.peering.priority:  # no --priority given
            settings.peering.priority = secrets.randbelow(2**31 - 1) + 1
        settings.peering.lifetime = CONFIG.peering_lifetime_seconds
        settings.peering.mandatory = True
        settings.peering.standalone = False
    else:
        settings.peering.standalone = True
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.execution.max_workers = CONFIG.workers
    settings.execution.default_backoff = CONFIG.resync_seconds
    # A KernelCache deleted while its resync timer runs keeps its finalizer until kopf sees
    # the timer exit, and kopf looks again only after this many seconds (60 by default: a
    # `kubectl delete kc` that hung a minute). One resync takes well under a second.
    settings.background.cancellation_polling = 1.0
    settings.posting.reporting_component = MANAGED_BY
    if settings.posting.reporting_instance == defaults.posting.reporting_instance:
        settings.posting.reporting_instance = socket.gethostname()  # the pod's name
    settings.admission.server = _webhook_server() if CONFIG.webhook_port else _no_webhook_server


def _webhook_server() -> kopf.WebhookServer:
    """HTTPS on webhook_port, with the certificate from webhook_tls_dir (else self-signed)."""
    tls = CONFIG.webhook_tls_dir
    return kopf.WebhookServer(
        addr="0.0.0.0",
        port=CONFIG.webhook_port,
        certfile=f"{tls}/tls.crt" if tls else None,
        pkeyfile=f"{tls}/tls.key" if tls else None,
    )


async def _no_webhook_server(_: Any) -> AsyncIterator[Any]:
    """webhook_port 0: the admission handlers stay registered and nothing serves them (kopf
    refuses to start with admission handlers but no server)."""
    await asyncio.Event().wait()
    yield {}  # never reached: it makes this the async generator kopf expects


def _post(reconciled: Reconciled | None) -> None:
    if reconciled is None:
        return
    body = kopf.Body(cast(kopf.RawBody, reconciled.body))
    for event in reconciled.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


@kopf.on.startup()
def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Configure kopf, connect to the API server, ensure peering, serve /metrics."""
    _configure(settings)
    memo.kube = memo.get("kube") or Kube.from_environment(
        connections=CONFIG.workers + CONFIG.admission_workers
    )
    for problem in ensure_peering(memo.kube, CONFIG):
        logger.warning("%s; kopf keeps this replica paused until it exists", problem)
    if CONFIG.metrics_port:
        metrics.serve(CONFIG.metrics_port)


@kopf.index("batch", "v1", "jobs", labels=COMPILE_JOBS)
def compile_jobs(body: kopf.Body, labels: kopf.Labels, **_: Any) -> dict[str, dict[str, Any]]:
    """Compile Jobs by their KernelCache's uid, kept from the watch: reconciles list nothing."""
    return {labels[LABEL_CACHE_UID]: dict(body)} if LABEL_CACHE_UID in labels else {}


def _jobs_of(kwargs: dict[str, Any]) -> Callable[[str], list[dict[str, Any]]]:
    """The compile_jobs index, which kopf passes to every handler as a keyword of that name."""
    index: kopf.Index[str, dict[str, Any]] = kwargs["compile_jobs"]
    return lambda uid: list(index.get(uid, []))


@kopf.index("", "v1", "nodes")
def gpu_nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, str]]:
    """GPU nodes' feature-discovery labels by node name, kept from the watch."""
    labels = gpu_labels(body)
    return {name: labels} if labels else {}


def _nodes_of(kwargs: dict[str, Any]) -> dict[str, dict[str, str]]:
    index: kopf.Index[str, dict[str, str]] = kwargs["gpu_nodes"]
    return {name: next(iter(labels)) for name, labels in index.items()}


@kopf.index(*KC)
def kernelcache_namespaces(namespace: str | None, name: str, **_: Any) -> dict[str, str]:
    """The namespaces that have a KernelCache (so a node map), kept from the watch: a
    namespace whose last KernelCache is deleted leaves it."""
    return {namespace: name} if namespace else {}


def _publish_node_maps(kube: Kube, namespaces: list[str], kwargs: dict[str, Any]) -> None:
    """Write the node map of each namespace that has a KernelCache; from an event (not
    retried) a failure is one warning, and the next resync writes it."""
    index: kopf.Index[str, str] = kwargs["kernelcache_namespaces"]
    for namespace in namespaces:
        if namespace not in index:
            continue
        try:
            publish_node_map(kube, namespace, _nodes_of(kwargs))
        except ApiError as exc:
            logger.warning(
                "node map of %s not written (%s); the next resync writes it", namespace, exc
            )


@kopf.on.event("", "v1", "nodes")
def node_changed(type: str | None, memo: kopf.Memo, **kwargs: Any) -> None:
    """A node came, went or was relabelled: update the maps of the namespaces that have one."""
    if type is None:
        return  # the initial listing: each namespace's first reconcile writes its map
    _publish_node_maps(memo.kube, list(kwargs["kernelcache_namespaces"]), kwargs)


@kopf.on.event("", "v1", "configmaps", labels=NODE_MAP_LABELS)
def node_map_changed(
    type: str | None, namespace: str | None, memo: kopf.Memo, **kwargs: Any
) -> None:
    """A node map was deleted (a GitOps prune): write it again while its namespace has a
    KernelCache, rather than leave every new pod there without its node's arch."""
    if type == "DELETED" and namespace:
        _publish_node_maps(memo.kube, [namespace], kwargs)


@kopf.on.resume(*KC)
@kopf.on.create(*KC)
@kopf.on.update(*KC, field="spec")
@kopf.timer(*KC, interval=CONFIG.resync_seconds, initial_delay=CONFIG.resync_seconds)
def reconcile(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    """Bring a KernelCache's claim, spec ConfigMap and compile Jobs in line; write status;
    give its namespace the node map its serving pods read."""
    try:
        reconciled = reconcile_kernelcache(memo.kube, CONFIG, dict(body), _jobs_of(kwargs))
    except ConflictError as exc:  # other writers kept winning: kopf retries, one line said
        raise kopf.TemporaryError(str(exc), delay=1) from exc
    _post(reconciled)
    publish_node_map(memo.kube, body["metadata"]["namespace"], _nodes_of(kwargs))


@kopf.on.event("batch", "v1", "jobs", labels=COMPILE_JOBS)
def job_changed(type: str | None, body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    """A compile Job started, finished or failed: reconcile its KernelCache."""
    if type is None:
        return  # the initial listing: resuming each KernelCache covers it
    try:
        _post(reconcile_job_owner(memo.kube, CONFIG, dict(body), _jobs_of(kwargs)))
    except ConflictError as exc:  # an event is not retried: the resync timer reconciles it
        logger.warning("%s; the next resync reconciles it", exc)


@kopf.on.event("", "v1", "secrets")
def secret_changed(
    type: str | None, namespace: str | None, name: str, memo: kopf.Memo, **kwargs: Any
) -> None:
    """A Secret changed: reconcile the KernelCaches that sign with it (a rotated key)."""
    if type is None or namespace is None:
        return  # the initial listing: resuming each KernelCache covers it
    for done in reconcile_secret_users(memo.kube, CONFIG, namespace, name, _jobs_of(kwargs)):
        _post(done)


@kopf.on.delete(*KC)
def delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Finalizer: stop compile Jobs; drop the data if retention.deleteDataOnDelete says so."""
    done = delete_kernelcache(memo.kube, CONFIG, dict(body))
    if done.outcome is Cleanup.WAITING:
        raise kopf.TemporaryError(done.message, delay=CONFIG.cleanup_poll_seconds)
    failed = done.outcome is Cleanup.FAILED
    kopf.event(body, type="Warning" if failed else "Normal", reason="Deleted", message=done.message)


def _operation(kwargs: dict[str, Any]) -> str:
    """The admission request's operation (kopf passes it, outside its typed protocol)."""
    return str(kwargs.get("operation") or "CREATE")


# Admission is answered on these threads, never on kopf's handler threads: those run the
# reconciles, and a reconcile may wait on the API server or a serving pod for its deadline.
# With every reconcile worker busy, a labelled pod anywhere would wait behind them and be
# refused by the API server's webhook timeout (failurePolicy Fail).
ADMISSION = ThreadPoolExecutor(
    max_workers=CONFIG.admission_workers, thread_name_prefix="kernelcache-admission"
)


async def _admitting(call: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(ADMISSION, call)


@kopf.on.mutate("pods", labels={LABEL_CACHE: kopf.PRESENT}, operations=["CREATE"])
async def inject(
    body: kopf.Body, patch: kopf.Patch, warnings: list[str], memo: kopf.Memo, **kwargs: Any
) -> None:
    """A labelled serving pod: add the verify init-container, the cache volumes and env."""
    pod, operation = dict(body), _operation(kwargs)
    ops = await _admitting(lambda: _inject(memo.kube, pod, operation, warnings))
    if ops:
        patch["spec"] = webhook.spec_patch(pod, ops)


def _inject(kube: Kube, pod: dict[str, Any], operation: str, warnings: list[str]) -> list[Any]:
    said = len(warnings)
    try:
        kc = webhook.lookup(pod, kube.get, operation)
        ops = webhook.mutate_pod(pod, kc, CONFIG, operation=operation, warnings=warnings)
    except webhook.Denied as exc:
        raise kopf.AdmissionError(str(exc), code=403) from None
    about = webhook.life_cycle_object(kc)
    if ops and about is not None and len(warnings) > said:
        _warn(kube, about, "DeletedKernelCache", warnings[said])
    return list(ops)


def _warn(kube: Kube, about: dict[str, Any], reason: str, message: str) -> None:
    """A deleted (or deleting) KernelCache's pod: its admission warning, also as a Warning
    event on the record (or the KernelCache), since the pod may have no name yet. Posted with
    the operator's client (kopf.event works only in resource handlers); best effort, since a
    lost event must not refuse the pod."""
    try:
        event = manifests.warning_event(about, reason, message)
        kube.create(path("v1", "events", about["metadata"]["namespace"]), event)
    except ApiError as exc:
        logger.warning("cannot post the %s event (%s): %s", reason, exc, message)


@kopf.on.validate(*KC, operations=["CREATE", "UPDATE"])
async def validate(body: kopf.Body, **kwargs: Any) -> None:
    """Refuse a KernelCache the CRD schema lets through, naming the field."""
    obj, operation = dict(body), _operation(kwargs)
    await _admitting(lambda: _validate(obj, operation))


def _validate(obj: dict[str, Any], operation: str) -> None:
    try:
        webhook.validate_kernelcache(obj, operation, CONFIG)
    except webhook.Denied as exc:
        raise kopf.AdmissionError(str(exc), code=422) from None


@kopf.on.probe(id="reconciles")
def reconciles(**_: Any) -> float:
    """Liveness detail: reconciles so far."""
    return metrics.reconciles_total()


def peering_identity() -> str:
    """This replica's name among its peers: ``POD_ID`` if set (kopf's own convention), else
    the host name (the pod's name) with a random suffix.

    kopf's default asks ``getpass.getuser()``, which raises for a uid without a passwd entry:
    the image's own user (65532 in python:3.12-slim) and any uid a platform assigns
    (OpenShift's restricted policy) would crash-loop the operator at start.
    """
    return os.environ.get("POD_ID") or f"{socket.gethostname()}/{secrets.token_hex(3)}"


def wait_for_api(
    kube: Kube, deadline_s: float, retry_s: float = 2.0, say: Callable[[str], None] | None = None
) -> None:
    """Return once the API server answers. One that does not is one line (``say``: stderr),
    then quiet retries every ``retry_s`` until ``deadline_s``, then one ``StorageError``
    (exit 10): kopf would print its retry loop's chained tracebacks for ever."""
    say = say or (lambda line: print(f"kernelcache: {line}", file=sys.stderr, flush=True))
    started, said = time.monotonic(), False
    while True:
        try:
            kube.reach()
            return
        except StorageError as exc:
            left = deadline_s - (time.monotonic() - started)
            if left <= 0:
                raise StorageError(
                    f"{exc.message}; gave up after {deadline_s:g} s ({ENV_PREFIX}STARTUP_SECONDS)",
                    path=exc.path,
                ) from None
            if not said:
                say(f"{exc.message}; retrying every {retry_s:g} s for up to {left:.0f} s")
                said = True
            time.sleep(min(retry_s, left))


def run(verbose: bool = False) -> int:
    """Run the operator in this thread until it is stopped (SIGTERM, SIGINT). No credentials
    for a cluster is one line and exit 10 here, before kopf would retry it every minute."""
    kube = Kube.from_environment(connections=CONFIG.workers + CONFIG.admission_workers)
    wait_for_api(kube, CONFIG.startup_seconds)
    kopf.configure(verbose=verbose)
    kopf.run(
        memo=kopf.Memo(kube=kube),
        clusterwide=not CONFIG.namespaces,
        namespaces=list(CONFIG.namespaces),
        liveness_endpoint=CONFIG.liveness or None,
        identity=cast(Any, peering_identity()),  # kopf's Identity: a str NewType
    )
    return 0
