"""Corruption of real artifacts of every class the warmers produce, caught by verify.

Two generations of one key are built once for the module by ``kernelcache warm`` with the
real warmers on the CPU, for an sm_120a GPU class (188 SMs): CuTe-DSL kernels
(examples/demo_kernels.py: ``files/cute-dsl/*.o`` and their key ``*.json``), torch.compile of
a tiny MLP (examples/torch_models.py: the Mega-Cache blob, its index and inductor's cache
tree), FlashInfer's b12x MoE kernels (FlashInfer's ``.o`` files, ``meta.json``, build lock and
log under ``files/flashinfer``; the direct-micro kernel goes through the CuTe-DSL disk layer
into ``files/cute-dsl``) and Triton's binary cache. Triton compiles only with a GPU, so its
files are stand-ins: a command warmer writes random binaries in Triton's cache layout
(``<hash>/<kernel>.cubin``, ``.ttir``, ``.ttgir``, ``.llir``, ``.ptx``, ``.json`` and
``__grp__<kernel>.json``) into ``TRITON_CACHE_DIR``. The generations are signed, so
MANIFEST.json is checked here as signed generations check it; an unsigned manifest's own
checksum is tested in tests/test_store.py (1,000 single-bit flips).

Every file of a class, or a seeded sample of ``SAMPLE`` files of a larger one, gets one bit
flipped, is truncated, extended by a byte and deleted; a file is added in every directory of
``files/``; a file of each class is swapped in from the older generation (where the two
generations' files of the class differ). Every fault is checked by verify in-process and,
for one file of each class and each kind of fault, by ``kernelcache verify --materialize``
as the init-container runs it: exit 5 (integrity; for MANIFEST.json, 6 or 7: its signature
or its parse), one stderr line naming the file, nothing materialized. After each fault the
file is put back and the generation verifies again.
Hostile layouts: a file of every class hard-linked to a file outside, of mode 000 (root's
verify reads it, a serving user would not), a symlink to a copy outside or a FIFO; and on a
copy of the store, the key's names that are not kernelcache's own (a symlinked generation,
CURRENT or key directory, CURRENT a FIFO) and the signed generation placed under another
key or another name. Each refused in one line, nothing materialized.
``KERNELCACHE_CORRUPTION_SEED`` replaces the seed; every failure message names it.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import shutil
import stat
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelcache.errors import ExitCode
from kernelcache.spec import PUBLIC_KEY_FILE, SIGNING_KEY_FILE
from kernelcache.store import (
    FILES_DIR,
    MANIFEST_NAME,
    SIGNATURE_NAME,
    Store,
    VerifyResult,
    verify,
)
from kernelcache.toolchains import cache_env

from .conftest import kernelcache_doc, needs_cute, one_line_error, run_kernelcache

pytestmark = [
    pytest.mark.slow,
    needs_cute,
    *(
        pytest.mark.skipif(importlib.util.find_spec(m) is None, reason=f"{m} is not installed")
        for m in ("torch", "flashinfer")
    ),
]

SEED = int(os.environ.get("KERNELCACHE_CORRUPTION_SEED", "20261130"))
ARCH = "sm_120a"
KEY = f"ci/corrupt/{ARCH}"
SAMPLE = 5  # files per class at most

# The Triton stand-ins: what Triton writes for a compiled kernel, with random contents.
TRITON_STAND_INS = """\
import base64, hashlib, json, os, random
from pathlib import Path

workload = json.loads(os.environ["KERNELCACHE_WORKLOAD"])
rng = random.Random(workload["seed"])
IRS = ("ttir", "ttgir", "llir", "ptx")
for name in workload["kernels"]:
    key = hashlib.sha256(f"{name}/{workload['seed']}".encode()).digest()
    entry = Path(os.environ["TRITON_CACHE_DIR"]) / base64.b32encode(key).decode().rstrip("=")
    entry.mkdir(parents=True)
    files = {f"{name}.{ir}": rng.randbytes(900).hex().encode() for ir in IRS}
    files[f"{name}.cubin"] = b"\\x7fELF" + rng.randbytes(rng.randrange(2000, 6000))
    files[f"{name}.json"] = json.dumps({"name": name, "hash": key.hex(), "num_warps": 4}).encode()
    for file_name, data in files.items():
        (entry / file_name).write_bytes(data)
    group = {"child_paths": {file_name: str(entry / file_name) for file_name in files}}
    (entry / f"__grp__{name}.json").write_text(json.dumps(group))
