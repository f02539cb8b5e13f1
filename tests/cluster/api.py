"""The API server's gate: bearer tokens, RBAC from the stored roles, and the admission chain.

``ClusterAPI`` is the emulator of ``tests.k8s_emulator`` with, in front of every request:

- authentication: a bearer token names a user (``tokens``); the kubelet mints one per pod
  for its service account (``system:serviceaccount:NS:NAME``); no or an unknown token: 401;
- authorization, as the RBAC authorizer decides it: the stored ClusterRoles, Roles and their
  bindings, for the request's verb, API group, resource (``pods/status``), namespace and
  name; ``system:masters`` may do anything; discovery is open to everyone. Refused: 403 with
  the API server's wording;
- admission on CREATE, from the stored MutatingWebhookConfigurations then the
  ValidatingWebhookConfigurations: each webhook whose rules and ``objectSelector`` match is
  called over HTTPS at its Service (the endpoints of Running pods behind it; pods share the
  host's network, so a pod's container port is a port of 127.0.0.1), trusting its
  ``caBundle`` and checking the certificate for ``SERVICE.NAMESPACE.svc``; a returned JSON
  patch is applied; a refusal or, under ``failurePolicy: Fail``, a call that fails refuses
  the create as the API server words it.

``tls_front`` serves the same API over HTTPS (a certificate for 127.0.0.1 signed by a CA of
its own), which is what in-cluster clients (kopf, the kubernetes client) insist on.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import ipaddress
import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import jsonpatch
import kmock
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kmock import Request, action

from tests.k8s_emulator import KubernetesEmulator, admission_review, label_selected

ADMIN = "admin"
RBAC = "rbac.authorization.k8s.io"
ADMISSION = "admissionregistration.k8s.io"


def _verb(request: Request) -> str:
    method = request.method.value
    if method == "GET":
        watching = request.params.get("watch") in ("true", "1")
        return "watch" if watching else "get" if request.name else "list"
    if method == "DELETE":
        return "delete" if request.name else "deletecollection"
    return {"POST": "create", "PATCH": "patch", "PUT": "update"}[method]


def _token(request: Request) -> str:
    """The bearer token (the scheme is case-insensitive: the kubernetes client sends "bearer")."""
    header = next((v for k, v in request.headers.items() if k.lower() == "authorization"), "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _matches(values: list[str], value: str) -> bool:
    return "*" in values or value in values


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against an object's labels."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for term in selector.get("matchExpressions") or []:
        key, op, values = term["key"], term["operator"], term.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _status(code: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=code, reason=reason, message=message, details={})


@attrs.define(kw_only=True)
class ClusterAPI(KubernetesEmulator):
    """The emulator behind authentication, RBAC and the stored admission webhooks."""

    # token -> (user name, groups)
    tokens: dict[str, tuple[str, tuple[str, ...]]] = attrs.field(
        factory=lambda: {ADMIN: ("kubernetes-admin", ("system:masters",))}
    )
    # Services' endpoints: (namespace, service, port) -> 127.0.0.1 port; set by the cluster.
    endpoints: Any = None
    denied: list[str] = attrs.field(factory=list)  # every 403, for the tests to read

    def live(self, group: str, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """The stored objects of a resource (a snapshot: safe from the emulator's thread)."""
        return [
            copy.deepcopy(obj.raw)
            for resource, keys in list(self._keys.items())
            if (resource.group or "", resource.plural) == (group, plural)
            for key in list(keys)
            if namespace is None or key[1] == namespace
            if not (obj := self._objects[key]).deleted
        ]

    async def _handle(self, request: Request) -> aiohttp.web.StreamResponse:
        try:
            self._authorize(request)
            if (
                request.action == action.CREATE
                and request.resource is not None
                and request.subresource is None
            ):
                object.__setattr__(request, "data", await self._admit_create(request))
        except kmock.KubernetesError as exc:
            if not self.keep_requests:
                self._requests.remove(request)
            return await self._render_error(exc)
        return await super()._handle(request)

    # ------------------------------------------------------------------ authn and RBAC

    def _authorize(self, request: Request) -> None:
        identity = self.tokens.get(_token(request))
        if identity is None:
            raise _status(401, "Unauthorized", "Unauthorized")
        user, groups = identity
        resource = request.resource
        if resource is None or not resource.plural or "system:masters" in groups:
            return  # discovery is open to every authenticated user
        plural = resource.plural + (f"/{request.subresource}" if request.subresource else "")
        verb, group = _verb(request), resource.group or ""
        if self.allowed(user, groups, verb, group, plural, request.namespace, request.name):
            return
        where = f' in the namespace "{request.namespace}"' if request.namespace else ""
        what = f'{resource.plural} "{request.name}"' if request.name else resource.plural
        message = (
            f'{what} is forbidden: User "{user}" cannot {verb} resource "{plural}" '
            f'in API group "{group}"{where}'
        )
        self.denied.append(message)
        raise _status(403, "Forbidden", message)

    def allowed(
        self,
        user: str,
        groups: tuple[str, ...],
        verb: str,
        group: str,
        plural: str,
        namespace: str | None,
        name: str | None,
    ) -> bool:
        """Whether a binding grants ``user`` the request, as the RBAC authorizer decides."""
        bindings = [(b, None) for b in self.live(RBAC, "clusterrolebindings")]
        if namespace:
            bindings += [(b, namespace) for b in self.live(RBAC, "rolebindings", namespace)]
        roles = {("ClusterRole", r["metadata"]["name"]): r for r in self.live(RBAC, "clusterroles")}
        if namespace:
            for r in self.live(RBAC, "roles", namespace):
                roles["Role", r["metadata"]["name"]] = r
        for binding, scope in bindings:
            if not any(self._subject(s, user, groups) for s in binding.get("subjects") or []):
                continue
            role = roles.get((binding["roleRef"]["kind"], binding["roleRef"]["name"]))
            for rule in (role or {}).get("rules") or []:
                if (
                    _matches(rule.get("verbs") or [], verb)
                    and _matches(rule.get("apiGroups") or [], group)
                    and _matches(rule.get("resources") or [], plural)
                    and (not rule.get("resourceNames") or name in rule["resourceNames"])
                    and (scope is None or namespace == scope)
                ):
                    return True
        return False

    @staticmethod
    def _subject(subject: dict[str, Any], user: str, groups: tuple[str, ...]) -> bool:
        if subject["kind"] == "ServiceAccount":
            return user == f"system:serviceaccount:{subject['namespace']}:{subject['name']}"
        if subject["kind"] == "Group":
            return subject["name"] in groups
        return bool(subject["name"] == user)

    # ------------------------------------------------------------------ admission

    async def _admit_create(self, request: Request) -> Any:
        """The object a CREATE stores after the matching webhooks had their say."""
        obj = copy.deepcopy(request.data)
        if obj is None:
            return obj
        if request.namespace:
            obj.setdefault("metadata", {})["namespace"] = request.namespace
        for plural in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
            for config in self.live(ADMISSION, plural):
                for hook in config.get("webhooks") or []:
                    if self._hook_applies(hook, request, obj):
                        obj = await self._call(hook, request, obj, mutating=plural[0] == "m")
        return obj

    @staticmethod
    def _hook_applies(hook: dict[str, Any], request: Request, obj: dict[str, Any]) -> bool:
        resource = request.resource
        assert resource is not None
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if not selector_matches(hook.get("objectSelector"), labels):
            return False
        return any(
            _matches(rule.get("operations") or [], "CREATE")
            and _matches(rule.get("apiGroups") or [], resource.group or "")
            and _matches(rule.get("apiVersions") or [], resource.version or "")
            and _matches(rule.get("resources") or [], resource.plural or "")
            for rule in hook.get("rules") or []
        )

    async def _call(
        self, hook: dict[str, Any], request: Request, obj: dict[str, Any], mutating: bool
    ) -> dict[str, Any]:
        resource = request.resource
        assert resource is not None
        name = hook["name"]
        kind = {"group": resource.group or "", "version": resource.version, "kind": obj["kind"]}
        gvr = {
            "group": resource.group or "",
            "version": resource.version,
            "resource": resource.plural,
        }
        user, groups = self.tokens[_token(request)]
        review = admission_review(obj, kind, gvr, request.namespace or "", (user, list(groups)))
        try:
            answer = await self._post(hook, review)
        except (aiohttp.ClientError, asyncio.TimeoutError, LookupError, ValueError) as exc:
            if hook.get("failurePolicy", "Fail") == "Ignore":
                return obj
            why = str(exc) or type(exc).__name__
            raise _status(
                500,
                "InternalError",
                f'failed calling webhook "{name}": failed to call webhook: {why}',
            ) from None
        if not answer.get("allowed"):
            status = answer.get("status") or {}
            message = f'admission webhook "{name}" denied the request: {status.get("message", "")}'
            raise _status(int(status.get("code") or 400), "Forbidden", message)
        if mutating and answer.get("patch"):
            obj = jsonpatch.apply_patch(obj, json.loads(base64.b64decode(answer["patch"])))
        return obj

    async def _post(self, hook: dict[str, Any], review: dict[str, Any]) -> dict[str, Any]:
        client = hook["clientConfig"]
        service = client["service"]
        port = self.endpoints(service["namespace"], service["name"], service.get("port", 443))
        context = ssl.create_default_context(cadata=base64.b64decode(client["caBundle"]).decode())
        url = f"https://127.0.0.1:{port}{service.get('path', '/')}"
        timeout = aiohttp.ClientTimeout(total=float(hook.get("timeoutSeconds", 10)))
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(
                url,
                json=review,
                ssl=context,
                server_hostname=f"{service['name']}.{service['namespace']}.svc",
            ) as reply,
        ):
            reply.raise_for_status()
            return dict((await reply.json())["response"])


