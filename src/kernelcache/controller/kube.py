"""A dict-in, dict-out Kubernetes API client over the official client's transport.

The builders in ``manifests`` produce plain dicts and the decisions in ``state`` read plain
dicts, so the handlers talk to the API server in JSON too: the official client supplies
authentication (kubeconfig or in-cluster service account), TLS and connection pooling, and
this module only builds paths, sends bodies and raises one error type. Calls block; kopf
runs the handlers that make them in its thread pool.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kernelcache.errors import StorageError, one_line
from kernelcache.spec import GROUP, PLURAL, VERSION

MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def path(api_version: str, plural: str, namespace: str | None, name: str = "") -> str:
    """The REST path of a collection (no name) or an object: core group under /api."""
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"{prefix}{scope}/{plural}" + (f"/{name}" if name else "")


def kernelcache_path(namespace: str, name: str = "") -> str:
    return path(f"{GROUP}/{VERSION}", PLURAL, namespace, name)


def jobs_path(namespace: str, name: str = "") -> str:
    return path("batch/v1", "jobs", namespace, name)


# Seconds to connect to the API server, and the longest it may stay silent in an answer:
# every call has a deadline (a reconcile never waits on an API server for ever).
CONNECT_S, READ_S = 10.0, 60.0


class Kube:
    """Blocking JSON calls to one API server; thread-safe (the client pools connections)."""

    def __init__(self, api_client: Any) -> None:
        self._api = api_client

    @property
    def server(self) -> str:
        return str(getattr(self._api.configuration, "host", "") or "the API server")

    def reach(self, connect_s: float = CONNECT_S) -> None:
        """One ``GET /version``: the API server answers, or one ``StorageError`` line naming
        it and why (refused, no route, TLS, no answer within ``connect_s``)."""
        try:
            self.request("GET", "/version", timeout=(connect_s, connect_s))
        except ApiError:
            return  # it answered: an API server that says no is up
        except Exception as exc:  # urllib3's errors, as the client raises them
            reason = getattr(exc, "reason", None) or exc
            raise StorageError(
                f"API server {self.server} unreachable: {one_line(reason)}", path=self.server
            ) from None

    @classmethod
    def from_environment(cls, connections: int = 16) -> Kube:
        """In-cluster service account if there is one, else the default kubeconfig; neither
        is one line naming where they were looked for (a ``StorageError``).

        ``connections``: pooled connections, one per thread that may call at once.
        """
        from kubernetes import client, config
        from kubernetes.config import kube_config

        configuration = client.Configuration()
        configuration.connection_pool_maxsize = connections
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException as not_in_cluster:
            try:
                config.load_kube_config(client_configuration=configuration)
            # The loader trusts the file's shape: malformed YAML raises the parser's error, a
            # list or a number where it wants a mapping a TypeError. Any of them is this file
            # unusable, not a bug of ours.
            except Exception as exc:
                ours = isinstance(exc, (config.ConfigException, OSError))
                malformed = "" if ours else "malformed: "
                where = os.environ.get("KUBECONFIG") or kube_config.KUBE_CONFIG_DEFAULT_LOCATION
                raise StorageError(
                    f"no Kubernetes credentials: not in a cluster ({not_in_cluster}) and no "
                    f"usable kubeconfig at {where} ({malformed}{one_line(exc)})",
                    path=where,
                ) from None
        return cls(client.ApiClient(configuration))

    def request(
        self,
        method: str,
        resource_path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        timeout: tuple[float, float] = (CONNECT_S, READ_S),
    ) -> dict[str, Any]:
        method_, url, headers, data, _ = self._api.param_serialize(
            method=method,
            resource_path=resource_path,
            query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self._api.call_api(
            method_, url, header_params=headers, body=data, _request_timeout=timeout
        )
        response.read()
        text = (response.data or b"").decode("utf-8", "replace")
        try:
            payload = json.loads(text) if text else {}
        except ValueError:
            payload = {"message": text.strip()[:200]}
        if not 200 <= response.status < 300:
            raise ApiError(
                response.status, payload.get("reason", ""), payload.get("message", text[:200])
            )
        return payload if isinstance(payload, dict) else {}

    def get(self, resource_path: str) -> dict[str, Any]:
        return self.request("GET", resource_path)

    def list(self, resource_path: str, label_selector: str = "") -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        items = self.request("GET", resource_path, query=query).get("items") or []
        return list(items)

    def create(self, collection_path: str, body: dict[str, Any]) -> bool:
        """Create ``body``; False when an object of that name exists already (409)."""
        try:
            self.request("POST", collection_path, body=body)
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def patch(self, resource_path: str, body: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch; a ``metadata.resourceVersion`` in it makes it conditional (409)."""
        return self.request("PATCH", resource_path, body=body, content_type=MERGE_PATCH)

    def delete(self, resource_path: str) -> bool:
        """Delete in the background (dependents too); False when it was already gone (404)."""
        try:
            self.request("DELETE", resource_path, body={"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True