"""


def warmers(generation: int) -> list[dict[str, Any]]:
    """Every warmer, with workloads that differ between the two generations."""
    first = generation == 1
    return [
        {
            "type": "cute-dsl",
            "entryPoints": ["demo_kernels:warm"],
            "workload": {"sizes": [[128, 128 if first else 256]], "tiles": [[32, 32]]},
        },
        {
            "type": "torch-compile",
            "entryPoints": ["torch_models:warm"],
            "workload": {
                "batch_sizes": [8],
                "features": 32,
                "hidden": 64 if first else 48,
                "dtype": "float32",
                "device": "cpu",
            },
        },
        {
            "type": "b12x",
            "workload": {
                "experts": 8,
                "topK": 2,
                "hiddenSize": 256,
                "intermediateSize": 256,
                "maxNumTokens": 64,
                # The direct-micro kernel, and a static one (a different one in each generation).
                "batchSizes": [1, 16 if first else 64],
                "compileWorkers": 2,
            },
        },
        {
            "type": "command",
            "command": [sys.executable, "triton_stand_ins.py"],
            "workload": {"seed": generation, "kernels": ["add_kernel", "matmul_kernel"]},
        },
    ]


def write_spec(directory: Path, generation: int) -> Path:
    doc = kernelcache_doc(
        "corrupt",
        "ci",
        gpuClasses=[{"name": "rtx-pro-6000", "arch": ARCH, "smCount": 188}],
        warmers=warmers(generation),
    )
    spec = directory / f"kc-{generation}.yaml"
    spec.write_text(yaml.safe_dump(doc))
    return spec


@dataclass(frozen=True)
class Generations:
    store: Path
    old: Path
    new: Path  # the current one
    public_key: Path


@pytest.fixture(scope="module")
def generations(tmp_path_factory: pytest.TempPathFactory) -> Generations:
    """Two signed generations of one key (retention keeps both), the newer one current."""
    root = tmp_path_factory.mktemp("corruption")
    (root / "triton_stand_ins.py").write_text(TRITON_STAND_INS)
    keygen = run_kernelcache("keygen", str(root / "keys"))
    assert keygen.returncode == 0, keygen.stderr
    store = Store(root / "store")
    ids = []
    for generation in (1, 2):
        proc = run_kernelcache(
            "warm", "-f", str(write_spec(root, generation)), "--store", str(store.root),
            "--arch", ARCH, "--signing-key", str(root / "keys" / SIGNING_KEY_FILE),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        current = store.current(KEY)
        assert current is not None
        ids.append(current.name)
    assert [m.generation for m in store.generations(KEY)] == ids  # both kept, oldest first
    return Generations(
        store=store.root,
        old=store.key_dir(KEY) / ids[0],
        new=store.key_dir(KEY) / ids[1],
        public_key=root / "keys" / PUBLIC_KEY_FILE,
    )


# --------------------------------------------------------------------------- artifact classes

Alternatives = list[tuple[ExitCode, str]]  # (exit code, regex the message must match whole)


def content_problem(path: Path, faulted: bytes | None, size: int) -> Alternatives:
    """What verify reports for a file of files/ that holds faulted (None: deleted)."""
    if faulted is None:
        what = "missing"
    elif len(faulted) != size:
        what = f"size {len(faulted)} != manifest {size}"
    else:
        what = "digest mismatch"
    return [(ExitCode.INTEGRITY, re.escape(f"{path}: {what}"))]


def manifest_problem(path: Path, faulted: bytes | None, size: int) -> Alternatives:
    """A signed manifest that changed no longer parses (7) or no longer matches its signature
    (6), depending on where the fault landed; with its signature checked first, what it now
    says about the files is counted after ("and N more")."""
    if faulted is None:
        return [(ExitCode.MALFORMED_MANIFEST, re.escape(f"{path}: missing"))]
    signature = path.parent / SIGNATURE_NAME
    return [
        (ExitCode.MALFORMED_MANIFEST, re.escape(f"{path}: ") + ".+"),
        (
            ExitCode.SIGNATURE,
            re.escape(f"{signature}: does not match {MANIFEST_NAME}")
            + r"( \(and \d+ more(: .*)?\))?",
        ),
    ]


@dataclass(frozen=True)
class ArtifactClass:
    name: str
    pattern: str  # matches the whole path under files/ (the manifest: under the generation)
    expect: Callable[[Path, bytes | None, int], Alternatives] = content_problem
    signed: bool = False  # checked with the public key and a signature required


MANIFEST = ArtifactClass("MANIFEST.json (signed)", re.escape(MANIFEST_NAME), manifest_problem, True)
# First match wins: Triton's group index is a .json too.
CLASSES = (
    ArtifactClass("CuTe-DSL object", r"cute-dsl/[0-9a-f]{32}\.o"),
    ArtifactClass("CuTe-DSL key", r"cute-dsl/[0-9a-f]{32}\.json"),
    ArtifactClass("CuTe-DSL traced IR", r"cute-dsl/[0-9a-f]{32}\.mlir"),
    ArtifactClass("CuTe-DSL compile record", r"cute-dsl/observed/[0-9a-f]{32}\.json"),
    ArtifactClass("torch Mega-Cache blob", r"torch-compile/megacache\.bin"),
    ArtifactClass("torch Mega-Cache index", r"torch-compile/megacache\.json"),
    ArtifactClass("inductor FX graph entry", r"inductor/fxgraph/[^/]+/\w+/\w+"),
    ArtifactClass("AOTAutograd entry", r"inductor/aotautograd/\w+/\w+"),
    ArtifactClass("inductor lock (empty)", r"inductor/locks/\w+\.lock"),
    ArtifactClass("inductor C++ source", r"inductor/\w+/\w+(\.main)?\.cpp"),
    ArtifactClass("inductor shared object", r"inductor/\w+/\w+(\.main)?\.so"),
    ArtifactClass("inductor Python module", r"inductor/\w+/\w+\.py"),
    ArtifactClass("FlashInfer CuTe-DSL object", r"flashinfer/.+/cached_ops/\w+/\w+\.o"),
    ArtifactClass("FlashInfer meta.json", r"flashinfer/.+/cached_ops/\w+/meta\.json"),
    ArtifactClass("FlashInfer build lock (empty)", r"flashinfer/.+/cached_ops/tmp/\w+\.lock"),
    ArtifactClass("FlashInfer JIT log", r"flashinfer/.+/flashinfer_jit\.log"),
    ArtifactClass("Triton cubin (stand-in)", r"triton/[A-Z2-7]{52}/\w+\.cubin"),
    ArtifactClass("Triton IR (stand-in)", r"triton/[A-Z2-7]{52}/\w+\.(ttir|ttgir|llir|ptx)"),
    ArtifactClass("Triton group index (stand-in)", r"triton/[A-Z2-7]{52}/__grp__\w+\.json"),
    ArtifactClass("Triton metadata (stand-in)", r"triton/[A-Z2-7]{52}/\w+\.json"),
    MANIFEST,
)


def classify(gen_dir: Path) -> dict[ArtifactClass, list[Path]]:
    """Every file the generation's manifest lists, and the manifest, by class; every file
    must fall in one, so a warmer that starts writing a new kind of file is noticed."""
    manifest = verify(gen_dir).manifest
    assert manifest is not None
    by_class: dict[ArtifactClass, list[Path]] = {MANIFEST: [gen_dir / MANIFEST_NAME]}
    unclassified = []
    for entry in manifest.files:
        cls = next((c for c in CLASSES if re.fullmatch(c.pattern, entry.path)), None)
        if cls is None or cls is MANIFEST:
            unclassified.append(entry.path)
        else:
            by_class.setdefault(cls, []).append(gen_dir / FILES_DIR / entry.path)
    assert not unclassified, f"{gen_dir.name}: files of no class: {unclassified}"
    return by_class


# --------------------------------------------------------------------------- faults

Fault = Callable[[bytes, random.Random], bytes | None]  # the file's new bytes; None: deleted


def flip(data: bytes, rng: random.Random) -> bytes:
    flipped = bytearray(data)
    flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(flipped)


def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))]


def extend(data: bytes, rng: random.Random) -> bytes:
    return data + bytes([rng.randrange(256)])


def delete(data: bytes, rng: random.Random) -> None:
    return None


FAULTS: dict[str, Fault] = {"flip": flip, "truncate": truncate, "extend": extend, "delete": delete}
NEED_CONTENT = {"flip", "truncate"}  # not possible on an empty file


@contextmanager
def holding(path: Path, faulted: bytes | None) -> Iterator[None]:
    """path holds faulted (None: is absent) inside the block; put back after, even on failure."""
    original = path.read_bytes() if path.exists() else None
    mode = stat.S_IMODE(path.stat().st_mode) if original is not None else 0
    if faulted is None:
        path.unlink()
    else:
        path.write_bytes(faulted)
    try:
        yield
    finally:
        if original is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(original)
            path.chmod(mode)


def matches(code: int, message: str, expected: Alternatives) -> bool:
    return any(code == c and re.fullmatch(pattern, message) for c, pattern in expected)


@dataclass
class Checker:
    """Injects faults into the current generation, checks that verify (in-process, and the
    CLI with --materialize) reports each as expected, and counts them by label and kind."""

    gens: Generations
    target: Path  # where the CLI materializes
    injected: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    through_cli: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    def verify(self, signed: bool) -> VerifyResult:
        key = self.gens.public_key if signed else None
        return verify(self.gens.new, public_key=key, require_signature=signed)

    def verify_cli(self, signed: bool) -> subprocess.CompletedProcess:
        """``kernelcache verify`` as the init-container runs it."""
        args = ["--public-key", str(self.gens.public_key), "--require-signature"] if signed else []
        return run_kernelcache(
            "verify", "--store", str(self.gens.store), "--key", KEY, "--arch", ARCH,
            "--materialize", str(self.target), *args,
        )  # fmt: skip

    def inject(
        self,
        label: str,
        kind: str,
        path: Path,
        faulted: bytes | None,
        expected: Alternatives,
        *,
        signed: bool = False,
        cli: bool,
    ) -> None:
        """Put faulted in place of path (None: delete it), check it is reported, restore."""
        what = f"(seed {SEED}) {label}: {kind} of {path}"
        with holding(path, faulted):
            result = self.verify(signed)
            assert result.problems, f"{what}: not detected"
            if not signed:  # a signed manifest's fault can show in more places than one
                assert len(result.problems) == 1, f"{what}: {result.problems}"
            first = result.problems[0]
            assert matches(first.code, first.message, expected), f"{what}: {first}"
            if cli:
                self.target.mkdir(exist_ok=True)
                proc = self.verify_cli(signed)
                assert proc.returncode != 0, f"{what}: the CLI passed: {proc.stdout}"
                line = one_line_error(proc)
                message = line.removeprefix("kernelcache: error: ")
                assert matches(proc.returncode, message, expected), f"{what}: {line}"
                leftover = list(self.target.iterdir())
                assert not leftover, f"{what}: materialized {leftover}"
                self.through_cli[label].add(kind)
        restored = self.verify(signed=True)
        assert restored.ok, f"{what}: after restoring: {restored.problems}"
        self.injected[label][kind] += 1

    def corrupt(
        self, cls: ArtifactClass, kind: str, path: Path, faulted: bytes | None, cli: bool
    ) -> None:
        """A fault in a file of a class, expected to be reported as the class reports it."""
        expected = cls.expect(path, faulted, path.stat().st_size)
        self.inject(cls.name, kind, path, faulted, expected, signed=cls.signed, cli=cli)

    def total(self) -> int:
        return sum(sum(kinds.values()) for kinds in self.injected.values())

    def passes(self) -> None:
        """The restored generation passes the CLI's verify, signature required, and
        materializes."""
        shutil.rmtree(self.target, ignore_errors=True)
        proc = self.verify_cli(signed=True)
        assert proc.returncode == 0, proc.stderr
        assert (self.target / self.gens.new.name / FILES_DIR).is_dir()


def record_totals(record_property: Callable[[str, object], None], line: str, **counts: int) -> None:
    """Print the totals (``pytest -s``) and keep them as properties (``--junitxml``)."""
    for name, value in counts.items():
        record_property(name, value)
    print(f"\n{line} (seed {SEED})")


# --------------------------------------------------------------------------- the tests


def test_the_generations_hold_every_artifact_class(generations: Generations) -> None:
    """Both generations' files all fall into the declared classes, and every class has
    files in each: what the other tests corrupt is what the warmers really produce."""
    for gen_dir in (generations.old, generations.new):
        by_class = classify(gen_dir)
        missing = [c.name for c in CLASSES if c not in by_class]
        assert not missing, f"{gen_dir.name}: no file of {missing}"
        assert len(by_class[CLASSES[0]]) == 3  # two demo kernels, b12x's direct-micro kernel


def test_every_fault_in_every_artifact_class_is_detected_naming_the_file(
    generations: Generations, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Flip, truncate, extend, delete: each detected by verify, and by the CLI for the first
    sampled file of each class."""
    checker = Checker(generations, tmp_path / "target")
    by_class = classify(generations.new)
    sampled, expected_kinds = 0, {}
    for cls, paths in by_class.items():
        rng = random.Random(f"{SEED}/{cls.name}")
        sample = sorted(rng.sample(paths, min(SAMPLE, len(paths))))
        sampled += len(sample)
        empty = all(p.stat().st_size == 0 for p in sample)
        expected_kinds[cls.name] = set(FAULTS) - (NEED_CONTENT if empty else set())
        for index, path in enumerate(sample):
            data = path.read_bytes()
            for kind, fault in FAULTS.items():
                if data or kind not in NEED_CONTENT:
                    checker.corrupt(cls, kind, path, fault(data, rng), cli=index == 0)
    checker.passes()

    assert set(checker.injected) == {c.name for c in CLASSES}, f"(seed {SEED})"
    for name, kinds in expected_kinds.items():
        assert set(checker.injected[name]) == kinds, f"(seed {SEED}) {name}"
        assert checker.through_cli[name] == kinds, f"(seed {SEED}) {name}"
    # Only the two kinds of lock are empty: every other class had a bit flipped and was cut.
    assert sum(kinds == set(FAULTS) for kinds in expected_kinds.values()) == len(CLASSES) - 2
    cli = sum(map(len, checker.through_cli.values()))
    listed = sum(map(len, by_class.values()))
    record_totals(
        record_property,
        f"corruption: {len(CLASSES)} classes, {sampled} of {listed} files, {checker.total()} "
        f"faults injected and detected, {cli} of them also by `kernelcache verify --materialize`",
        classes=len(CLASSES),
        files=sampled,
        faults=checker.total(),
        through_cli=cli,
    )


