"""The kubelet: each pod's containers as host processes, exactly as their pod spec says.

A container runs in a private mount (and UTS) namespace whose root is a fresh tmpfs holding
the host's system directories (bound read-only: the base image's layers), the image's
virtual environment and copied files (``images``), the base image's own ``/etc/passwd`` and
``/etc/group``, a minimal ``/dev`` and each volume mount at its ``mountPath``; it then
``chroot``s there and drops to the pod's user with ``setpriv`` (uid, gid, ``fsGroup`` and
supplemental groups; no capabilities but those ``capabilities.add`` names; no new
privileges). ``readOnlyRootFilesystem`` remounts the root read-only, so only the volumes can
be written, ``/tmp`` included.

Volumes, as the kubelet lays them out under the pod's directory: ``emptyDir`` (0777), a
PersistentVolumeClaim as a directory per claim (root-owned, given to ``fsGroup`` on mount,
as block-backed volumes are), ``configMap``/``secret`` in the atomic-writer layout (files
are symlinks through ``..data`` to a timestamped directory; ``items``, ``optional``,
``defaultMode``), ``downwardAPI`` files, and the service-account token that the API
server's ServiceAccount admission would add (``/var/run/secrets/kubernetes.io/
serviceaccount``: a token of its own, the API's CA, the namespace) unless
``automountServiceAccountToken`` is false. The environment is the image's, then the
container's own ``env`` with ``fieldRef`` (downward API), ``configMapKeyRef`` and
``secretKeyRef`` filled in, ``HOME`` from the user database, and the in-cluster API address.
``command`` replaces the image's ENTRYPOINT and ``args`` its CMD.

A pod that cannot start stays Pending as a kubelet leaves it: a Secret or ConfigMap volume
that does not exist keeps its containers ``ContainerCreating`` and posts a Warning event
``FailedMount`` (``MountVolume.SetUp failed for volume "V" : secret "S" not found``); an env
key that does not exist makes the container wait with ``CreateContainerConfigError``; an
image that was not built, ``ErrImagePull``. Each is tried again every second, so the pod
starts once what it needs appears.

Init containers run one after another, then the containers together; ``restartPolicy``
``Always`` restarts an exited container (or a failed init container) after a short backoff,
``Never`` ends the pod. The termination message is the ``terminationMessagePath`` file, or
the log's tail under ``FallbackToLogsOnError``. Status goes to the pod's ``/status``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shlex
import signal
import subprocess
import tarfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kernelcache.controller.kube import ApiError, Kube, path
from tests.cluster.images import Image
from tests.conftest import scaled

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
HOST_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
READ_ONLY_KINDS = ("configMap", "secret", "downwardAPI", "projected", "image")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def backoff(restarts: int) -> float:
    """Seconds before restarting a container that exited: doubling, as CrashLoopBackOff."""
    return float(min(0.5 * 2**restarts, 10.0))


# Run by sh in the container's new mount namespace as root: build the root, then exec
# "$@" (chroot, env, setpriv, the command). Mounts arrive as "kind source target options"
# lines (options: rw, or what the bind is remounted with: ro; ro,noexec,... for an image).
SETUP = r"""
set -eu
root=$1 mounts=$2 readonly=$3 hostname=$4 tree=$5
shift 5
hostname "$hostname"
mount -t tmpfs -o mode=0755 rootfs "$root"
for dir in $HOST_DIRS; do
    if [ -L "/$dir" ]; then ln -s "$(readlink "/$dir")" "$root/$dir"
    elif [ -d "/$dir" ]; then mkdir "$root/$dir"; mount --rbind "/$dir" "$root/$dir"
        mount -o remount,bind,ro "$root/$dir"; fi
done
cp -a /etc "$root/etc"
cp -a "$tree/." "$root/"
mkdir -p "$root/proc" "$root/sys" "$root/dev" "$root/var" "$root/run" "$root/tmp"
chmod 1777 "$root/tmp"
mount --rbind /proc "$root/proc"
mount --rbind /sys "$root/sys"
mount -t tmpfs -o mode=0755 dev "$root/dev"
for dev in $DEVICES; do touch "$root/dev/$dev"; mount --bind "/dev/$dev" "$root/dev/$dev"; done
mkdir -m 1777 "$root/dev/shm"
ln -s /proc/self/fd "$root/dev/fd"
while read -r kind source target ro; do
    if [ "$kind" = file ]; then mkdir -p "$(dirname "$root$target")"; touch "$root$target"
    else mkdir -p "$root$target"; fi
    mount --bind "$source" "$root$target"
    if [ "$ro" != rw ]; then mount -o "remount,bind,$ro" "$root$target"; fi
done < "$mounts"
if [ "$readonly" = 1 ]; then mount -o remount,ro "$root"; mount -o remount,ro "$root/dev"; fi
exec chroot "$root" "$@"
"""


class NotReady(Exception):
    """A pod cannot start yet (a claim, ConfigMap or Secret is missing): retried.

    ``reason`` is what the kubelet says: a Warning event's reason for a volume (``event``),
    else the waiting reason of the container."""

    def __init__(self, message: str, reason: str = "ContainerCreating", event: bool = False):
        super().__init__(message)
        self.reason, self.event = reason, event


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def atomic_writer(target: Path, files: dict[str, bytes], mode: int, gid: int | None) -> None:
    """The kubelet's layout of a ConfigMap, Secret, downward API or projected volume."""
    target.mkdir(parents=True, exist_ok=True)
    stamp = target / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{secrets.token_hex(4)}"
    stamp.mkdir()
    for rel, data in files.items():
        (stamp / rel).parent.mkdir(parents=True, exist_ok=True)
        (stamp / rel).write_bytes(data)
        (stamp / rel).chmod(mode | (0o040 if gid is not None else 0))
        if gid is not None:
            os.chown(stamp / rel, 0, gid)
        top = rel.split("/")[0]
        if not (target / top).is_symlink():
            (target / top).symlink_to(f"..data/{top}")
    (target / "..data_tmp").symlink_to(stamp.name)
    os.replace(target / "..data_tmp", target / "..data")


@dataclass
class Container:
    spec: dict[str, Any]
    init: bool
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    state: dict[str, Any] = field(
        default_factory=lambda: {"waiting": {"reason": "PodInitializing"}}
    )
    last_state: dict[str, Any] = field(default_factory=dict)
    exited: float = 0.0  # when the current run's exit was seen (0: running or never run)
    log: Path = Path()
    termination: Path = Path()

    @property
    def name(self) -> str:
        return str(self.spec["name"])


class PodRunner(threading.Thread):
    """One pod from start to its end (or its deletion): volumes, then its containers."""

    def __init__(self, kubelet: Kubelet, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}-{meta['name']}", daemon=True)
        self.kubelet, self.pod = kubelet, pod
        self.namespace, self.pod_name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = kubelet.root / "pods" / self.uid
        self.stopping = threading.Event()
        self.spec = pod["spec"]
        self.security = self.spec.get("securityContext") or {}
        self.inits = [Container(c, True) for c in self.spec.get("initContainers") or []]
        self.containers = [Container(c, False) for c in self.spec["containers"]]
        self.phase = "Pending"
        self.message = ""

    # ------------------------------------------------------------------ life cycle

    def run(self) -> None:
        try:
            mounts = self._wait_for_volumes()
            if mounts is None:
                return
            for container in self.inits:
                if not self._run_to_success(container, mounts):
                    return
            self._run_containers(mounts)
        except Exception:  # kept for the test to see (Cluster.errors), as a controller's
            self.kubelet.errors.append(f"pod {self.pod_name}: {traceback.format_exc()}")
        finally:
            self._kill_all()

    def stop(self) -> None:
        self.stopping.set()
        self._kill_all()

    def _wait_for_volumes(self) -> dict[str, Path] | None:
        while not self.stopping.is_set():
            try:
                return self._volumes()
            except NotReady as exc:
                self._not_ready(exc, [*self.inits, *self.containers])
                self.stopping.wait(1.0)
        return None

    def _not_ready(self, exc: NotReady, containers: list[Container]) -> None:
        """Say why the pod cannot start where a kubelet says it: an event, or the waiting
        reason of the containers it concerns."""
        self.message = str(exc)
        if exc.event:
            self.kubelet.event(self.pod, exc.reason, str(exc))
            for container in containers:
                container.state = {"waiting": {"reason": "ContainerCreating"}}
        else:
            for container in containers:
                container.state = {"waiting": {"reason": exc.reason, "message": str(exc)}}
        self._report()

    def _start_when_ready(self, container: Container, mounts: dict[str, Path]) -> bool:
        """Start the container once it can be created; False when the pod was stopped."""
        while not self.stopping.is_set():
            try:
                self._start(container, mounts)
                return True
            except NotReady as exc:
                self._not_ready(exc, [container])
                self.stopping.wait(1.0)
        return False

    def _run_to_success(self, container: Container, mounts: dict[str, Path]) -> bool:
        """An init container, restarted until it succeeds unless restartPolicy is Never."""
        while not self.stopping.is_set():
            code = self._start_and_wait(container, mounts)
            if code == 0:
                return True
            if self.spec.get("restartPolicy", "Always") == "Never":
                self.phase = "Failed"
                self._report()
                return False
            self.stopping.wait(backoff(container.restarts))
        return False

    def _run_containers(self, mounts: dict[str, Path]) -> None:
        always = self.spec.get("restartPolicy", "Always") == "Always"
        for container in self.containers:
            if not self._start_when_ready(container, mounts):
                return
        self.message = ""
        self.phase = "Running"
        self._report()
        while not self.stopping.wait(0.2):
            for container in self.containers:
                process = container.process
                if process is None or process.poll() is None:
                    continue
                if not container.exited:
                    self._terminated(container)
                    container.exited = time.monotonic()
                if always and time.monotonic() - container.exited > backoff(container.restarts):
                    self._start(container, mounts)
            if not always and all(c.exited for c in self.containers):
                failed = any(c.state["terminated"]["exitCode"] for c in self.containers)
                self.phase = "Failed" if failed else "Succeeded"
                self._report()
                return

    def _start_and_wait(self, container: Container, mounts: dict[str, Path]) -> int:
        if not self._start_when_ready(container, mounts):
            return -1
        assert container.process is not None
        while container.process.poll() is None:
            if self.stopping.wait(0.2):
                return -1
        self._terminated(container)
        return container.process.returncode

    # ------------------------------------------------------------------ one container

    def _start(self, container: Container, mounts: dict[str, Path]) -> None:
        spec = container.spec
        image = self.kubelet.images.get(spec["image"])
        if image is None:
            raise NotReady(f"image {spec['image']} is not built", "ErrImagePull")
        if container.process is not None:
            container.restarts += 1
        security = {**self.security, **(spec.get("securityContext") or {})}
        uid, gid, home = self._user(image, security)
        if security.get("runAsNonRoot") and uid == 0:
            raise NotReady(
                "container has runAsNonRoot and image will run as root",
                "CreateContainerConfigError",
            )
        groups = [
            g
            for g in [
                self.security.get("fsGroup"),
                *(self.security.get("supplementalGroups") or []),
            ]
            if g is not None
        ]
        argv = [
            *(spec.get("command") or image.entrypoint),
            *(spec.get("args") or (image.cmd if not spec.get("command") else ())),
        ]
        env = {
            **image.env,
            "HOSTNAME": self.pod_name,
            "HOME": home,
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.kubelet.api_port),
        }
        env.update(self._env(spec))
        log = self.dir / "logs" / f"{container.name}-{container.restarts}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        termination = self.dir / "termination" / container.name
        termination.parent.mkdir(parents=True, exist_ok=True)
        termination.write_bytes(b"")
        termination.chmod(0o666)
        table = self._mount_table(image, spec, mounts, termination)
        root = self.dir / "roots" / container.name
        root.mkdir(parents=True, exist_ok=True)
        # Capabilities: none but what securityContext.capabilities.add names (CHOWN, say).
        added = "".join(
            f",+{c.lower().removeprefix('cap_')}"
            for c in ((spec.get("securityContext") or {}).get("capabilities") or {}).get("add")
            or []
        )
        drop = [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={gid}",
            f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
            "--no-new-privs",
            f"--bounding-set=-all{added}",
            f"--inh-caps=-all{added}",
            *([f"--ambient-caps=-all{added}"] if added and uid != 0 else []),
            "--",
        ]
        workdir = spec.get("workingDir") or image.workdir
        inside = [
            "/usr/bin/env",
            "-i",
            f"--chdir={workdir}",
            *(f"{k}={v}" for k, v in env.items()),
            *drop,
            *argv,
        ]
        setup = SETUP.replace("$HOST_DIRS", " ".join(HOST_DIRS)).replace(
            "$DEVICES", " ".join(DEVICES)
        )
        read_only = "1" if security.get("readOnlyRootFilesystem") else "0"
        command = [
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            setup,
            "container",
            str(root),
            str(table),
            read_only,
            self.pod_name,
            str(image.tree),
            *inside,
        ]
        with log.open("wb") as out:
            container.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            )
        container.exited = 0.0
        container.state = {"running": {"startedAt": _now()}}
        container.log, container.termination = log, termination
        self._report()

    def _terminated(self, container: Container) -> None:
        assert container.process is not None
        code = container.process.returncode
        message = container.termination.read_text(errors="replace")[:4096]
        policy = container.spec.get("terminationMessagePolicy", "File")
        if not message and code and policy == "FallbackToLogsOnError":
            lines = container.log.read_text(errors="replace").splitlines()[-80:]
            message = "\n".join(lines)[-2048:]
        if container.state.get("terminated"):
            container.last_state = {"terminated": container.state["terminated"]}
        container.state = {
            "terminated": {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "message": message,
                "finishedAt": _now(),
            }
        }
        self._report()

    def _user(self, image: Image, security: dict[str, Any]) -> tuple[int, int, str]:
        """(uid, gid, HOME): runAsUser/runAsGroup, else the image's USER, per its passwd."""
        entries = [line.split(":") for line in image.base.passwd.splitlines() if line]
        user, _, group = image.user.partition(":")
        by_name = {e[0]: e for e in entries}
        by_uid = {int(e[2]): e for e in entries}
        if "runAsUser" in security:
            uid = int(security["runAsUser"])
        elif user and not user.isdigit():
            uid = int(by_name[user][2])
        else:
            uid = int(user or 0)
        entry = by_uid.get(uid)
        if "runAsGroup" in security:
            gid = int(security["runAsGroup"])
        elif group:
            gid = int(group)
        else:
            gid = int(entry[3]) if entry else 0
        return uid, gid, entry[5] if entry else "/"

    def _env(self, spec: dict[str, Any]) -> dict[str, str]:
        found: dict[str, str] = {}
        for item in spec.get("env") or []:
            source = item.get("valueFrom")
            if source is None:
                found[item["name"]] = str(item.get("value", ""))
            elif "fieldRef" in source:
                found[item["name"]] = self._field(source["fieldRef"]["fieldPath"])
            else:
                kind = "configMapKeyRef" if "configMapKeyRef" in source else "secretKeyRef"
                ref = source[kind]
                obj = self.kubelet.read(
                    "configmaps" if kind == "configMapKeyRef" else "secrets",
                    self.namespace,
                    ref["name"],
                )
                data = (obj or {}).get("data") or {}
                what = "secret" if kind == "secretKeyRef" else "configmap"
                if obj is None:
                    raise NotReady(
                        f'{what} "{ref["name"]}" not found', "CreateContainerConfigError"
                    )
                if ref["key"] not in data:
                    raise NotReady(
                        f"couldn't find key {ref['key']} in "
                        f"{'Secret' if what == 'secret' else 'ConfigMap'} "
                        f"{self.namespace}/{ref['name']}",
                        "CreateContainerConfigError",
                    )
                value = data[ref["key"]]
                found[item["name"]] = (
                    base64.b64decode(value).decode() if kind == "secretKeyRef" else value
                )
        return found

    def _field(self, field_path: str) -> str:
        pod = self.kubelet.read("pods", self.namespace, self.pod_name) or self.pod
        meta, spec = pod["metadata"], pod["spec"]
        simple = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "metadata.uid": meta["uid"],
            "spec.nodeName": spec.get("nodeName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
            "status.podIP": "127.0.0.1",
            "status.hostIP": "127.0.0.1",
        }
        if field_path in simple:
            return str(simple[field_path])
        for kind in ("labels", "annotations"):
            prefix = f"metadata.{kind}['"
            if field_path.startswith(prefix):
                return str((meta.get(kind) or {}).get(field_path[len(prefix) : -2], ""))
        raise NotReady(f"fieldRef {field_path} is not played by the harness")

    # ------------------------------------------------------------------ volumes

    def _volumes(self) -> dict[str, Path]:
        """Each volume's directory on the host, made as the kubelet makes it."""
        fs_group = self.security.get("fsGroup")
        found = {}
        for volume in self.spec.get("volumes") or []:
            name = volume["name"]
            where = self.dir / "volumes" / name
            if "emptyDir" in volume:
                where.mkdir(parents=True, exist_ok=True)
                where.chmod(0o777)
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                if self.kubelet.read("persistentvolumeclaims", self.namespace, claim) is None:
                    raise NotReady(f'persistentvolumeclaim "{claim}" not found')
                where = self.kubelet.claim_dir(self.namespace, claim)
                if fs_group is not None:
                    self.kubelet.give_to_group(where, int(fs_group))
            elif "configMap" in volume or "secret" in volume:
                self._object_volume(volume, where, fs_group)
            elif "hostPath" in volume:
                where = self._host_path(volume["hostPath"])
            elif "image" in volume:
                where = self.kubelet.image_volume(volume["image"]["reference"], self._pull_auth())
            elif "downwardAPI" in volume:
                files = {
                    i["path"]: self._field(i["fieldRef"]["fieldPath"]).encode()
                    for i in volume["downwardAPI"]["items"]
                }
                atomic_writer(where, files, 0o644, fs_group)
            else:
                raise NotReady(f"volume {name}: {sorted(volume)} is not played by the harness")
            found[name] = where
        if self._automount():
            token = self.kubelet.mint_token(
                self.namespace, self.spec.get("serviceAccountName", "default")
            )
            where = self.dir / "volumes" / "kube-api-access"
            files = {
                "token": token.encode(),
                "ca.crt": self.kubelet.ca_pem,
                "namespace": self.namespace.encode(),
            }
            atomic_writer(where, files, 0o644, fs_group)
            found[SA_DIR] = where
        return found

    def _host_path(self, source: dict[str, Any]) -> Path:
        """The node's own directory: each node has a disk of its own under the kubelet."""
        node = str(self.spec.get("nodeName") or "")
        where = self.kubelet.node_disk(node) / source["path"].lstrip("/")
        kind = source.get("type", "")
        if kind == "DirectoryOrCreate" and not where.exists():
            where.mkdir(parents=True, exist_ok=True)  # two pods may mount it at once
            where.chmod(0o755)
        elif kind in ("Directory", "") and not where.is_dir():
            raise NotReady(f"hostPath {source['path']}: no such directory on node {node}")
        return where

    def _pull_auth(self) -> dict[str, Any]:
        """The docker configs of the pod's imagePullSecrets, merged, as the kubelet uses them."""
        auths: dict[str, Any] = {}
        for ref in self.spec.get("imagePullSecrets") or []:
            secret = self.kubelet.read("secrets", self.namespace, ref["name"])
            data = (secret or {}).get("data") or {}
            if ".dockerconfigjson" in data:
                auths.update(json.loads(base64.b64decode(data[".dockerconfigjson"]))["auths"])
        return {"auths": auths}

    def _object_volume(self, volume: dict[str, Any], where: Path, fs_group: Any) -> None:
        kind = "configMap" if "configMap" in volume else "secret"
        source = volume[kind]
        name = source["name"] if kind == "configMap" else source["secretName"]
        obj = self.kubelet.read(
            "configmaps" if kind == "configMap" else "secrets", self.namespace, name
        )
        if obj is None and not source.get("optional"):
            raise NotReady(
                f'MountVolume.SetUp failed for volume "{volume["name"]}" : '
                f'{kind.lower()} "{name}" not found',
                "FailedMount",
                event=True,
            )
        data = {k: v.encode() for k, v in ((obj or {}).get("data") or {}).items()}
        if kind == "secret":
            data = {k: base64.b64decode(v) for k, v in data.items()}
        items = source.get("items")
        if items:
            missing = [i["key"] for i in items if i["key"] not in data]
            if missing and obj is not None and not source.get("optional"):
                raise NotReady(
                    f'MountVolume.SetUp failed for volume "{volume["name"]}" : configmap '
                    f"references non-existent config key: {missing[0]}"
                    if kind == "configMap"
                    else f'MountVolume.SetUp failed for volume "{volume["name"]}" : '
                    f"references non-existent secret key: {missing[0]}",
                    "FailedMount",
                    event=True,
                )
            data = {i["path"]: data[i["key"]] for i in items if i["key"] in data}
        atomic_writer(where, data, int(source.get("defaultMode", 0o644)) & 0o777, fs_group)

    def _automount(self) -> bool:
        if self.spec.get("automountServiceAccountToken") is False:
            return False
        account = self.kubelet.read(
            "serviceaccounts", self.namespace, self.spec.get("serviceAccountName", "default")
        )
        return (account or {}).get("automountServiceAccountToken") is not False

    def _mount_table(
        self, image: Image, spec: dict[str, Any], mounts: dict[str, Path], termination: Path
    ) -> Path:
        """The mounts of one container, in order: user database, volumes, interpreter and
        image, log. The interpreter and the image's venv lie at host paths, which a volume
        (an emptyDir at ``/tmp``, say, when the checkout is under ``/tmp``) must not hide:
        in a real image they are not under any mount point, so they are mounted last."""
        base = Path(image.venv / "pyvenv.cfg").read_text().split("home = ")[1].split("\n")[0]
        rows = [
            ("file", str(self.kubelet.user_db(image, "passwd")), "/etc/passwd", "ro"),
            ("file", str(self.kubelet.user_db(image, "group")), "/etc/group", "ro"),
        ]
        for mount in spec.get("volumeMounts") or []:
            volume = next(v for v in self.spec.get("volumes") or [] if v["name"] == mount["name"])
            source = mounts[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
            read_only = (
                mount.get("readOnly")
                or any(
                    k in volume
                    for k in ("configMap", "secret", "downwardAPI", "projected", "image")
                )
                or (volume.get("persistentVolumeClaim") or {}).get("readOnly")
            )
            # An image volume as runtimes mount it (KEP-4639): read-only and noexec.
            options = "ro,noexec,nosuid,nodev" if "image" in volume else "ro" if read_only else "rw"
            rows.append(
                ("file" if source.is_file() else "dir", str(source), mount["mountPath"], options)
            )
        if SA_DIR in mounts:
            rows.append(("dir", str(mounts[SA_DIR]), SA_DIR, "ro"))
        rows += [
            ("dir", str(Path(base).parent), str(Path(base).parent), "ro"),
            ("dir", str(image.venv), str(image.venv), "ro"),
        ]
        target = spec.get("terminationMessagePath", "/dev/termination-log")
        rows.append(("file", str(termination), target, "rw"))
        table = self.dir / "roots" / f"{spec['name']}.mounts"
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text("".join(" ".join(shlex.quote(c) for c in row) + "\n" for row in rows))
        return table

    # ------------------------------------------------------------------ status

    def _status_of(self, container: Container) -> dict[str, Any]:
        status = {
            "name": container.name,
            "image": container.spec["image"],
            "state": container.state,
            "restartCount": container.restarts,
            "ready": "running" in container.state,
        }
        if container.last_state:
            status["lastState"] = container.last_state
        if container.process is not None:
            status["containerID"] = f"harness://{container.process.pid}"
        return status

    def _report(self) -> None:
        status = {
            "phase": self.phase,
            "podIP": "127.0.0.1",
            "hostIP": "127.0.0.1",
            "initContainerStatuses": [self._status_of(c) for c in self.inits],
            "containerStatuses": [self._status_of(c) for c in self.containers],
        }
        if self.message:
            status["message"] = self.message
        self.kubelet.write_status(self.namespace, self.pod_name, self.uid, status)

    def _kill_all(self) -> None:
        for container in [*self.inits, *self.containers]:
            process = container.process
            if process is not None and process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                    process.wait(timeout=scaled(10))
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=scaled(10))

    def pids(self) -> dict[str, int]:
        """The running containers' command processes (the last of the setup chain)."""
        found = {}
        for container in [*self.inits, *self.containers]:
            if container.process is not None and container.process.poll() is None:
                found[container.name] = container.process.pid
        return found


