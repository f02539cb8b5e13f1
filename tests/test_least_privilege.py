"""Least privilege: only the compile Job can write the cache, and verify needs only to read it.

- The init-container's real entry (``kernelcache verify`` with the very arguments the webhook
  injects) runs in a private mount namespace where every mount is read-only except its
  emptyDir, with no capabilities, as the pods' non-root uid where this interpreter can run as
  it (else as uid 0 stripped of every capability), against a store that is also
  ``chmod -R a-w``: it verifies and materializes, and no entry of the store changed (content,
  mode, owner, times).
- Every pod the product generates (the webhook's patch, compile and cleanup Jobs, the
  chart's operator Deployment) mounts the cache read-only wherever it is not the compile Job,
  writes nowhere but emptyDirs and its own volume, and runs non-root without escalation.
- The chart's RBAC is exactly what the operator is seen to call over a whole life cycle: the
  real operator against the emulated API server (``k8s_emulator``, the unavoidable test
  double), every request it makes mapped to its RBAC verb.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf", reason="needs kernelcache[operator]")
pytest.importorskip("kmock", reason="needs kmock (the Kubernetes API emulator)")

from kmock import Request

from kernelcache.controller import webhook
from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.kube import jobs_path, kernelcache_path
from kernelcache.controller.manifests import (
    ANNOTATION_CACHE,
    CLEANUP,
    COMPILE,
    LABEL_COMPONENT,
    SPEC_DIR,
    TERMINATION_LOG,
    claim_name,
    cleanup_job,
    compile_job,
    owner_reference,
    spec_digest,
)
from kernelcache.errors import ExitCode
from kernelcache.spec import parse_kernelcache
from tests.conftest import (
    kernelcache_doc,
    one_line_error,
    run_kernelcache,
    scaled,
    subprocess_env,
    wait_until,
)
from tests.helpers.chart import HELM, VALUES, granted_rules, render
from tests.helpers.generations import ARCH, COMPILED, IMAGE, NAME, NS, PRODUCT, TUNING, publish
from tests.operator_process import api_harness, finish_job, result_generation

CONFIG = OperatorConfig()
IMAGE_NAME, IMAGE_DIGEST = IMAGE.split("@")


SIGNED = {"verification": {"signing": {"enabled": True, "secretName": "kc-keys"}}}


def kernelcache_body(**spec: Any) -> dict[str, Any]:
    """The KernelCache whose generation ``publish`` writes (its namespace, name and image)."""
    body = kernelcache_doc(
        NAME,
        NS,
        engine={"image": IMAGE_NAME, "imageDigest": IMAGE_DIGEST},
        gpuClasses=[{"name": "h200", "arch": ARCH, "gpuProduct": PRODUCT}],
        **spec,
    )
    body["metadata"]["uid"] = "0000-uid"
    return body


# --------------------------------------------------------------------------- mounts and contexts

ALWAYS_READ_ONLY = ("configMap", "secret", "downwardAPI", "projected")  # as the kubelet mounts them


def volume_kind(volume: dict[str, Any]) -> str:
    return next(k for k in volume if k != "name")


def writable_mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """The container's mount paths it can write, with the kind of volume behind each."""
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    found = {}
    for mount in container.get("volumeMounts") or []:
        volume = volumes[mount["name"]]
        kind = volume_kind(volume)
        read_only = (
            mount.get("readOnly")
            or kind in ALWAYS_READ_ONLY
            or (volume.get("persistentVolumeClaim") or {}).get("readOnly")
        )
        if not read_only:
            found[mount["mountPath"]] = kind
    return found


def assert_unprivileged(pod: dict[str, Any], container: dict[str, Any]) -> None:
    """Non-root, no escalation, no capabilities, RuntimeDefault seccomp, read-only root fs."""
    own = container.get("securityContext") or {}
    effective = {**(pod.get("securityContext") or {}), **own}
    where = container["name"]
    assert effective.get("runAsNonRoot") is True, where
    assert effective.get("runAsUser", 1) != 0, where
    assert effective.get("seccompProfile") == {"type": "RuntimeDefault"}, where
    assert own.get("allowPrivilegeEscalation") is False, where
    assert own.get("readOnlyRootFilesystem") is True, where
    assert not own.get("privileged"), where
    assert own.get("capabilities") == {"drop": ["ALL"]}, where


# --------------------------------------------------------------------------- the webhook's patch


def serving_pod(**extra_spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "server", "namespace": NS, "labels": {webhook.LABEL_CACHE: NAME}},
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": IMAGE,
                    "volumeMounts": [{"name": "model", "mountPath": "/m"}],
                },
                {"name": "proxy", "image": IMAGE},
            ],
            "volumes": [{"name": "model", "emptyDir": {}}],
            **extra_spec,
        },
    }


def inject(pod: dict[str, Any], kc: dict[str, Any]) -> dict[str, Any]:
    return webhook.apply_ops(pod, webhook.mutate_pod(pod, kc, CONFIG))


@pytest.mark.parametrize("signing", [False, True], ids=["unsigned", "signed"])
def test_injected_pod_reads_the_cache_and_writes_only_emptydirs(signing: bool) -> None:
    """The init-container: the claim read-only, its only writable mount the emptyDir, locked
    down; serving containers: no claim at all, the emptyDir copy read-only."""
    kc = kernelcache_body(**(SIGNED if signing else {}))
    spec = inject(serving_pod(), kc)["spec"]
    store = next(v for v in spec["volumes"] if v["name"] == webhook.STORE_VOLUME)
    assert store["persistentVolumeClaim"] == {
        "claimName": claim_name(parse_kernelcache(kc, "kc")),
        "readOnly": True,
    }
    (init,) = spec["initContainers"]
    assert writable_mounts(spec, init) == {webhook.CACHE_DIR: "emptyDir"}
    mounted = {m["name"]: m for m in init["volumeMounts"]}
    assert mounted[webhook.STORE_VOLUME]["readOnly"] is True
    assert (webhook.KEY_VOLUME in mounted) is signing
    if signing:
        key = next(v for v in spec["volumes"] if v["name"] == webhook.KEY_VOLUME)
        assert key["secret"]["items"] == [{"key": "kernelcache.pub", "path": "kernelcache.pub"}]
    assert_unprivileged(spec, init)
    for container in spec["containers"]:
        names = {m["name"] for m in container["volumeMounts"]}
        assert webhook.STORE_VOLUME not in names and webhook.KEY_VOLUME not in names
        assert writable_mounts(spec, container) == (
            {"/m": "emptyDir"} if container["name"] == "vllm" else {}
        )
        cache = next(m for m in container["volumeMounts"] if m["name"] == webhook.CACHE_VOLUME)
        assert cache == {
            "name": webhook.CACHE_VOLUME,
            "mountPath": webhook.CACHE_DIR,
            "readOnly": True,
        }


def claim_volume(**pvc: Any) -> dict[str, Any]:
    return {"name": "cache", "persistentVolumeClaim": {"claimName": f"kernelcache-{NAME}", **pvc}}


CLAIM_MOUNT = {"name": "cache", "mountPath": "/cache"}


@pytest.mark.parametrize("in_init", [False, True], ids=["serving-container", "own-init-container"])
def test_a_pod_mounting_the_cache_claim_writable_is_refused(in_init: bool) -> None:
    pod = serving_pod(volumes=[{"name": "model", "emptyDir": {}}, claim_volume()])
    target = {"name": "fetch", "image": "busybox"} if in_init else pod["spec"]["containers"][1]
    target["volumeMounts"] = [CLAIM_MOUNT]
    if in_init:
        pod["spec"]["initContainers"] = [target]
    with pytest.raises(webhook.Denied) as refused:
        inject(pod, kernelcache_body())
    assert f"container {target['name']!r} mounts claim 'kernelcache-{NAME}'" in str(refused.value)
    assert "writable; only its compile Job may write it" in str(refused.value)


