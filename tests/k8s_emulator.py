"""A test double for the Kubernetes API server: kmock's emulator plus what our clients need.

No API server can run where these tests run (no kube-apiserver, kind, k3s or Docker engine),
so the operator's integration tests run kopf for real against kmock's in-memory Kubernetes
emulator over HTTP. kmock 0.8 stores objects as plain JSON; this subclass adds the parts of
API-server behaviour that kopf, the operator and kubectl rely on:

- ``uid``, ``creationTimestamp``, ``generateName``, ``metadata.generation`` (bumped when
  anything but metadata and status changes) and ``resourceVersion`` (one global counter,
  bumped by every write);
- optimistic concurrency: a merge patch that carries a stale ``metadata.resourceVersion``
  gets 409, a JSON patch whose ``test`` op fails gets 422 (kopf removes finalizers that way);
- the status subresource: ``/status`` writes change only ``status``, other writes never do;
- ``labelSelector`` on lists and watches, a list's ``resourceVersion``, and watches that
  resume from it without losing writes (kmock replays the objects first and subscribes to
  new events only afterwards, dropping whatever happened in between);
- lookups by key: kmock finds the object a fetch, list or write is about by scanning every
  object of every kind, which a benchmark with thousands of objects cannot afford;
- what ``kubectl apply`` and ``kubectl get`` need of a custom resource: a
  CustomResourceDefinition written through the API is served in discovery like one passed to
  ``declare``, with its short names (its subresources without them); lists carry their
  ``kind``; a fetch or list asked for as a ``meta.k8s.io/v1`` Table (kubectl's
  ``Accept: application/json;as=Table;...``) is rendered from the CRD's
  ``additionalPrinterColumns`` (simple ``.a.b`` JSONPaths only; built-in kinds get plain JSON,
  which kubectl prints itself);
- what ``kubectl apply --server-side`` needs: a PATCH of ``application/apply-patch+yaml``
  creates the object if it is missing and is otherwise merged into it as a JSON merge patch
  (no field managers: no ``managedFields``, no apply conflicts, and a field dropped from the
  applied configuration is not removed); the core group's discovery (``/api/v1``) names its
  group version ``v1``, as kubectl needs to map built-in kinds (kmock says ``/v1``);
- opt-in, a mutating admission webhook for Pods: with ``pod_webhook`` set to a URL (plain
  HTTP, such as kopf's ``WebhookServer(insecure=True)``), every Pod created (POST) is first
  sent there as an ``admission.k8s.io/v1`` AdmissionReview; a returned JSON patch is applied
  to the Pod before it is stored, and a refusal fails the create with the webhook's code and
  message, as the API server words it. Unset (the default), Pods are stored as sent.

It does not validate objects against schemas (kubectl needs ``--validate=false``: no OpenAPI
document is served), stop serving a deleted CRD's resource, run controllers (no Job ever
starts: tests write Job status themselves) or collect garbage by owner references. kmock
also mis-parses ``/api/v1/namespaces``; nothing here needs it (the operator watches either
every namespace or namespaces named exactly, never a glob), so it is left alone.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import copy
import json
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import yaml
from kmock import Payload, Request, action

from tests.conftest import scaled

_WRITES = (action.CREATE, action.UPDATE, action.DELETE)


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge, None deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def label_selected(obj: dict[str, Any], selector: str | None) -> bool:
    """Equality-based selectors (``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``), comma-joined."""
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            ok = labels.get(key.strip()) != value.strip()
        elif "=" in term:
            key, value = term.split("=", 1)
            ok = labels.get(key.strip()) == value.lstrip("=").strip()
        elif term.startswith("!"):
            ok = term[1:] not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def _conflict(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


@attrs.define(kw_only=True)
class KubernetesEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with resource versions, generations, concurrency and selectors."""

    # kmock routes each request by scanning every request served so far; a long benchmark
    # turns this off to forget requests once answered (tests keep them to assert on).
    keep_requests: bool = True
    # Watch requests served, by resource plural: a client is ready once its watches arrived.
    watches: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)
    _revision: int = attrs.field(default=0, init=False)
    # Object keys by resource, so lists and watches need not scan every object of every kind
    # (objects enter through the API: tests never write kmock's store directly).
    _keys: collections.defaultdict[Any, dict[Any, None]] = attrs.field(
        factory=lambda: collections.defaultdict(dict), init=False
    )
    _writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    # additionalPrinterColumns of each declared custom resource, by "group/version/plural".
    _columns: dict[str, list[dict[str, Any]]] = attrs.field(factory=dict, init=False)
    # URL of a mutating admission webhook every Pod creation goes through; None: none.
    pod_webhook: str | None = None

    def declare(self, crd: dict[str, Any]) -> None:
        """Serve a CustomResourceDefinition's resource (discovery only: schemas are not checked)."""
        spec, names = crd["spec"], crd["spec"]["names"]
        for version in spec["versions"]:
            key = f"{spec['group']}/{version['name']}/{names['plural']}"
            self._columns[key] = list(version.get("additionalPrinterColumns") or ())
            self.resources[key] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular"),
                namespaced=spec["scope"] == "Namespaced",
                shortnames=set(names.get("shortNames") or ()),
                categories=set(names.get("categories") or ()),
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                subresources=set(version.get("subresources") or ()),
            )

    async def _serve_server_version(self, request: Request) -> Payload:
        """The version of the kubectl and helm the tests run (kmock says 1.26), which the
        chart's kubeVersion admits: ``helm template --dry-run=server`` asks it."""
        version: Any = await super()._serve_server_version(request)
        return {**version, "minor": "35", "gitVersion": "v1.35.0"}

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    async def _handle(self, request: Request) -> aiohttp.web.StreamResponse:
        try:
            if _is_apply(request):
                self._as_apply(request)
            if request.resource is None or request.action not in _WRITES:
                return await super()._handle(request)
            if self.pod_webhook and _is_pod_create(request):
                try:
                    object.__setattr__(request, "data", await self._pod_admission(request))
                except kmock.KubernetesError as exc:
                    return await self._render_error(exc)
            # Writes are serialised so the object a write is computed from is still the
            # latest when kmock stores it (kmock applies it later, under its own lock).
            async with self._writes:
                try:
                    data = self._admit(request)
                except kmock.KubernetesError as exc:
                    return await self._render_error(exc)
                # kmock routes a request by its identity, so the admitted body replaces the
                # parsed one in place rather than in a copy of the (frozen) request.
                object.__setattr__(request, "data", data)
                return await super()._handle(request)
        finally:
            if not self.keep_requests:
                self._requests.remove(request)

    async def _pod_admission(self, request: Request) -> Any:
        """The Pod a create stores once ``pod_webhook`` admitted it (patched); raise if refused.

        Called outside the write lock: the webhook may read from this API server meanwhile.
        """
        assert self.pod_webhook is not None
        pod = copy.deepcopy(request.data)
        if request.namespace:
            pod.setdefault("metadata", {})["namespace"] = request.namespace
        review = admission_review(
            pod,
            {"group": "", "version": "v1", "kind": "Pod"},
            {"group": "", "version": "v1", "resource": "pods"},
            request.namespace or "",
            ("kubernetes-admin", ["system:masters"]),
        )
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.pod_webhook, json=review) as reply,
        ):
            reply.raise_for_status()
            answer = (await reply.json())["response"]
        if not answer.get("allowed"):
            status = answer.get("status") or {}
            message = f'admission webhook "{self.pod_webhook}" denied the request: '
            message += str(status.get("message") or "")
            raise _conflict(int(status.get("code") or 403), "Forbidden", message)
        if answer.get("patch"):
            ops = json.loads(base64.b64decode(answer["patch"]))
            pod = jsonpatch.apply_patch(pod, ops)
        return pod

    def _as_apply(self, request: Request) -> None:
        """Turn a server-side apply into the create or merge patch it amounts to, in place.

        The applied object is merged into the live one as a JSON merge patch: no field
        ownership (``managedFields``) is tracked, so there are no apply conflicts, and a field
        dropped from the applied configuration stays on the live object.
        """
        data = request.data
        if data is None:  # the body is YAML when not JSON (kubectl sends JSON)
            data = yaml.safe_load(request.text)
        key = (request.resource, request.namespace, request.name)
        if request.subresource is None and (key not in self._objects or self._objects[key].deleted):
            object.__setattr__(request, "action", action.CREATE)
        object.__setattr__(request, "data", data)

    def _admit(self, request: Request) -> Any:
        """The body kmock should store for a write, completed as an API server would."""
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        if request.action == action.CREATE:
            body = copy.deepcopy(request.data)
            meta = body.setdefault("metadata", {})
            if request.namespace:
                meta["namespace"] = request.namespace
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = self._generated_name(request, meta)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now, generation=1)
            meta["resourceVersion"] = self._next_revision()
            key = (request.resource, request.namespace or meta.get("namespace"), meta["name"])
            self._keys[request.resource][key] = None
            self._declare_if_crd(request, body)
            return body
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return request.data  # kmock answers 404
        current = self._objects[key].raw
        if request.action == action.DELETE:
            self._objects[key].patch({"metadata": {"resourceVersion": self._next_revision()}})
            return request.data
        new = self._updated(request, current)
        self._declare_if_crd(request, new)
        return [{"op": "replace", "path": "", "value": new}]

    def _generated_name(self, request: Request, meta: dict[str, Any]) -> str:
        """``generateName`` plus 5 random characters, drawn again while the name is taken (as
        the API server retries since Kubernetes 1.32), so thousands of Events do not collide."""
        while True:
            name = meta["generateName"] + uuid.uuid4().hex[:5]
            key = (request.resource, meta.get("namespace"), name)
            if key not in self._objects or self._objects[key].deleted:
                return str(name)

    def _declare_if_crd(self, request: Request, obj: dict[str, Any]) -> None:
        """A CustomResourceDefinition written through the API serves its resource, as declared."""
        resource = request.resource
        if (
            resource is not None
            and (resource.group, resource.plural)
            == ("apiextensions.k8s.io", "customresourcedefinitions")
            and request.subresource is None
        ):
            self.declare(obj)

    def _updated(self, request: Request, current: dict[str, Any]) -> dict[str, Any]:
        patch = request.data
        if isinstance(patch, list):
            try:
                new = jsonpatch.apply_patch(current, patch)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                raise _conflict(422, "Invalid", f"the JSON patch does not apply: {exc}") from None
        else:
            expected = (patch.get("metadata") or {}).get("resourceVersion")
            if expected is not None and expected != current["metadata"]["resourceVersion"]:
                raise _conflict(409, "Conflict", "the object has been modified")
            new = _merge_patch(current, patch)
        info = self.resources.get(request.resource)
        if request.subresource == "status":
            new = {**current, "status": new.get("status")}
        elif info is not None and "status" in info.subresources:
            new["status"] = current.get("status")
        if new.get("status") is None:
            new.pop("status", None)
        meta = new["metadata"]
        for fixed in ("uid", "name", "namespace", "creationTimestamp", "generation"):
            if fixed in current["metadata"]:
                meta[fixed] = current["metadata"][fixed]
        if _content(new) != _content(current):
            meta["generation"] = current["metadata"].get("generation", 1) + 1
        meta["resourceVersion"] = self._next_revision()
        return new

    def _current(self, request: Request) -> list[dict[str, Any]]:
        """The live objects of the request's resource, in its namespace if it names one."""
        return [
            obj.raw
            for key in self._keys[request.resource]
            if request.namespace is None or key[1] == request.namespace
            if not (obj := self._objects[key]).deleted
        ]

    # kmock answers a fetch or a write by scanning every object for the one addressed; these
    # look it up by key instead (the write itself is done in kmock's _handle either way).
    async def _serve_fetch(self, request: Request) -> Payload:
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        obj = self._objects[key].raw
        return self._table(request, [obj], {}) or obj

    async def _serve_create(self, request: Request) -> Payload:
        meta = request.data["metadata"]
        return self._objects[request.resource, meta.get("namespace"), meta["name"]].last.raw

    async def _serve_update(self, request: Request) -> Payload:
        return self._objects[request.resource, request.namespace, request.name].last.raw

    _serve_delete = _serve_update

    async def _serve_list(self, request: Request) -> Payload:
        resource = request.resource
        if resource is None or resource not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        selector = request.params.get("labelSelector")
        items = [obj for obj in self._current(request) if label_selected(obj, selector)]
        meta = {"resourceVersion": str(self._revision)}
        kind = getattr(self.resources[resource], "kind", None) or ""
        group, version = resource.group, resource.version
        return self._table(request, items, meta) or {
            "apiVersion": f"{group}/{version}" if group else version,
            "kind": f"{kind}List",
            "metadata": meta,
            "items": items,
        }

    async def _serve_version(self, request: Request) -> Payload:
        # kmock lists a subresource (kernelcaches/status) with its resource's short names;
        # the API server gives them none, and kubectl warns of an ambiguous short name.
        listing: Any = await super()._serve_version(request)
        if listing["groupVersion"].startswith("/"):  # the core group: "v1", not "/v1"
            listing["groupVersion"] = listing["groupVersion"][1:]
        for entry in listing["resources"]:
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[])
        return listing

    def _table(
        self, request: Request, objs: list[dict[str, Any]], meta: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Objects as the Table kubectl asks for, for a declared custom resource; else None.

        As the API server's table converter for custom resources: a Name column, then the
        printer columns; ``date`` columns print as an age; a missing value is null.
        """
        accept = next((v for k, v in request.headers.items() if k.lower() == "accept"), "")
        resource = request.resource
        if "as=Table" not in accept or resource is None:
            return None
        columns = self._columns.get(f"{resource.group}/{resource.version}/{resource.plural}")
        if columns is None:
            return None
        include = request.params.get("includeObject") or "Metadata"
        definitions = [{"name": "Name", "type": "string", "format": "name", "priority": 0}]
        definitions += [
            {
                "name": c["name"],
                "type": c["type"],
                "format": c.get("format", ""),
                "description": c.get("description", ""),
                "priority": c.get("priority", 0),
            }
            for c in columns
        ]
        rows = []
        for obj in objs:
            cells: list[Any] = [obj["metadata"]["name"]]
            cells += [_cell(obj, c["jsonPath"], c["type"]) for c in columns]
            row: dict[str, Any] = {"cells": cells}
            if include == "Object":
                row["object"] = obj
            elif include != "None":
                partial = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1"}
                row["object"] = {**partial, "metadata": obj["metadata"]}
            rows.append(row)
        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": meta,
            "columnDefinitions": definitions,
            "rows": rows,
        }

    async def _serve_watch(self, request: Request) -> AsyncIterator[Payload]:
        yield b""  # send the headers now, even if nothing happens for a while
        assert request.resource is not None
        selector = request.params.get("labelSelector")
        since = int(request.params.get("resourceVersion") or 0)

        def wanted(obj: dict[str, Any]) -> bool:
            namespace = obj.get("metadata", {}).get("namespace")
            in_scope = request.namespace is None or namespace == request.namespace
            return in_scope and label_selected(obj, selector)

        self.watches[request.resource.plural or ""] += 1
        bus = self._buses[request.resource]
        async with self._lock:  # writes publish under this lock: nothing slips in between
            mark = await bus.mark()
            replay = self._current(request)
        try:
            for raw in replay:
                if int(raw["metadata"].get("resourceVersion", 0)) > since and wanted(raw):
                    yield {"type": "ADDED", "object": raw}
            async for event in bus.stream(since=mark):
                if wanted(event["object"]):
                    yield event
        finally:
            await bus.unmark(mark)


def _is_pod_create(request: Request) -> bool:
    """Whether the request creates a Pod (not a subresource of one)."""
    resource = request.resource
    return (
        request.action == action.CREATE
        and request.subresource is None
        and resource is not None
        and (resource.group, resource.plural) == ("", "pods")
    )


def _is_apply(request: Request) -> bool:
    """Whether the request is a server-side apply (a PATCH of ``application/apply-patch+yaml``)."""
    content_type = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
    return request.action == action.UPDATE and content_type.split(";")[0].strip() == (
        "application/apply-patch+yaml"
    )


def _cell(obj: dict[str, Any], json_path: str, kind: str) -> Any:
    """The value at a simple JSONPath (``.a.b``) as a table cell: None when missing."""
    value: Any = obj
    for part in json_path.strip().removeprefix("{").removesuffix("}").strip(".").split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if kind == "date" and isinstance(value, str):
        try:
            then = datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
        except ValueError:
            return "<unknown>"
        return _age((datetime.now(timezone.utc) - then).total_seconds())
    return json.dumps(value) if isinstance(value, (dict, list)) else value


def _age(seconds: float) -> str:
    """A duration as kubectl's AGE column prints it (k8s.io/apimachinery HumanDuration)."""
    s = max(int(seconds), 0)
    m, h, d = s // 60, s // 3600, s // 86400
    if s < 120:
        return f"{s}s"
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if h < 192:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    return f"{d}d"


def _content(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@contextmanager
def serving(
    emulator_factory: Callable[[], KubernetesEmulator] = KubernetesEmulator,
) -> Iterator[Any]:
    """Serve a fresh emulator on a local port from a thread of its own; yield (emulator, url).

    The emulator runs in its own event loop so that synchronous tests, the kubernetes client
    and kopf's own thread can all talk to it over HTTP.
    """
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        holder["stop"] = (asyncio.get_running_loop(), stop)
        async with emulator_factory() as emulator, kmock.Server(emulator) as server:
            holder["emulator"], holder["url"] = emulator, str(server.url).rstrip("/")
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="k8s-emulator")
    thread.start()
    if not ready.wait(timeout=scaled(10)):
        raise RuntimeError("the Kubernetes emulator did not start")
    try:
        yield holder["emulator"], holder["url"]
    finally:
        loop, stop = holder["stop"]
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)


def admission_review(
    obj: dict[str, Any],
    kind: dict[str, str],
    resource: dict[str, str],
    namespace: str,
    user: tuple[str, list[str]],
) -> dict[str, Any]:
    """The AdmissionReview the API server posts to a webhook for the CREATE of ``obj``."""
    username, groups = user
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": kind,
            "resource": resource,
            "requestKind": kind,
            "requestResource": resource,
            "name": obj["metadata"].get("name", ""),
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": username, "groups": groups},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }
