"""The init-container's `kernelcache verify`: a failure matrix through the real CLI.

Every failure case runs the real command in a fresh process and checks what a cluster
operator would see: the exit code of its class, one stderr line naming the factor or file,
the same line in the termination-log file (what `kubectl describe pod` shows), and a
materialize target holding nothing that looks valid (no `.complete` marker, no env file).

Generations are small fake files published with real stamps (`stamp.collect`), so no GPU,
DSL or toolchain is needed. Children run with PATH set to a directory of our own, so whether
an `nvidia-smi` exists there is decided by the test, not by the machine.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kernelcache import contract, measure, node, stamp_policy
from kernelcache import stamp as stamps
from kernelcache.errors import ExitCode, NoGpuInfoError, SpecError
from kernelcache.spec import SIGNING_KEY_FILE
from kernelcache.store import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    generate_keypair,
)
from tests.conftest import scaled, subprocess_env
from tests.helpers.generations import (
    ARCH,
    COMPILED,
    IMAGE,
    KEY,
    NAME,
    NS,
    PRODUCT,
    TUNING,
    make_stamp,
    publish,
)

H200_LABELS = {
    "nvidia.com/gpu.product": "NVIDIA-H200",
    "nvidia.com/gpu.compute.major": "9",
    "nvidia.com/gpu.compute.minor": "0",
}


class NodeMap:
    """The operator's node map as the kubelet mounts it (``..data`` symlinks included), with
    the given nodes' labels; nodes not given are not in it."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "node-map"
        self.dir.mkdir()
        (self.dir / "..2026_12_01").mkdir()
        (self.dir / "..data").symlink_to("..2026_12_01")

    def __setitem__(self, node: str, labels: dict[str, str]) -> None:
        (self.dir / "..data" / node).write_text(json.dumps(labels))
        (self.dir / node).symlink_to(f"..data/{node}")


@pytest.fixture
def node_map(tmp_path: Path) -> NodeMap:
    return NodeMap(tmp_path)


@dataclass
class Pod:
    """One init-container run's world: a store, a target emptyDir, a termination log."""

    tmp: Path
    store: Path = field(init=False)
    target: Path = field(init=False)
    termination_log: Path = field(init=False)
    bin: Path = field(init=False)
    node_map: Path | None = None

    def __post_init__(self) -> None:
        self.store = self.tmp / "store"
        self.target = self.tmp / "emptydir"
        self.termination_log = self.tmp / "termination-log"
        self.bin = self.tmp / "bin"
        self.bin.mkdir()
        self.target.mkdir()

    def fake_nvidia_smi(self, output: str) -> None:
        script = self.bin / "nvidia-smi"
        script.write_text(f"#!/bin/sh\nprintf '%s\\n' {shlex.quote(output)}\n")
        script.chmod(0o755)

    def verify(self, *args: str, store: Path | None = None) -> subprocess.CompletedProcess:
        env = subprocess_env(PATH=str(self.bin))
        for name in list(env):
            if name.startswith(("KERNELCACHE_", "KUBERNETES_")) or name == "KUBECONFIG":
                del env[name]
        if self.node_map is not None:
            env["KERNELCACHE_NODE_MAP"] = str(self.node_map)
        cmd = [
            sys.executable, "-m", "kernelcache", "verify",
            "--store", str(store or self.store),
            "--materialize", str(self.target),
            "--termination-log", str(self.termination_log),
            *args,
        ]  # fmt: skip
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(120))

    def assert_refused(self, proc: subprocess.CompletedProcess, code: ExitCode, *names: str) -> str:
        assert proc.returncode == code, (proc.returncode, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        line = lines[0]
        assert line.startswith("kernelcache: error: "), line
        for name in names:
            assert name in line, (name, line)
        assert self.termination_log.read_text() == line + "\n"
        self.assert_nothing_valid()
        return line

    def assert_nothing_valid(self) -> None:
        if not self.target.is_dir():
            return
        left = sorted(p.relative_to(self.target).as_posix() for p in self.target.rglob("*"))
        assert not [p for p in left if p.endswith(".complete")], left
        assert contract.ENV_FILE not in left and contract.REPORT_FILE not in left, left


@pytest.fixture
def pod(tmp_path: Path) -> Pod:
    return Pod(tmp_path)


def read_env(pod: Pod) -> dict[str, str]:
    text = (pod.target / contract.ENV_FILE).read_text()
    return dict(line.split("=", 1) for line in shlex.split(text, posix=True))


# --------------------------------------------------------------------------- the matrix


def flip_byte(gen: Path, tmp: Path) -> None:
    victim = gen / "files" / "cute-dsl" / "gemm_128x256.o"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))