@pytest.mark.parametrize(
    ("volume", "mount"),
    [
        (claim_volume(readOnly=True), CLAIM_MOUNT),
        (claim_volume(), {**CLAIM_MOUNT, "readOnly": True}),
    ],
    ids=["read-only-claim", "read-only-mount"],
)
def test_a_pod_mounting_the_cache_claim_read_only_is_admitted(
    volume: dict[str, Any], mount: dict[str, Any]
) -> None:
    pod = serving_pod(volumes=[{"name": "model", "emptyDir": {}}, volume])
    pod["spec"]["containers"][1]["volumeMounts"] = [mount]
    spec = inject(pod, kernelcache_body())["spec"]
    for container in [*spec["initContainers"], *spec["containers"]]:
        assert "persistentVolumeClaim" not in writable_mounts(spec, container).values()


# --------------------------------------------------------------------------- the operator's Jobs


def test_compile_job_writes_only_the_store_and_scratch() -> None:
    body = kernelcache_body(**SIGNED)
    kc = parse_kernelcache(body, "kc")
    job = compile_job(
        kc, arch=ARCH, digest=spec_digest(kc), attempt=0, owner=owner_reference(body), config=CONFIG
    )
    pod = job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert writable_mounts(pod, container) == {
        CONFIG.store_mount_path: "persistentVolumeClaim",
        "/tmp": "emptyDir",
    }
    assert {m["name"]: m.get("readOnly") for m in container["volumeMounts"]} == {
        "store": None,
        "spec": True,
        "signing": True,
        "tmp": None,
    }
    assert_unprivileged(pod, container)


def secret_volume(volume: dict[str, Any], data: dict[str, bytes], at: Path) -> Path:
    """The kubelet's layout of a Secret volume: one file per key, or per projected item."""
    items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
    for item in items:
        assert item["key"] in data, f"Secret has no key {item['key']!r}: {sorted(data)}"
        (at / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (at / item["path"]).write_bytes(data[item["key"]])
    return at


def test_a_secret_made_from_keygen_output_signs_in_the_job_and_verifies_in_the_pod(
    tmp_path: Path,
) -> None:
    """``kernelcache keygen DIR``, then ``kubectl create secret generic --from-file`` of each
    file it wrote (the Secret's keys are the file names): the compile Job finds its private
    key, the pod gets the public key only, and the init-container verifies the signature."""
    keygen = run_kernelcache("keygen", str(tmp_path / "keys"))
    assert keygen.returncode == 0, keygen.stderr
    data = {p.name: p.read_bytes() for p in (tmp_path / "keys").iterdir()}
    body = kernelcache_body(**SIGNED)
    kc = parse_kernelcache(body, "kc")

    job = compile_job(
        kc, arch=ARCH, digest=spec_digest(kc), attempt=0, owner=owner_reference(body), config=CONFIG
    )
    pod = job["spec"]["template"]["spec"]
    (warm,) = pod["containers"]
    mount = next(m for m in warm["volumeMounts"] if m["name"] == "signing")
    volume = next(v for v in pod["volumes"] if v["name"] == "signing")
    job_keys = secret_volume(volume, data, tmp_path / "job-signing")
    key_arg = warm["command"][warm["command"].index("--signing-key") + 1]
    private = job_keys / Path(key_arg).relative_to(mount["mountPath"])
    assert private.is_file(), f"the Job's {key_arg} is not in the Secret: {sorted(data)}"
    store = tmp_path / "store"
    publish(store, signing_key=private)

    spec = inject(serving_pod(), body)["spec"]
    (init,) = spec["initContainers"]
    mount = next(m for m in init["volumeMounts"] if m["name"] == webhook.KEY_VOLUME)
    volume = next(v for v in spec["volumes"] if v["name"] == webhook.KEY_VOLUME)
    pod_keys = secret_volume(volume, data, tmp_path / "pod-signing")
    assert [p.name for p in pod_keys.iterdir()] == [webhook.PUBLIC_KEY_FILE]  # no private key
    here = {
        CONFIG.store_mount_path: str(store),
        webhook.CACHE_DIR: str(tmp_path / "kernelcache"),
        TERMINATION_LOG: str(tmp_path / "termination-log"),
        mount["mountPath"]: str(pod_keys),
    }
    args = [next((a.replace(k, v, 1) for k, v in here.items() if a.startswith(k)), a)
            for a in init["args"]]  # fmt: skip
    assert "--require-signature" in args
    env = {k: v for k, v in subprocess_env().items() if not k.startswith(("KERNELCACHE_", "KUBE"))}
    env.update(HOME=str(tmp_path), KERNELCACHE_ARCH=ARCH, KERNELCACHE_GPU_PRODUCT=PRODUCT)
    (tmp_path / "kernelcache").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "kernelcache", "verify", *args],
        env=env, capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "verified" in done.stdout
    assert f"--from-file={tmp_path / 'keys'}" in keygen.stdout  # it says how to make the Secret