class Kubelet:
    """Runs the pods bound to this node; volumes and tokens under ``root``."""

    def __init__(
        self,
        kube: Kube,
        root: Path,
        images: dict[str, Image],
        api: Any,
        api_port: int,
        ca_pem: bytes,
    ) -> None:
        self.kube, self.root, self.images, self.api = kube, root, images, api
        self.api_port, self.ca_pem = api_port, ca_pem
        self.registry_cert_dir: Path | None = None  # the CA this node trusts for registries
        self.pods: dict[str, PodRunner] = {}
        self._user_dbs: dict[tuple[str, str], Path] = {}
        self._events: set[tuple[str, str, str]] = set()
        self.errors: list[str] = []  # what a pod's thread raised

    def read(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.kube.get(path("v1", plural, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def node_disk(self, node: str) -> Path:
        """A node's local disk (hostPath volumes resolve under it)."""
        where = self.root / "nodes" / node
        where.mkdir(parents=True, exist_ok=True)
        return where

    def image_volume(self, reference: str, auth: dict[str, Any]) -> Path:
        """An image volume: the image pulled by skopeo (with the pod's pull secrets and the
        node's trust for the registry) and its layers unpacked in order, once per digest."""
        if "@sha256:" not in reference:
            raise NotReady(f"image volume {reference}: the harness pulls by digest only")
        digest = reference.rsplit("@sha256:", 1)[1]
        where = self.root / "image-volumes" / digest
        if where.is_dir():
            return where
        work = self.root / "image-volumes" / f".pull-{secrets.token_hex(4)}"
        work.mkdir(parents=True)
        authfile = work / "auth.json"
        authfile.write_text(json.dumps(auth))
        flags = ["--src-authfile", str(authfile)]
        if self.registry_cert_dir is not None:
            flags += ["--src-cert-dir", str(self.registry_cert_dir)]
        pulled = subprocess.run(
            ["skopeo", "copy", *flags, f"docker://{reference}", f"dir:{work / 'image'}"],
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        if pulled.returncode != 0:
            raise NotReady(f"image volume {reference}: ErrImagePull: {pulled.stderr.strip()}")
        manifest = json.loads((work / "image" / "manifest.json").read_text())
        rootfs = work / "rootfs"
        rootfs.mkdir()
        for layer in manifest["layers"]:
            blob = work / "image" / layer["digest"].removeprefix("sha256:")
            with tarfile.open(blob, "r:*") as tar:
                tar.extractall(rootfs, filter="data")
        rootfs.chmod(0o755)
        os.rename(rootfs, where)
        return where

    def claim_dir(self, namespace: str, claim: str) -> Path:
        where = self.root / "claims" / namespace / claim
        where.mkdir(parents=True, exist_ok=True)
        return where

    @staticmethod
    def give_to_group(where: Path, gid: int) -> None:
        """fsGroup on a block-backed volume: group-owned, group-writable, setgid dirs."""
        for path_ in [where, *where.rglob("*")]:
            if path_.is_symlink():
                continue
            os.chown(path_, -1, gid)
            mode = path_.stat().st_mode
            path_.chmod((mode | 0o060 | (0o2010 if path_.is_dir() else 0)) & 0o7777)

    def user_db(self, image: Image, which: str) -> Path:
        key = (str(image.dockerfile), which)
        if key not in self._user_dbs:
            where = self.root / "etc" / f"{image.dockerfile.parent.name}-{which}"
            where.parent.mkdir(parents=True, exist_ok=True)
            where.write_text(image.base.passwd if which == "passwd" else image.base.group)
            self._user_dbs[key] = where
        return self._user_dbs[key]

    def mint_token(self, namespace: str, account: str) -> str:
        token = f"sa-{namespace}-{account}-{secrets.token_hex(8)}"
        groups = (
            "system:serviceaccounts",
            f"system:serviceaccounts:{namespace}",
            "system:authenticated",
        )
        self.api.tokens[token] = (f"system:serviceaccount:{namespace}:{account}", groups)
        return token

    def event(self, pod: dict[str, Any], reason: str, message: str) -> None:
        """A Warning event about ``pod`` from this kubelet, once per reason and message (a
        kubelet counts repeats on one event)."""
        meta = pod["metadata"]
        key = (meta["uid"], reason, message)
        if key in self._events:
            return
        self._events.add(key)
        now = _now()
        self.kube.create(
            path("v1", "events", meta["namespace"]),
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}"},
                "involvedObject": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta["uid"],
                },
                "type": "Warning",
                "reason": reason,
                "message": message,
                "source": {"component": "kubelet", "host": pod["spec"].get("nodeName", "")},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            },
        )

    def write_status(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        try:
            pod = self.kube.get(path("v1", "pods", namespace, name))
            if pod["metadata"]["uid"] == uid:
                self.kube.patch(path("v1", "pods", namespace, name) + "/status", {"status": status})
        except ApiError as exc:
            if exc.status != 404:
                raise

    def sync(self, pods: list[dict[str, Any]]) -> None:
        """Start the pods bound here that are new; stop those that are gone."""
        live = {p["metadata"]["uid"] for p in pods}
        for uid in [u for u in self.pods if u not in live]:
            self.pods.pop(uid).stop()
        for pod in pods:
            uid = pod["metadata"]["uid"]
            terminal = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            if pod["spec"].get("nodeName") and uid not in self.pods and not terminal:
                runner = self.pods[uid] = PodRunner(self, pod)
                runner.start()

    def stop(self) -> None:
        for runner in self.pods.values():
            runner.stop()
        for runner in self.pods.values():
            runner.join(timeout=scaled(15))


__all__ = ["Kubelet", "NotReady", "atomic_writer", "json"]