def truncate_file(gen: Path, tmp: Path) -> None:
    victim = gen / "files" / "triton" / "k3x" / "matmul.cubin"
    victim.write_bytes(victim.read_bytes()[:100])


def remove_file(gen: Path, tmp: Path) -> None:
    (gen / "files" / "cute-dsl" / "gemm_128x256.json").unlink()


def add_file(gen: Path, tmp: Path) -> None:
    (gen / "files" / "cute-dsl" / "planted.o").write_bytes(b"\x7fELF planted")


def truncate_manifest(gen: Path, tmp: Path) -> None:
    manifest = gen / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes()[:200])


def escape_in_manifest(gen: Path, tmp: Path) -> None:
    manifest = gen / MANIFEST_NAME
    doc = json.loads(manifest.read_text())
    doc["files"][0]["path"] = "../../../escape.o"
    manifest.write_text(json.dumps(doc))


def symlink_out(gen: Path, tmp: Path) -> None:
    victim = gen / "files" / "cute-dsl" / "gemm_128x256.json"
    outside = tmp / "outside.json"
    outside.write_bytes(COMPILED["cute-dsl/gemm_128x256.json"])
    victim.unlink()
    victim.symlink_to(outside)


def key_dir_not_a_dir(gen: Path, tmp: Path) -> None:
    """The key's directory replaced by a FIFO: as root, chmod would not stop the reader."""
    key_dir = gen.parent
    moved = tmp / "moved-key"
    key_dir.rename(moved)
    os.mkfifo(key_dir)


# Hostile layouts: a generation of another key placed under this one, and names of the store
# that are not what kernelcache writes there. Each verified on an older main.


def point_current(key_dir: Path, gen_dir: Path) -> None:
    """Copy gen_dir into key_dir under its own name and make CURRENT name it."""
    shutil.copytree(gen_dir, key_dir / gen_dir.name, symlinks=True)
    (key_dir / "CURRENT").write_text(gen_dir.name + "\n")


def other_arch_copied_in(gen: Path, tmp: Path) -> None:
    """An sm_120a generation of this KernelCache copied into the sm_90a key."""
    other_key = f"{NS}/{NAME}/sm_120a"
    point_current(gen.parent, publish(gen.parents[3], other_key, stamp=make_stamp(arch="sm_120a")))


def other_model_replayed(gen: Path, tmp: Path) -> None:
    """A generation of another KernelCache (another model), signed with the same key."""
    other = publish(
        gen.parents[3],
        f"{NS}/other-model/{ARCH}",
        stamp=make_stamp(**{"extra/model": "example/other-model"}),
        signing_key=tmp / "keys" / SIGNING_KEY_FILE,
    )
    point_current(gen.parent, other)


def renamed_generation(gen: Path, tmp: Path) -> None:
    """This key's own generation under another directory name."""
    renamed = gen.parent / ("0" * 32)
    gen.rename(renamed)
    (gen.parent / "CURRENT").write_text(renamed.name + "\n")


def stamp_without_arch(gen: Path, tmp: Path) -> None:
    """A generation whose stamp records no arch, as no current build writes one."""
    factors = {k: v for k, v in make_stamp()["factors"].items() if k != "arch"}
    publish(gen.parents[3], stamp=stamps.Stamp(factors).to_dict())


def generation_symlinked_to_other_key(gen: Path, tmp: Path) -> None:
    """Under a generation id: a symlink to another key's generation of the same content."""
    other = publish(gen.parents[3], f"{NS}/copy/{ARCH}")
    shutil.rmtree(gen)
    gen.symlink_to(other)


def generation_symlinked_outside(gen: Path, tmp: Path) -> None:
    outside = tmp / "outside-generation"
    gen.rename(outside)
    gen.symlink_to(outside)


def current_symlinked_outside(gen: Path, tmp: Path) -> None:
    outside = tmp / "outside-current"
    outside.write_text(gen.name + "\n")
    (gen.parent / "CURRENT").unlink()
    (gen.parent / "CURRENT").symlink_to(outside)