def test_a_volume_that_ignores_fsgroup_is_named_and_fix_store_ownership_fixes_it(
    pod_dir: Path,
) -> None:
    """An NFS-style export: another owner's 0755 directory, fsGroup not applied. The compile
    Job's warm fails in one line naming the owner and the chart setting; with the setting,
    the Job's init-container (the export's owner, CAP_CHOWN only) makes it work.

    The warm runs as the pods' user where this interpreter can, the export then root's as on
    NFS; else as uid 0 without capabilities (bound by permission bits like any user) and the
    export is nobody's, whose uid the init-container then runs as, still with CAP_CHOWN only.
    """
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv")
    user = pod_user()
    job, export = (user, (0, 0)) if user is not None else ((0, 0), (65534, 65534))
    store, home = pod_dir / "store", pod_dir / "home"
    store.mkdir(mode=0o755)
    os.chown(store, *export)
    home.mkdir()
    os.chown(home, *job)
    write = "import os, pathlib; pathlib.Path(os.environ['TRITON_CACHE_DIR'], 'k.bin').touch()"
    body = kernelcache_body(warmers=[{"type": "command", "command": [sys.executable, "-c", write]}])
    (pod_dir / "kernelcache.yaml").write_text(yaml.safe_dump(body))
    here = {
        CONFIG.store_mount_path: str(store),
        SPEC_DIR: str(pod_dir),
        TERMINATION_LOG: str(home / "termination-log"),
        f"{CONFIG.run_as_user}:{CONFIG.run_as_group}": f"{job[0]}:{job[1]}",
    }

    def local(argv: list[str]) -> list[str]:
        return [next((a.replace(k, v, 1) for k, v in here.items() if a.startswith(k)), a)
                for a in argv]  # fmt: skip

    def pod(config: OperatorConfig) -> dict[str, Any]:
        kc = parse_kernelcache(body, "kc")
        built = compile_job(
            kc, arch=ARCH, digest="d" * 16, attempt=0, owner=owner_reference(body), config=config
        )
        return built["spec"]["template"]["spec"]

    (warm,) = pod(CONFIG)["containers"]
    assert "initContainers" not in pod(CONFIG)
    env = {**subprocess_env(), "HOME": str(home)}
    as_job = ["setpriv", "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    if user is not None:
        as_job += [f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups"]
    argv = [*as_job, sys.executable, "-m", *local(warm["command"])]
    refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=scaled(120))
    assert refused.returncode == ExitCode.IO, refused.stderr
    line = one_line_error(refused)
    assert f"{store}/{NS}: EACCES" in line, line
    assert f"{store} is owned by uid {export[0]} gid {export[1]} mode 0755" in line, line
    assert "operator.fixStoreOwnership=true" in line, line

    (init,) = pod(OperatorConfig(fix_store_ownership=True))["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert (init["securityContext"]["runAsUser"], init["image"]) == (0, CONFIG.cleanup_image)
    owner_with_chown = ["setpriv", "--inh-caps=-all,+chown", "--bounding-set=-all,+chown"]
    if export != (0, 0):
        owner_with_chown += [f"--reuid={export[0]}", f"--regid={export[1]}", "--clear-groups"]
        owner_with_chown += ["--ambient-caps=-all,+chown"]
    done = subprocess.run(
        [*owner_with_chown, *local(init["command"])],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert done.returncode == 0, done.stderr
    for directory in (store / NS, store / NS / NAME):
        assert (directory.stat().st_uid, directory.stat().st_gid) == job
    assert (store.stat().st_uid, stat.S_IMODE(store.stat().st_mode)) == (export[0], 0o755)
    warmed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=scaled(120))
    assert warmed.returncode == 0, warmed.stderr


def test_cleanup_job_writes_only_the_store() -> None:
    kc = parse_kernelcache(kernelcache_body(storage={"existingClaim": "shared"}), "kc")
    pod = cleanup_job(kc, "0000-uid", CONFIG)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert writable_mounts(pod, container) == {CONFIG.store_mount_path: "persistentVolumeClaim"}
    assert_unprivileged(pod, container)


# --------------------------------------------------------------------------- the chart


WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "Pod")
needs_helm = pytest.mark.skipif(not HELM.exists(), reason="helm is not installed")


@needs_helm
@pytest.mark.parametrize("values", sorted(VALUES))
def test_chart_workloads_write_only_emptydirs_and_run_unprivileged(values: str) -> None:
    """Every pod template the chart renders (the real ``helm template``), in every value set."""
    workloads = [d for d in render(values) if d["kind"] in WORKLOADS]
    assert workloads
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        for container in [*(pod.get("initContainers") or []), *pod["containers"]]:
            assert set(writable_mounts(pod, container).values()) <= {"emptyDir"}, container["name"]
            assert_unprivileged(pod, container)


# --------------------------------------------------------------------------- verify, read-only

# Run by sh in a fresh mount namespace: the emptyDir becomes a mount of its own, every other
# mount is remounted read-only (in this namespace only), then the command runs.
READ_ONLY_WORLD = r"""
set -eu
emptydir=$1
shift
mount --bind "$emptydir" "$emptydir"
for point in $(awk '{print $5}' /proc/self/mountinfo); do
    [ "$point" = "$emptydir" ] || mount -o remount,bind,ro "$point" 2>/dev/null || true
done
exec "$@"
"""


def unshare() -> list[str]:
    """A private mount namespace: as root directly, else inside a user namespace."""
    command = ["unshare", "--mount", "--propagation", "private"]
    return command if os.geteuid() == 0 else [*command, "--map-root-user"]


@functools.cache
def no_read_only_world() -> str | None:
    """Why the read-only world cannot be built here, or None when it can."""
    for tool in ("unshare", "setpriv", "mount", "awk"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    done = subprocess.run([*unshare(), "true"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"no private mount namespace (needs root or user namespaces): {done.stderr.strip()}"
    return None


@functools.cache
def pod_user() -> tuple[int, int] | None:
    """The pods' uid and gid when this very interpreter runs as them, else None: the child
    then stays uid 0 without any capability, which permission bits bind like any user."""
    if os.geteuid() != 0:
        return None
    uid, gid = CONFIG.run_as_user, CONFIG.run_as_group
    as_user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    probe = [sys.executable, "-c", "import sys; print(sys.version)"]
    done = subprocess.run([*as_user, *probe], capture_output=True, text=True, check=False)
    return (uid, gid) if done.returncode == 0 and done.stdout.strip() == sys.version else None


def in_read_only_world(
    emptydir: Path, argv: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``argv`` with no capabilities (and as the pods' user when possible), every mount
    read-only but ``emptydir``."""
    drop = ["setpriv", "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    user = pod_user()
    if user is not None:
        drop += [f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups"]
    command = [*unshare(), "sh", "-c", READ_ONLY_WORLD, "sandbox", str(emptydir), *drop, *argv]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(120))


def tree_state(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry's type, mode, owner, size, mtime, ctime and content digest."""
    state = {}
    for path in sorted([root, *root.rglob("*")]):
        info = path.lstat()
        if stat.S_ISREG(info.st_mode):
            content = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            content = os.readlink(path) if stat.S_ISLNK(info.st_mode) else ""
        state[path.relative_to(root).as_posix()] = (
            stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid,
            info.st_size, info.st_mtime_ns, info.st_ctime_ns, content,
        )  # fmt: skip
    return state


def read_only_store(root: Path) -> None:
    """``chmod -R a-w``: what a read-only claim looks like from inside, on top of the mount."""
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(stat.S_IMODE(path.lstat().st_mode) & ~0o222)


@pytest.fixture
def pod_dir() -> Iterator[Path]:
    """A directory the pods' user can reach (pytest's own tmp dirs are private to root)."""
    with tempfile.TemporaryDirectory(prefix="kernelcache-pod-") as tmp:
        os.chmod(tmp, 0o755)
        yield Path(tmp)
        for path in Path(tmp).rglob("*"):  # give write back, or the cleanup cannot remove it
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)


def verify_argv(store: Path, emptydir: Path, termination_log: Path) -> list[str]:
    """The init-container the webhook injects, as a command of this machine's paths."""
    container = webhook.init_container(parse_kernelcache(kernelcache_body(), "kc"), CONFIG)
    here = {
        CONFIG.store_mount_path: str(store),
        webhook.CACHE_DIR: str(emptydir),
        TERMINATION_LOG: str(termination_log),
    }
    assert container["command"] == ["kernelcache", "verify"]
    return [
        sys.executable,
        "-m",
        *container["command"],
        *(here.get(a, a) for a in container["args"]),
    ]


def test_verify_reads_a_read_only_store_and_writes_only_its_emptydir(pod_dir: Path) -> None:
    """The injected init-container's command, in a world where only its emptyDir is writable."""
    reason = no_read_only_world()
    if reason is not None:
        pytest.skip(reason)
    store, emptydir = pod_dir / "store", pod_dir / "kernelcache"
    termination_log = pod_dir / "termination-log"  # read-only too: only a failure writes it
    gen = publish(store)
    read_only_store(store)
    emptydir.mkdir()
    user = pod_user()
    if user is not None:
        os.chown(emptydir, *user)
    before = tree_state(store)
    env = {k: v for k, v in subprocess_env().items() if not k.startswith(("KERNELCACHE_", "KUBE"))}
    # This node's arch and product, as the overrides say (no API server to read labels from).
    env.update(HOME=str(pod_dir), KERNELCACHE_ARCH=ARCH, KERNELCACHE_GPU_PRODUCT=PRODUCT)

    # The world is what it claims: the emptyDir is its one writable mount, no capability is
    # left, and the store refuses a write.
    probe = in_read_only_world(
        emptydir,
        [
            "sh",
            "-c",
            'cat /proc/self/mountinfo; grep CapEff /proc/self/status; touch "$0/x"',
            str(store),
        ],
        env,
    )
    assert probe.returncode != 0 and f"{store}/x" in probe.stderr, probe.stderr
    top: dict[str, str] = {}
    for line in probe.stdout.splitlines():
        fields = line.split()
        if fields[0] == "CapEff:":
            assert int(fields[1], 16) == 0, line
        else:
            top[fields[4]] = fields[5]  # a later mount on the same point hides the earlier
    assert [point for point, options in top.items() if "rw" in options.split(",")] == [
        str(emptydir)
    ]

    done = in_read_only_world(emptydir, verify_argv(store, emptydir, termination_log), env)
    assert done.returncode == 0, done.stderr
    assert "verified" in done.stdout and done.stderr == ""
    copy = emptydir / gen.name
    for rel, data in {**COMPILED, **TUNING}.items():
        assert (copy / "files" / rel).read_bytes() == data
    env_file = (emptydir / "kernelcache.env").read_text()
    assert f"KERNELCACHE_DIR={copy}" in env_file
    if user is not None:
        assert {p.stat().st_uid for p in emptydir.rglob("*")} == {user[0]}
    assert tree_state(store) == before
    assert not termination_log.exists()
    print(f"verify ran as uid {user[0] if user else '0 without capabilities'}")


# --------------------------------------------------------------------------- RBAC as called


def rbac_of(request: Request) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) an API request needs; None for discovery."""
    resource = request.resource
    if resource is None or not resource.plural:
        return None
    plural = resource.plural + (f"/{request.subresource}" if request.subresource else "")
    method = request.method.value
    if method == "GET":
        watching = request.params.get("watch") in ("true", "1")
        verb = "watch" if watching else "get" if request.name else "list"
    elif method == "DELETE":
        verb = "delete" if request.name else "deletecollection"
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update"}[method]
    return resource.group or "", plural, verb


@needs_helm
def test_rbac_grants_exactly_what_the_operator_calls(tmp_path: Path) -> None:
    """A whole life cycle, every branch that calls the API: a KernelCache on a claim of its
    own and one on a shared claim, both deleting their data on delete; a Job's pod waits to
    start, Jobs succeed, Jobs are stopped, the shared claim's data goes by a cleanup Job."""
    called: set[tuple[str, str, str]] = set()

    def record(request: Request, token: str) -> bool:
        if token.startswith("operator-") and (rbac := rbac_of(request)) is not None:
            called.add(rbac)
        return True

    namespace = "rbac"
    drop_data = {"deleteDataOnDelete": True}
    own = kernelcache_doc("own-claim", namespace, retention=drop_data)
    shared = kernelcache_doc(
        "shared-claim",
        namespace,
        storage={"existingClaim": "shared"},
        retention=drop_data,
        verification={"signing": {"enabled": True, "secretName": "keys"}},  # read, watched
    )
    with api_harness(tmp_path) as api:
        api.emulator.before = record
        operator = api.start_operator(RESYNC_SECONDS="1", CLEANUP_POLL_SECONDS="0.5")
        kube = api.kube
        for body in (own, shared):
            kube.request("POST", kernelcache_path(namespace), body=body)

        def jobs_of(name: str, component: str = COMPILE) -> list[dict[str, Any]]:
            return [
                j
                for j in kube.list(jobs_path(namespace))
                if j["metadata"]["annotations"][ANNOTATION_CACHE] == name
                and j["metadata"]["labels"][LABEL_COMPONENT] == component
            ]

        def phase(name: str) -> str | None:
            return (kube.get(kernelcache_path(namespace, name)).get("status") or {}).get("phase")

        def arches_of(name: str) -> list[dict[str, Any]]:
            status = kube.get(kernelcache_path(namespace, name)).get("status") or {}
            return list(status.get("arches") or [])

        (job,) = wait_until(lambda: jobs_of("own-claim"), what="the compile Job")
        # Its pod is still being created: the operator reads the pod's events for a reason.
        labels = job["spec"]["template"]["metadata"]["labels"]
        meta = {"name": f"{job['metadata']['name']}-waiting", "labels": labels}
        waiting = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "status": {"phase": "Pending"},
        }
        kube.create(f"/api/v1/namespaces/{namespace}/pods", waiting)
        kube.patch(
            jobs_path(namespace, job["metadata"]["name"]) + "/status", {"status": {"active": 1}}
        )
        wait_until(lambda: ("", "events", "list") in called, what="the waiting pod's events read")
        finish_job(kube, job, succeeded=True)
        wait_until(lambda: phase("own-claim") == "Ready", what="own-claim Ready")
        # A GPU node joins: the namespace's node map is rewritten.
        gpu = {"nvidia.com/gpu.compute.major": "9", "nvidia.com/gpu.compute.minor": "0"}
        kube.create("/api/v1/nodes", {"metadata": {"name": "gpu-1", "labels": gpu}})
        node_map = f"/api/v1/namespaces/{namespace}/configmaps/kernelcache-nodes"
        wait_until(lambda: "gpu-1" in (kube.get(node_map).get("data") or {}), what="the map")
        # A spec change publishes a second generation: the published record is updated.
        image = {"spec": {"engine": {"image": "ghcr.io/kernelcache/examples:0.2.0"}}}
        kube.patch(kernelcache_path(namespace, "own-claim"), image)
        seen = {job["metadata"]["name"]}
        (job,) = wait_until(
            lambda: [j for j in jobs_of("own-claim") if j["metadata"]["name"] not in seen],
            what="the second compile Job",
        )
        finish_job(kube, job, succeeded=True)
        published = result_generation(job["metadata"]["name"])
        wait_until(
            lambda: [a.get("generation") for a in arches_of("own-claim")] == [published],
            what="the second generation in status",
        )
        wait_until(lambda: jobs_of("shared-claim"), what="the shared claim's compile Job")
        for body in (own, shared):
            kube.delete(kernelcache_path(namespace, body["metadata"]["name"]))
        (cleanup,) = wait_until(lambda: jobs_of("shared-claim", CLEANUP), what="the cleanup Job")
        finish_job(kube, cleanup, succeeded=True)
        wait_until(lambda: not kube.list(kernelcache_path(namespace)), what="both to go")
        operator.stop()
    granted = granted_rules(render("defaults"))
    assert called - granted == set(), "called but not granted"
    assert granted - called == set(), "granted but never called"
