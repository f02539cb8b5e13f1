"""The controllers a cluster runs beside the API server, one pass at a time.

- Deployment: one ReplicaSet per pod template (named after a hash of it, owned by the
  Deployment, scaled with it); an older template's ReplicaSet is deleted (no rolling update).
- ReplicaSet: ``replicas`` live pods of its template, owned by it.
- Job: a pod of its template at a time while it has not succeeded and has failed at most
  ``backoffLimit`` times; then ``Complete`` or ``Failed`` (``BackoffLimitExceeded``) in its
  status, with ``startTime``, ``completionTime``, ``succeeded`` and ``failed``.
- Garbage collector: an object whose owner (by uid) is gone is deleted (background).
- Scheduler: a pod without a node is bound to the first node whose labels match its
  ``nodeSelector`` and whose taints it tolerates, once every claim it mounts exists; else it
  stays unbound with ``PodScheduled`` False (``Unschedulable``, the scheduler's message) and
  a ``FailedScheduling`` Warning event, as kube-scheduler leaves it.

Each pass reads through the API as the cluster's admin; pods it creates go through admission.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import time
from typing import Any

from kernelcache.controller.kube import ApiError, Kube, path

OWNERS = {  # kinds that own things here, and where to list them
    "Deployment": ("apps/v1", "deployments"),
    "ReplicaSet": ("apps/v1", "replicasets"),
    "Job": ("batch/v1", "jobs"),
    "DaemonSet": ("apps/v1", "daemonsets"),
    "KernelCache": ("kernelcache.dev/v1alpha1", "kernelcaches"),
}
OWNED = [
    ("apps/v1", "replicasets"),
    ("v1", "pods"),
    ("batch/v1", "jobs"),
    ("apps/v1", "daemonsets"),
    ("v1", "configmaps"),
    ("v1", "persistentvolumeclaims"),
]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _owner(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        "apiVersion": obj.get("apiVersion", ""),
        "kind": obj.get("kind", ""),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> bool:
    refs = obj["metadata"].get("ownerReferences") or []
    return any(r.get("uid") == owner["metadata"]["uid"] for r in refs)


def _finished(pod: dict[str, Any]) -> str | None:
    phase = (pod.get("status") or {}).get("phase")
    return phase if phase in ("Succeeded", "Failed") else None


class Controllers:
    def __init__(self, kube: Kube, nodes: list[dict[str, Any]]) -> None:
        self.kube, self.nodes = kube, nodes

    def _list(self, api_version: str, plural: str) -> list[dict[str, Any]]:
        try:
            items = self.kube.list(path(api_version, plural, None))
        except ApiError as exc:
            if exc.status == 404:  # a CRD not installed yet
                return []
            raise
        kind = {p: k for k, (_, p) in OWNERS.items()}.get(plural, "Pod")
        for item in items:  # lists may leave out each item's kind
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    def _create_pod(
        self, owner: dict[str, Any], template: dict[str, Any], labels: dict[str, str]
    ) -> None:
        meta = owner["metadata"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{meta['name']}-{secrets.token_hex(3)[:5]}",
                "namespace": meta["namespace"],
                "labels": {**((template.get("metadata") or {}).get("labels") or {}), **labels},
                "annotations": (template.get("metadata") or {}).get("annotations") or {},
                "ownerReferences": [_owner(owner)],
            },
            "spec": template["spec"],
        }
        # Refused (admission, quota): tried again on the next pass, as controllers do.
        with contextlib.suppress(ApiError):
            self.kube.create(path("v1", "pods", meta["namespace"]), pod)

    def step(self) -> None:
        pods = self._list("v1", "pods")
        self.nodes = self.kube.list(path("v1", "nodes", None))  # nodes join while it runs
        self._deployments()
        self._replicasets(pods)
        self._daemonsets(pods)
        self._jobs(pods)
        self._schedule(pods)
        self._collect_garbage()

    def _deployments(self) -> None:
        sets = self._list("apps/v1", "replicasets")
        for deployment in self._list("apps/v1", "deployments"):
            template = deployment["spec"]["template"]
            digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
            meta = deployment["metadata"]
            name = f"{meta['name']}-{digest}"
            for old in sets:
                if _owned_by(old, deployment) and old["metadata"]["name"] != name:
                    self.kube.delete(
                        path("apps/v1", "replicasets", meta["namespace"], old["metadata"]["name"])
                    )
            replica_set = {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {
                    "name": name,
                    "namespace": meta["namespace"],
                    "labels": template["metadata"].get("labels") or {},
                    "ownerReferences": [_owner(deployment)],
                },
                "spec": {
                    "replicas": deployment["spec"].get("replicas", 1),
                    "selector": deployment["spec"]["selector"],
                    "template": template,
                },
            }
            if not self.kube.create(path("apps/v1", "replicasets", meta["namespace"]), replica_set):
                current = next((r for r in sets if r["metadata"]["name"] == name), None)
                wanted = replica_set["spec"]["replicas"]
                if current is not None and current["spec"].get("replicas") != wanted:  # scaled
                    rs_path = path("apps/v1", "replicasets", meta["namespace"], name)
                    self.kube.patch(rs_path, {"spec": {"replicas": wanted}})

    def _replicasets(self, pods: list[dict[str, Any]]) -> None:
        for replica_set in self._list("apps/v1", "replicasets"):
            mine = [p for p in pods if _owned_by(p, replica_set) and not _finished(p)]
            for _ in range(replica_set["spec"].get("replicas", 1) - len(mine)):
                self._create_pod(replica_set, replica_set["spec"]["template"], {})
            for extra in mine[replica_set["spec"].get("replicas", 1) :]:
                self.kube.delete(
                    path("v1", "pods", extra["metadata"]["namespace"], extra["metadata"]["name"])
                )

    def _daemonsets(self, pods: list[dict[str, Any]]) -> None:
        """A pod of the template on each node it selects and tolerates, bound to the node; a
        pod of an older template is deleted and replaced (``maxUnavailable: 100%``)."""
        for daemonset in self._list("apps/v1", "daemonsets"):
            template = daemonset["spec"]["template"]
            digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
            mine = [p for p in pods if _owned_by(p, daemonset) and not _finished(p)]
            placed = set()
            for pod in mine:
                labels = pod["metadata"].get("labels") or {}
                if labels.get("controller-revision-hash") != digest:
                    meta = pod["metadata"]
                    self.kube.delete(path("v1", "pods", meta["namespace"], meta["name"]))
                else:
                    placed.add(pod["spec"].get("nodeName"))
            wanted = template["spec"].get("nodeSelector") or {}
            for node in self.nodes:
                name = node["metadata"]["name"]
                labels = node["metadata"].get("labels") or {}
                if name in placed or not all(labels.get(k) == v for k, v in wanted.items()):
                    continue
                if not self._tolerated(node, template["spec"]):
                    continue
                bound = {**template, "spec": {**template["spec"], "nodeName": name}}
                self._create_pod(daemonset, bound, {"controller-revision-hash": digest})

    def _jobs(self, pods: list[dict[str, Any]]) -> None:
        for job in self._list("batch/v1", "jobs"):
            status = job.get("status") or {}
            if any(c.get("status") == "True" for c in status.get("conditions") or []):
                continue
            mine = [p for p in pods if _owned_by(p, job)]
            succeeded = sum(_finished(p) == "Succeeded" for p in mine)
            failed = sum(_finished(p) == "Failed" for p in mine)
            active = len(mine) - succeeded - failed
            new = {
                "startTime": status.get("startTime") or _now(),
                "active": active,
                "succeeded": succeeded,
                "failed": failed,
            }
            if succeeded:
                new.update(
                    active=0,
                    completionTime=_now(),
                    conditions=[
                        {"type": "Complete", "status": "True", "lastTransitionTime": _now()}
                    ],
                )
            elif failed > job["spec"].get("backoffLimit", 6):
                new.update(
                    active=0,
                    conditions=[
                        {
                            "type": "Failed",
                            "status": "True",
                            "reason": "BackoffLimitExceeded",
                            "message": "Job has reached the specified backoff limit",
                            "lastTransitionTime": _now(),
                        }
                    ],
                )
            elif not active:
                uid = job["metadata"]["uid"]
                labels = {
                    "batch.kubernetes.io/job-name": job["metadata"]["name"],
                    "job-name": job["metadata"]["name"],
                    "controller-uid": uid,
                    "batch.kubernetes.io/controller-uid": uid,
                }
                self._create_pod(job, job["spec"]["template"], labels)
                new["active"] = 1
            if {k: status.get(k) for k in new} != new:
                meta = job["metadata"]
                self.kube.patch(
                    path("batch/v1", "jobs", meta["namespace"], meta["name"]) + "/status",
                    {"status": new},
                )

    def _schedule(self, pods: list[dict[str, Any]]) -> None:
        for pod in pods:
            spec, meta = pod["spec"], pod["metadata"]
            if spec.get("nodeName") or _finished(pod):
                continue
            pod_path = path("v1", "pods", meta["namespace"], meta["name"])
            why = self._unschedulable(pod)
            if why is None:
                wanted = spec.get("nodeSelector") or {}
                node = next(
                    (
                        n
                        for n in self.nodes
                        if all((n["metadata"].get("labels") or {}).get(k) == v
                               for k, v in wanted.items())
                        and self._tolerated(n, spec)
                    ),
                    None,
                )  # fmt: skip
                if node is not None:
                    self.kube.patch(pod_path, {"spec": {"nodeName": node["metadata"]["name"]}})
                    scheduled = {"type": "PodScheduled", "status": "True"}
                    self.kube.patch(pod_path + "/status", {"status": {"conditions": [scheduled]}})
                    continue
                count = len(self.nodes)
                why = (
                    f"0/{count} nodes are available: {count} node(s) didn't match Pod's node "
                    "affinity/selector."
                )
            condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                         "message": why}  # fmt: skip
            if (pod.get("status") or {}).get("conditions") != [condition]:
                status = {"phase": "Pending", "conditions": [condition]}
                self.kube.patch(pod_path + "/status", {"status": status})
                self._warn(pod, "FailedScheduling", why)

    def _unschedulable(self, pod: dict[str, Any]) -> str | None:
        """The scheduler's reason for a pod whose claim does not exist, else None."""
        namespace = pod["metadata"]["namespace"]
        for volume in pod["spec"].get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is None:
                continue
            try:
                self.kube.get(path("v1", "persistentvolumeclaims", namespace, claim))
            except ApiError as exc:
                if exc.status != 404:
                    raise
                return (
                    f'0/{len(self.nodes)} nodes are available: persistentvolumeclaim "{claim}" '
                    f"not found. preemption: 0/{len(self.nodes)} nodes are available: "
                    f"{len(self.nodes)} Preemption is not helpful for scheduling."
                )
        return None

    def _warn(self, pod: dict[str, Any], reason: str, message: str) -> None:
        meta = pod["metadata"]
        self.kube.create(
            path("v1", "events", meta["namespace"]),
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}"},
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                   "namespace": meta["namespace"], "uid": meta["uid"]},
                "type": "Warning",
                "reason": reason,
                "message": message,
                "source": {"component": "default-scheduler"},
                "firstTimestamp": _now(),
                "lastTimestamp": _now(),
                "count": 1,
            },
        )  # fmt: skip

    @staticmethod
    def _tolerated(node: dict[str, Any], spec: dict[str, Any]) -> bool:
        tolerations = spec.get("tolerations") or []
        return all(
            any(
                t.get("key") in (None, taint["key"]) and t.get("effect") in (None, taint["effect"])
                for t in tolerations
            )
            for taint in (node.get("spec") or {}).get("taints") or []
        )

    def _collect_garbage(self) -> None:
        live = {
            obj["metadata"]["uid"]
            for api_version, plural in OWNERS.values()
            for obj in self._list(api_version, plural)
        }
        for api_version, plural in OWNED:
            for obj in self._list(api_version, plural):
                refs = obj["metadata"].get("ownerReferences") or []
                if refs and all(r["uid"] not in live for r in refs):
                    meta = obj["metadata"]
                    self.kube.delete(path(api_version, plural, meta["namespace"], meta["name"]))