def current_a_fifo(gen: Path, tmp: Path) -> None:
    """A FIFO as CURRENT: reading it blocked verify forever."""
    (gen.parent / "CURRENT").unlink()
    os.mkfifo(gen.parent / "CURRENT")


def key_segment_symlinked(levels: int) -> Callable[[Path, Path], None]:
    """The arch (levels=1), name (2) or namespace (3) directory moved out and symlinked."""

    def mutate(gen: Path, tmp: Path) -> None:
        segment = gen.parents[levels - 1]
        outside = tmp / f"outside-{segment.name}"
        segment.rename(outside)
        segment.symlink_to(outside)

    return mutate


def hard_linked_outside(gen: Path, tmp: Path) -> None:
    os.link(gen / "files" / "cute-dsl" / "gemm_128x256.o", tmp / "outside-link.o")


def artifact_mode_000(gen: Path, tmp: Path) -> None:
    """Root still reads it; the serving user would not."""
    (gen / "files" / "triton" / "k3x" / "matmul.cubin").chmod(0)


def directory_mode_000(gen: Path, tmp: Path) -> None:
    (gen / "files" / "triton" / "k3x").chmod(0)


@dataclass
class Case:
    mutate: Callable[[Path, Path], None] | None
    args: tuple[str, ...]
    code: ExitCode
    names: tuple[str, ...]
    labels: dict[str, str] | None = None  # the --node-name's labels (None: not in the map)
    signed: bool = False
    stamp_changes: dict[str, str] = field(default_factory=dict)  # factors built differently


BY_KEY = ("--key", KEY, "--gpu-product", PRODUCT)
BY_NAME = ("--namespace", NS, "--name", NAME)