def test_a_file_added_in_any_directory_of_the_generation_is_detected(
    generations: Generations, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """A stray file, named like its neighbours, in every directory of files/ (the empty cache
    directories of toolchains this spec does not use included); through the CLI in files/
    and in each toolchain's directory."""
    checker = Checker(generations, tmp_path / "target")
    rng = random.Random(f"{SEED}/added")
    files_root = generations.new / FILES_DIR
    toolchains = sorted(p for p in files_root.iterdir() if p.is_dir())
    directories = [files_root, *sorted(p for p in files_root.rglob("*") if p.is_dir())]
    for directory in directories:
        neighbour = next((p for p in sorted(directory.iterdir()) if p.is_file()), None)
        path = directory / f"{rng.getrandbits(64):016x}{neighbour.suffix if neighbour else ''}"
        expected = [(ExitCode.INTEGRITY, re.escape(f"{path}: not in manifest"))]
        data = rng.randbytes(rng.randrange(1, 4096))
        cli = directory == files_root or directory in toolchains
        checker.inject("added file", "add", path, data, expected, cli=cli)
    checker.passes()

    assert {p.name for p in toolchains} == {*cache_env().values(), "torch-compile"}
    assert checker.injected["added file"]["add"] == len(directories)
    record_totals(
        record_property,
        f"added files: {len(directories)} directories, {len(toolchains) + 1} of them also by "
        "the CLI",
        added=len(directories),
        added_through_cli=len(toolchains) + 1,
    )


def test_a_file_swapped_in_from_the_older_generation_is_detected(
    generations: Generations, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """The older generation's file of the same class (at the same path where that one
    differs) copied over one of the current generation's, for every class whose files differ
    between the two; all through the CLI too."""
    checker = Checker(generations, tmp_path / "target")
    old = classify(generations.old)
    identical = []
    for cls, paths in classify(generations.new).items():
        rng = random.Random(f"{SEED}/swap/{cls.name}")
        older = {source: source.read_bytes() for source in old[cls]}
        pairs = [
            (target, source)
            for target in paths
            for source, data in older.items()
            if data != target.read_bytes()
        ]
        if not pairs:
            identical.append(cls.name)
            continue
        same_path = [
            (target, source)
            for target, source in pairs
            if target.relative_to(generations.new) == source.relative_to(generations.old)
        ]
        target, source = rng.choice(same_path or pairs)
        checker.corrupt(cls, "swap", target, older[source], cli=True)
    checker.passes()

    # The same bytes in both: FlashInfer's meta.json describes the DSL stack, not the
    # kernels, and the locks are empty.
    assert sorted(identical) == [
        "FlashInfer build lock (empty)",
        "FlashInfer meta.json",
        "inductor lock (empty)",
    ], f"(seed {SEED})"
    assert len(checker.injected) == len(CLASSES) - len(identical)
    record_totals(
        record_property,
        f"swaps: {len(checker.injected)} classes swapped in and detected, "
        f"{len(identical)} identical in both generations",
        swapped=len(checker.injected),
    )


# --------------------------------------------------------------------------- hostile layouts

# A file of the generation that is not the plain, private, readable file verify must see.
Layout = Callable[[Path, Path], str]  # (path, scratch dir) -> the problem verify reports


def hard_linked(path: Path, scratch: Path) -> str:
    os.link(path, scratch / f"link-{path.name}")
    return f"{path}: has 2 hard links: it can change through a name outside the generation"


def mode_000(path: Path, scratch: Path) -> str:
    path.chmod(0)
    if os.geteuid() != 0:  # not root: it cannot be read at all
        return f"{path}: EACCES (Permission denied)"
    return f"{path}: mode 0000: no user but root can read this file"


def symlinked_out(path: Path, scratch: Path) -> str:
    outside = scratch / f"copy-{path.name}"
    shutil.copy2(path, outside)
    path.unlink()
    path.symlink_to(outside)
    return f"{path}: is a symlink (to {str(outside)!r})"


def fifo(path: Path, scratch: Path) -> str:
    path.unlink()
    os.mkfifo(path)
    return f"{path}: not a regular file"


LAYOUTS: dict[str, tuple[Layout, ExitCode, ExitCode]] = {
    # name: (layout, code for a file under files/, code for MANIFEST.json)
    "hard link to a file outside": (hard_linked, ExitCode.UNSAFE_PATH, ExitCode.UNSAFE_PATH),
    "mode 000": (mode_000, ExitCode.IO, ExitCode.IO),
    "symlink out of the generation": (symlinked_out, ExitCode.UNSAFE_PATH, ExitCode.UNSAFE_PATH),
    "FIFO": (fifo, ExitCode.INTEGRITY, ExitCode.UNSAFE_PATH),
}


@contextmanager
def laid_out(path: Path, layout: Layout, scratch: Path) -> Iterator[str]:
    """path in the layout inside the block; the original file, mode included, after."""
    data, mode = path.read_bytes(), stat.S_IMODE(path.stat().st_mode)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        yield layout(path, scratch)
    finally:
        path.unlink()
        path.write_bytes(data)
        path.chmod(mode)
        shutil.rmtree(scratch)


def test_a_file_of_any_class_in_a_hostile_layout_is_refused(
    generations: Generations, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """One file of every class hard-linked to a file outside the generation, made mode 000
    (root's verify still reads it; a serving user would not), replaced by a symlink to a
    copy outside, or by a FIFO: each refused in one problem naming the file; through the
    CLI for the first class of each layout."""
    checker = Checker(generations, tmp_path / "target")
    by_class = classify(generations.new)
    refused: Counter[str] = Counter()
    cli_done: set[str] = set()
    for name, (layout, files_code, manifest_code) in LAYOUTS.items():
        for cls, paths in by_class.items():
            path = random.Random(f"{SEED}/layout/{cls.name}").choice(paths)
            code = manifest_code if cls is MANIFEST else files_code
            what = f"(seed {SEED}) {cls.name}: {name} at {path}"
            with laid_out(path, layout, tmp_path / "scratch") as message:
                result = checker.verify(signed=False)
                assert [(p.code, p.message) for p in result.problems] == [(code, message)], what
                if name not in cli_done:
                    shutil.rmtree(checker.target, ignore_errors=True)  # the last passes() copy
                    checker.target.mkdir()
                    proc = checker.verify_cli(signed=True)
                    line = one_line_error(proc)
                    assert (proc.returncode, line) == (code, f"kernelcache: error: {message}")
                    assert not list(checker.target.iterdir()), what
                    cli_done.add(name)
            refused[name] += 1
        checker.passes()

    assert refused == {name: len(CLASSES) for name in LAYOUTS}, f"(seed {SEED})"
    record_totals(
        record_property,
        f"hostile file layouts: {len(LAYOUTS)} layouts x {len(CLASSES)} classes, "
        f"{sum(refused.values())} refused, {len(cli_done)} also by the CLI",
        file_layouts=sum(refused.values()),
    )


# Hostile layouts of the key: (name, change to a copy of the store, the key verify is asked
# for, the exit code, what the line must name). Each is applied to a fresh copy of the store.
KeyLayout = Callable[[Path, Generations], None]


def _key_dir(store: Path, key: str = KEY) -> Path:
    return store / key


def generation_symlinked_to_the_older(store: Path, gens: Generations) -> None:
    gen = _key_dir(store) / gens.new.name
    shutil.rmtree(gen)
    gen.symlink_to(_key_dir(store) / gens.old.name)


def generation_symlinked_out_of_the_store(store: Path, gens: Generations) -> None:
    gen = _key_dir(store) / gens.new.name
    gen.rename(store.parent / "outside-generation")
    gen.symlink_to(store.parent / "outside-generation")


def current_symlinked(store: Path, gens: Generations) -> None:
    (store.parent / "outside-CURRENT").write_text(gens.new.name + "\n")
    (_key_dir(store) / "CURRENT").unlink()
    (_key_dir(store) / "CURRENT").symlink_to(store.parent / "outside-CURRENT")


def current_a_fifo(store: Path, gens: Generations) -> None:
    (_key_dir(store) / "CURRENT").unlink()
    os.mkfifo(_key_dir(store) / "CURRENT")


def arch_dir_symlinked(store: Path, gens: Generations) -> None:
    _key_dir(store).rename(store.parent / "outside-arch")
    _key_dir(store).symlink_to(store.parent / "outside-arch")


def name_dir_symlinked(store: Path, gens: Generations) -> None:
    _key_dir(store).parent.rename(store.parent / "outside-name")
    _key_dir(store).parent.symlink_to(store.parent / "outside-name")


def copied_into(key: str) -> KeyLayout:
    """The current generation, signature and all, copied into another key and made current."""

    def layout(store: Path, gens: Generations) -> None:
        other = _key_dir(store, key)
        other.mkdir(parents=True)
        shutil.copytree(gens.new, other / gens.new.name)
        (other / "CURRENT").write_text(gens.new.name + "\n")

    return layout


def generation_renamed(store: Path, gens: Generations) -> None:
    renamed = _key_dir(store) / ("0" * 32)
    (_key_dir(store) / gens.new.name).rename(renamed)
    (_key_dir(store) / "CURRENT").write_text(renamed.name + "\n")


KEY_LAYOUTS: dict[str, tuple[KeyLayout, str, ExitCode, tuple[str, ...]]] = {
    "generation dir a symlink to the older generation": (
        generation_symlinked_to_the_older,
        KEY,
        ExitCode.UNSAFE_PATH,
        ("is a symlink",),
    ),
    "generation dir a symlink out of the store": (
        generation_symlinked_out_of_the_store,
        KEY,
        ExitCode.UNSAFE_PATH,
        ("outside-generation",),
    ),
    "CURRENT a symlink": (current_symlinked, KEY, ExitCode.UNSAFE_PATH, ("CURRENT: is a symlink",)),
    "CURRENT a FIFO": (current_a_fifo, KEY, ExitCode.UNSAFE_PATH, ("CURRENT: not a regular file",)),
    "arch dir a symlink": (
        arch_dir_symlinked,
        KEY,
        ExitCode.UNSAFE_PATH,
        (f"{ARCH}: is a symlink",),
    ),
    "name dir a symlink": (
        name_dir_symlinked,
        KEY,
        ExitCode.UNSAFE_PATH,
        ("corrupt: is a symlink",),
    ),
    "an sm_120a generation copied into the sm_90a key": (
        copied_into("ci/corrupt/sm_90a"),
        "ci/corrupt/sm_90a",
        ExitCode.INTEGRITY,
        (KEY, "ci/corrupt/sm_90a"),
    ),
    "a signed generation replayed into another KernelCache's key": (
        copied_into(f"ci/other-model/{ARCH}"),
        f"ci/other-model/{ARCH}",
        ExitCode.INTEGRITY,
        (KEY, f"ci/other-model/{ARCH}"),
    ),
    "the generation under another directory name": (
        generation_renamed,
        KEY,
        ExitCode.INTEGRITY,
        ("0" * 32,),
    ),
}


@pytest.mark.parametrize("name", KEY_LAYOUTS)
def test_a_key_in_a_hostile_layout_is_refused(
    generations: Generations, tmp_path: Path, name: str
) -> None:
    """Through the CLI as the init-container runs it, signature required, on a copy of the
    store: exit code of the class, one line naming what is wrong, nothing materialized."""
    layout, key, code, names = KEY_LAYOUTS[name]
    store = tmp_path / "store"
    shutil.copytree(generations.store, store, symlinks=True)
    layout(store, generations)
    target = tmp_path / "target"
    target.mkdir()
    arch = key.rsplit("/", 1)[-1]
    proc = run_kernelcache(
        "verify", "--store", str(store), "--key", key, "--arch", arch,
        "--public-key", str(generations.public_key), "--require-signature",
        "--materialize", str(target),
    )  # fmt: skip
    line = one_line_error(proc)
    assert proc.returncode == code, line
    for part in names:
        assert part in line, (part, line)
    assert not list(target.iterdir()), f"{name}: materialized"