# ---------------------------------------------------------------------- TLS


def certificate_authority(hostname: str, ip: str = "127.0.0.1") -> tuple[bytes, bytes, bytes]:
    """(CA certificate, server certificate, server key) as PEM, for ``hostname`` and ``ip``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def cert(subject: str, public: Any, issuer: str, signer: Any, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            names = [x509.DNSName(hostname), x509.IPAddress(ipaddress.ip_address(ip))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca = cert("cluster-ca", ca_key.public_key(), "cluster-ca", ca_key, True)
    server = cert(hostname, key.public_key(), "cluster-ca", ca_key, False)
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ca.public_bytes(pem), server.public_bytes(pem), key_pem


@contextmanager
def tls_front(plain_port: int, cert: bytes, key: bytes, tmp: Any) -> Iterator[int]:
    """Serve HTTPS on a free port of 127.0.0.1, relaying bytes to ``plain_port``; yield it."""
    (tmp / "apiserver.crt").write_bytes(cert)
    (tmp / "apiserver.key").write_bytes(key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp / "apiserver.crt", tmp / "apiserver.key")
    ready, holder = threading.Event(), {}

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", plain_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def main() -> None:
        server = await asyncio.start_server(relay, "127.0.0.1", 0, ssl=context)
        stop = asyncio.Event()
        holder.update(
            port=server.sockets[0].getsockname()[1], stop=stop, loop=asyncio.get_running_loop()
        )
        ready.set()
        async with server:
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="apiserver-tls")
    thread.start()
    ready.wait(10)
    try:
        yield int(holder["port"])
    finally:
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        thread.join(10)


__all__ = ["ADMIN", "ClusterAPI", "certificate_authority", "label_selected", "tls_front"]