CASES = {
    "no generation for the arch": Case(
        None,
        ("--namespace", NS, "--name", "other", "--arch", ARCH),
        ExitCode.MISSING_GENERATION,
        (f"{NS}/other/{ARCH}", "arches built: none"),
    ),
    "wrong arch: labels say sm_100, only sm_90a built": Case(
        None,
        (*BY_NAME, "--node-name", "gpu-b200"),
        ExitCode.MISSING_GENERATION,
        ("ns/demo/sm_100a", "arches built: sm_90a"),
        labels={**H200_LABELS, "nvidia.com/gpu.compute.major": "10"},
    ),
    "key for another arch than the node's": Case(
        None,
        ("--key", KEY, "--arch", "sm_100a"),
        ExitCode.STAMP_MISMATCH,
        ("arch: sm_90a != sm_100a", "--arch"),
    ),
    "tuning for another GPU product (strict)": Case(
        None,
        (*BY_NAME, "--arch", ARCH, "--gpu-product", "NVIDIA H100 80GB HBM3"),
        ExitCode.STAMP_MISMATCH,
        ("gpu_product", "NVIDIA H200", "NVIDIA H100 80GB HBM3", "tuning file"),
    ),
    "tuning and the node's product unknown (strict)": Case(
        None,
        (*BY_NAME, "--arch", ARCH),
        ExitCode.STAMP_MISMATCH,
        ("gpu_product", "unknown"),
    ),
    "engine image changed": Case(
        None,
        (*BY_KEY, "--expect-image", "registry.example/vllm:0.9.1@sha256:" + "cd" * 32),
        ExitCode.STAMP_MISMATCH,
        ("extra/engine_image", "--expect-image"),
    ),
    "expected image no runtime would pull": Case(
        None,
        (*BY_KEY, "--expect-image", "registry.example/VLLM:0.9.0"),
        ExitCode.STAMP_MISMATCH,
        ("extra/engine_image", "--expect-image", "must be lowercase"),
    ),
    "package version changed": Case(
        None,
        (*BY_KEY, "--expect-factor", "dist/blake3=0.0.1 record=" + "0" * 64),
        ExitCode.STAMP_MISMATCH,
        ("dist/blake3", "--expect-factor"),
    ),
    "package RECORD digest changed, same version": Case(
        None,
        (
            *BY_KEY,
            "--expect-factor",
            f"dist/blake3={measure.distribution_factor('blake3').split()[0]} record={'f' * 64}",
        ),
        ExitCode.STAMP_MISMATCH,
        ("dist/blake3", "record=ffffffffffff"),
    ),
    "environment differs from the stamp (--check-env)": Case(
        None,
        (*BY_KEY, "--check-env"),
        ExitCode.STAMP_MISMATCH,
        ("python_abi", "cpython-39-other-abi"),
        stamp_changes={"python_abi": "cpython-39-other-abi"},
    ),
    "corrupted file": Case(
        flip_byte, BY_KEY, ExitCode.INTEGRITY, ("gemm_128x256.o", "digest mismatch")
    ),
    "truncated file": Case(truncate_file, BY_KEY, ExitCode.INTEGRITY, ("matmul.cubin", "size")),
    "missing file": Case(remove_file, BY_KEY, ExitCode.INTEGRITY, ("gemm_128x256.json", "missing")),
    "extra unlisted file": Case(
        add_file, BY_KEY, ExitCode.INTEGRITY, ("planted.o", "not in manifest")
    ),
    "truncated manifest": Case(
        truncate_manifest, BY_KEY, ExitCode.MALFORMED_MANIFEST, (MANIFEST_NAME, "invalid JSON")
    ),
    "path escape in manifest": Case(
        escape_in_manifest, BY_KEY, ExitCode.UNSAFE_PATH, ("../../../escape.o",)
    ),
    "symlink out of the generation": Case(
        symlink_out, BY_KEY, ExitCode.UNSAFE_PATH, ("gemm_128x256.json", "symlink")
    ),
    "bad signature": Case(
        None,
        (*BY_KEY, "--public-key", "OTHER_KEY"),
        ExitCode.SIGNATURE,
        ("MANIFEST.json.sig",),
        signed=True,
    ),
    "unsigned generation, signature required": Case(
        None,
        (*BY_KEY, "--require-signature", "--public-key", "OUR_KEY"),
        ExitCode.SIGNATURE,
        ("MANIFEST.json.sig", "missing"),
    ),
    "signature required, no key given": Case(
        None,
        (*BY_KEY, "--require-signature"),
        ExitCode.SIGNATURE,
        ("--public-key",),
        signed=True,
    ),
    "key file missing": Case(
        None,
        (*BY_KEY, "--public-key", "MISSING_KEY"),
        ExitCode.SIGNATURE,
        ("absent.pub",),
        signed=True,
    ),
    "another arch's generation copied into this key": Case(
        other_arch_copied_in, BY_KEY, ExitCode.INTEGRITY, (f"{NS}/{NAME}/sm_120a", KEY)
    ),
    "another arch's generation copied into this key (--check-env)": Case(
        other_arch_copied_in,
        (*BY_KEY, "--check-env"),
        ExitCode.INTEGRITY,
        (f"{NS}/{NAME}/sm_120a", KEY),
    ),
    "another KernelCache's signed generation replayed into this key": Case(
        other_model_replayed,
        (*BY_KEY, "--public-key", "OUR_KEY", "--require-signature"),
        ExitCode.INTEGRITY,
        (f"{NS}/other-model/{ARCH}", KEY),
        signed=True,
    ),
    "generation under another directory name": Case(
        renamed_generation, BY_KEY, ExitCode.INTEGRITY, ("0" * 32, "not")
    ),
    "stamp without an arch (an older manifest)": Case(
        stamp_without_arch, BY_KEY, ExitCode.STAMP_MISMATCH, ("no arch", "rebuild")
    ),
    "generation dir a symlink to another key's generation": Case(
        generation_symlinked_to_other_key,
        BY_KEY,
        ExitCode.UNSAFE_PATH,
        ("is a symlink", f"{NS}/copy/{ARCH}"),
    ),
    "generation dir a symlink out of the store": Case(
        generation_symlinked_outside, BY_KEY, ExitCode.UNSAFE_PATH, ("outside-generation",)
    ),
    "CURRENT a symlink": Case(
        current_symlinked_outside, BY_KEY, ExitCode.UNSAFE_PATH, ("CURRENT: is a symlink",)
    ),
    "CURRENT a FIFO": Case(
        current_a_fifo, BY_KEY, ExitCode.UNSAFE_PATH, ("CURRENT: not a regular file",)
    ),
    "arch dir a symlink": Case(
        key_segment_symlinked(1), BY_KEY, ExitCode.UNSAFE_PATH, (f"{ARCH}: is a symlink",)
    ),
    "namespace dir a symlink": Case(
        key_segment_symlinked(3), BY_KEY, ExitCode.UNSAFE_PATH, (f"{NS}: is a symlink",)
    ),
    "artifact hard-linked outside the generation": Case(
        hard_linked_outside, BY_KEY, ExitCode.UNSAFE_PATH, ("gemm_128x256.o", "2 hard links")
    ),
    "artifact of mode 000 (verify as root)": Case(
        artifact_mode_000, BY_KEY, ExitCode.IO, ("matmul.cubin", "mode 0000")
    ),
    "directory of mode 000 (verify as root)": Case(
        directory_mode_000, BY_KEY, ExitCode.IO, ("k3x", "mode 0000")
    ),
    "unreadable PVC: store is a file": Case(
        None, (*BY_KEY, "--store", "STORE_FILE"), ExitCode.IO, ("pvc-file", "store not readable")
    ),
    "unreadable PVC: key dir replaced by a FIFO": Case(
        key_dir_not_a_dir, BY_KEY, ExitCode.IO, (f"{NS}/{NAME}/{ARCH}",)
    ),
    "node without GPU labels, no override, no nvidia-smi": Case(
        None,
        (*BY_NAME, "--node-name", "cpu-node"),
        ExitCode.NO_GPU_INFO,
        ("cpu-node has no nvidia.com/gpu.compute.major", "--arch", "nvidia-smi"),
        labels={"kubernetes.io/os": "linux"},
    ),
    "node not in the node map, no override, no nvidia-smi": Case(
        None,
        (*BY_NAME, "--node-name", "ghost"),
        ExitCode.NO_GPU_INFO,
        ("node ghost: not in the node map", "kernelcache-nodes", "nvidia-smi"),
    ),
    "no node name, no override, no nvidia-smi": Case(
        None, BY_NAME, ExitCode.NO_GPU_INFO, ("--node-name", "nvidia-smi is not on PATH")
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_refused(case: Case, pod: Pod, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    keys = tmp_path / "keys"
    private, public = generate_keypair(keys)
    stamp = make_stamp(**case.stamp_changes)
    gen = publish(pod.store, stamp=stamp, signing_key=private if case.signed else None)
    if case.mutate is not None:
        case.mutate(gen, tmp_path)
    if "--node-name" in case.args:
        nodes = request.getfixturevalue("node_map")
        if case.labels is not None:
            nodes[case.args[case.args.index("--node-name") + 1]] = case.labels
        pod.node_map = nodes.dir
    store_file = tmp_path / "pvc-file"
    store_file.write_text("not a directory\n")
    other_public = generate_keypair(tmp_path / "other-keys")[1]
    placeholders = {
        "OTHER_KEY": str(other_public),
        "OUR_KEY": str(public),
        "MISSING_KEY": str(keys / "absent.pub"),
        "STORE_FILE": str(store_file),
    }
    args = [placeholders.get(a, a) for a in case.args]
    store = None
    if "--store" in args:  # the last --store wins in argparse; keep one for clarity
        at = args.index("--store")
        store = Path(args[at + 1])
        del args[at : at + 2]
    pod.assert_refused(pod.verify(*args, store=store), case.code, *case.names)


def test_the_matrix_covers_every_verify_failure_class() -> None:
    assert len(CASES) >= 15
    assert {c.code for c in CASES.values()} == {
        ExitCode.MISSING_GENERATION,
        ExitCode.STAMP_MISMATCH,
        ExitCode.INTEGRITY,
        ExitCode.SIGNATURE,
        ExitCode.MALFORMED_MANIFEST,
        ExitCode.UNSAFE_PATH,
        ExitCode.NO_GPU_INFO,
        ExitCode.IO,
    }


def test_target_that_cannot_be_written_is_an_io_failure(pod: Pod) -> None:
    publish(pod.store)
    pod.target.rmdir()
    pod.target.write_text("a file where the emptyDir should be\n")
    proc = pod.verify(*BY_KEY)
    assert proc.returncode == ExitCode.IO, proc.stderr
    assert str(pod.target) in pod.termination_log.read_text()


# --------------------------------------------------------------------------- success


def test_labels_from_the_node_map_pick_and_materialize_the_generation(
    pod: Pod, node_map: NodeMap
) -> None:
    gen = publish(pod.store)
    node_map["gpu-h200"] = {**H200_LABELS, "nvidia.com/gpu.product": "NVIDIA-H200-SHARED"}
    pod.node_map = node_map.dir
    proc = pod.verify(*BY_NAME, "--node-name", "gpu-h200", "--expect-image", IMAGE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    env = read_env(pod)
    copy = pod.target / gen.name
    assert env["KERNELCACHE_DIR"] == str(copy)
    assert env["KERNELCACHE_ARCH"] == ARCH
    assert env["KERNELCACHE_NAME"] == f"{NS}/{NAME}"
    # Only what verify found: strictness is the serving container's own setting, so that a
    # file gone missing cannot make a strict pod permissive.
    assert sorted(env) == ["KERNELCACHE_ARCH", "KERNELCACHE_DIR", "KERNELCACHE_NAME"]
    assert (copy / ".complete").is_file()
    for rel, data in {**COMPILED, **TUNING}.items():
        assert (copy / "files" / rel).read_bytes() == data
    report = json.loads((pod.target / contract.REPORT_FILE).read_text())
    assert report["generation"] == gen.name
    assert report["gpu_product"] == "NVIDIA-H200"
    assert report["tuning_dropped"] == 0
    assert report["arch_source"] == "node gpu-h200 labels"
    assert not pod.termination_log.exists()


def test_a_pod_on_the_previous_image_loads_the_kept_generation_built_for_it(pod: Pod) -> None:
    """An engine-image change: the new image's generation has published (or a kept one was
    made current again), and a pod still on the previous image is admitted during the
    rollout. It loads the generation built for its image, which the store keeps; an image no
    kept generation was built for is refused, naming the factor and what was looked at."""
    old = publish(pod.store)
    new_image = "registry.example/vllm:0.9.1@sha256:" + "cd" * 32
    stamp = make_stamp(**{stamp_policy.ENGINE_IMAGE_FACTOR: new_image})
    new = publish(pod.store, files={"cute-dsl/new.o": b"\x7fELF new"}, stamp=stamp)
    assert old != new

    for image, expected in ((IMAGE, old), (new_image, new)):
        proc = pod.verify(*BY_KEY, "--expect-image", image)
        assert proc.returncode == 0, proc.stderr
        assert read_env(pod)["KERNELCACHE_DIR"] == str(pod.target / expected.name)
        assert json.loads((pod.target / contract.REPORT_FILE).read_text())["generation"] == (
            expected.name
        )

    other = "registry.example/vllm:0.9.2"
    shutil.rmtree(pod.target)  # a new pod's emptyDir
    pod.target.mkdir()
    proc = pod.verify(*BY_KEY, "--expect-image", other)
    pod.assert_refused(
        proc,
        ExitCode.STAMP_MISMATCH,
        "extra/engine_image",
        other,
        f"CURRENT is {new.name}, the one generation kept besides it was not built for it either",
    )


def test_permissive_drops_the_tuning_of_another_product_and_starts(pod: Pod) -> None:
    gen = publish(pod.store)
    proc = pod.verify(
        *BY_NAME, "--arch", ARCH, "--gpu-product", "NVIDIA H100 80GB HBM3", "--policy", "permissive"
    )
    assert proc.returncode == 0, proc.stderr
    (warning,) = proc.stderr.strip().splitlines()
    assert warning.startswith("kernelcache: warning: gpu_product: NVIDIA H200 != NVIDIA H100")
    assert "dropped 2 tuning files" in warning
    env = read_env(pod)
    assert json.loads((pod.target / contract.REPORT_FILE).read_text())["policy"] == "permissive"
    copy = Path(env["KERNELCACHE_DIR"])
    assert copy == pod.target / f"{gen.name}-untuned" and (copy / ".complete").is_file()
    for rel, data in COMPILED.items():
        assert (copy / "files" / rel).read_bytes() == data
    for rel in TUNING:
        assert not (copy / "files" / rel).exists()
    report = json.loads((pod.target / contract.REPORT_FILE).read_text())
    assert report["tuning_dropped"] == 2 and sorted(report["dropped_files"]) == sorted(TUNING)
    assert [p.name for p in pod.target.iterdir() if p.name.startswith(".")] == []


def test_nvidia_smi_names_the_arch_and_product_when_nothing_else_does(pod: Pod) -> None:
    publish(pod.store)
    pod.fake_nvidia_smi("NVIDIA H200, 9.0")
    proc = pod.verify(*BY_NAME)
    assert proc.returncode == 0, proc.stderr
    env = read_env(pod)
    report = json.loads((pod.target / contract.REPORT_FILE).read_text())
    assert env["KERNELCACHE_ARCH"] == ARCH and report["gpu_product"] == PRODUCT


def test_signed_generation_with_the_right_key_verifies(pod: Pod, tmp_path: Path) -> None:
    private, public = generate_keypair(tmp_path / "keys")
    publish(pod.store, signing_key=private)
    proc = pod.verify(*BY_KEY, "--require-signature", "--public-key", str(public))
    assert proc.returncode == 0, proc.stderr
    assert "verified: 5 files" in proc.stdout


def test_compile_only_generation_needs_no_gpu_product(pod: Pod) -> None:
    """A CPU cross-compile (no tuning, no gpu_product factor) serves any product of the arch."""
    stamp = stamps.collect(arch=ARCH, distributions=["blake3"], extra={"engine_image": IMAGE})
    publish(pod.store, files=COMPILED, stamp=stamp.to_dict())
    proc = pod.verify(*BY_NAME, "--arch", ARCH, "--expect-image", "registry.example/vllm:0.9.0")
    assert proc.returncode == 0, proc.stderr


def test_a_failed_rerun_takes_back_the_earlier_env_file(pod: Pod) -> None:
    gen = publish(pod.store)
    assert pod.verify(*BY_KEY).returncode == 0
    assert (pod.target / contract.ENV_FILE).is_file()
    flip_byte(gen, pod.tmp)
    proc = pod.verify(*BY_KEY)
    assert proc.returncode == ExitCode.INTEGRITY
    assert not (pod.target / contract.ENV_FILE).exists()
    assert not (pod.target / contract.REPORT_FILE).exists()


# --------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        (H200_LABELS, ("sm_90a", "NVIDIA-H200")),
        (
            {
                "nvidia.com/gpu.product": "NVIDIA-B200",
                "nvidia.com/gpu.compute.major": "10",
                "nvidia.com/gpu.compute.minor": "0",
            },
            ("sm_100a", "NVIDIA-B200"),
        ),
        (
            {
                "nvidia.com/gpu.product": "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
                "nvidia.com/gpu.compute.major": "12",
                "nvidia.com/gpu.compute.minor": "0",
            },
            ("sm_120a", "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"),
        ),
        (
            {
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                "nvidia.com/gpu.compute.major": "8",
                "nvidia.com/gpu.compute.minor": "0",
            },
            ("sm_80", "NVIDIA-A100-SXM4-80GB"),
        ),
        (
            {"nvidia.com/gpu.compute.major": "8", "nvidia.com/gpu.compute.minor": "9"},
            ("sm_89", None),
        ),
        (
            {**H200_LABELS, "nvidia.com/gpu.product": "NVIDIA-H200-SHARED"},
            ("sm_90a", "NVIDIA-H200"),
        ),
        ({"nvidia.com/gpu.product": "NVIDIA-H200"}, (None, "NVIDIA-H200")),
        ({"kubernetes.io/os": "linux"}, (None, None)),
        ({}, (None, None)),
    ],
)
def test_arch_from_labels(labels: dict[str, str], expected: tuple) -> None:
    assert node.arch_from_labels(labels) == expected


@pytest.mark.parametrize(
    "cc", [("9", ""), ("", "0"), ("nine", "0"), ("9", "10"), ("-9", "0")], ids=str
)
def test_arch_from_labels_refuses_a_malformed_compute_capability(cc: tuple[str, str]) -> None:
    labels = {"nvidia.com/gpu.compute.major": cc[0], "nvidia.com/gpu.compute.minor": cc[1]}
    with pytest.raises(NoGpuInfoError, match=r"nvidia\.com/gpu\.compute\.major"):
        node.arch_from_labels(labels)


def no_gpus() -> list[tuple[str, str]]:
    raise NoGpuInfoError("nvidia-smi is not on PATH")


def test_discovery_order_override_then_labels_then_nvidia_smi(monkeypatch) -> None:
    monkeypatch.setattr(measure, "visible_gpus", lambda: [("NVIDIA H100 80GB HBM3", "sm_90a")])
    read: list[str] = []

    def labels(node: str) -> dict[str, str]:
        read.append(node)
        return {**H200_LABELS, "nvidia.com/gpu.compute.major": "10"}

    both = node.discover_node(
        arch="sm_120a", gpu_product="X", node_name="n", env={}, label_reader=labels
    )
    assert (both.arch, both.arch_source, both.product) == ("sm_120a", "--arch", "X")
    assert read == []  # nothing left to ask the API for

    from_env = node.discover_node(
        env={"KERNELCACHE_ARCH": "sm_90a", "KERNELCACHE_NODE_NAME": "n"}, label_reader=labels
    )
    assert (from_env.arch, from_env.arch_source) == ("sm_90a", "KERNELCACHE_ARCH")
    assert (from_env.product, from_env.product_source) == ("NVIDIA-H200", "node n labels")

    from_labels = node.discover_node(node_name="n", env={}, label_reader=labels)
    assert (from_labels.arch, from_labels.arch_source) == ("sm_100a", "node n labels")

    from_smi = node.discover_node(env={}, label_reader=labels)
    assert (from_smi.arch, from_smi.product, from_smi.arch_source) == (
        "sm_90a",
        "NVIDIA H100 80GB HBM3",
        "nvidia-smi",
    )
    # A product seen by nvidia-smi on GPUs of another arch is not this arch's product.
    other = node.discover_node(arch="sm_100a", env={}, label_reader=labels)
    assert (other.arch, other.product) == ("sm_100a", None)


def test_discovery_says_what_it_tried(monkeypatch) -> None:
    monkeypatch.setattr(measure, "visible_gpus", no_gpus)

    def unreachable(node: str) -> dict[str, str]:
        raise NoGpuInfoError(f"node {node}: labels not read: API answered 403 Forbidden")

    info = node.discover_node(node_name="n1", env={}, label_reader=unreachable)
    assert info.arch is None and info.product is None
    assert info.tried == (
        "no --arch or KERNELCACHE_ARCH",
        "node n1: labels not read: API answered 403 Forbidden",
        "nvidia-smi is not on PATH",
    )
    with pytest.raises(NoGpuInfoError, match="not an arch like sm_90a"):
        node.discover_node(arch="hopper", env={})


def manifest_with(paths: list[str], report: dict | None = None) -> Manifest:
    return Manifest(
        format="kernelcache.dev/manifest/v1",
        key=KEY,
        generation="0" * 32,
        created="2026-01-01T00:00:00Z",
        stamp={"digest": "blake3:" + "0" * 64},
        files=tuple(FileEntry(p, 1, "blake3:" + "0" * 64) for p in paths),
        report=report or {},
    )


def test_tune_scoped_files_by_name_and_by_report() -> None:
    manifest = manifest_with(
        [
            "cute-dsl/gemm.o",
            "triton/abc/matmul.autotune.json",
            "triton/abc/matmul.cubin",
            "inductor/xy/triton_poi_fused.best_config",
            "flashinfer/tactics/nvidia-h200.json",
            "flashinfer/aot/mod/mod.so",
            "vllm/tuned/moe.json",
        ],
        {"warmers": [{"warmer": "x", "tactics": {"file": "vllm/tuned/moe.json"}}, "junk"]},
    )
    assert sorted(stamp_policy.tune_scoped_files(manifest)) == [
        "flashinfer/tactics/nvidia-h200.json",
        "inductor/xy/triton_poi_fused.best_config",
        "triton/abc/matmul.autotune.json",
        "vllm/tuned/moe.json",
    ]


def test_parse_expect_factor() -> None:
    assert stamp_policy.parse_expect_factor("dist/torch=2.11.0 record=ab=") == (
        "dist/torch",
        "2.11.0 record=ab=",
    )
    for bad in ("dist/torch", "=2.11.0"):
        with pytest.raises(SpecError):
            stamp_policy.parse_expect_factor(bad)


def test_the_node_map_reader_names_what_is_missing(node_map: NodeMap, tmp_path: Path) -> None:
    """The map is absent (no ConfigMap yet: the optional volume is an empty directory), the
    node is not in it, or its entry is not JSON: each one line naming what to do."""
    from kernelcache import nodemap

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NoGpuInfoError, match="ConfigMap kernelcache-nodes is missing"):
        nodemap.reader(empty)("gpu-1")
    with pytest.raises(NoGpuInfoError, match="node gpu-1: not in the node map"):
        nodemap.reader(node_map.dir)("gpu-1")
    (node_map.dir / "..data" / "gpu-2").write_text("not json")
    (node_map.dir / "gpu-2").symlink_to("..data/gpu-2")
    with pytest.raises(NoGpuInfoError, match="not a JSON object of node labels"):
        nodemap.reader(node_map.dir)("gpu-2")
    node_map["gpu-3"] = H200_LABELS
    assert nodemap.reader(node_map.dir)("gpu-3") == H200_LABELS
