"""The docs against the program: every error line they quote is what it prints for that
case, and every command they show that can run here runs.

Error lines: each code span in a table column headed ``typical line`` (in any doc) and each
code span starting ``kernelcache: error:`` is one. ``REPRODUCTIONS`` maps each, verbatim, to
the case that makes the program print it; a quoted line without a reproduction fails, and so
does a reproduction whose line no doc quotes. ``…`` and ``<…>`` in a doc line stand for any
text; the store's path reads as the docs write it, ``/var/lib/kernelcache``.

Commands: each line of a fenced block that starts (after ``$ ``) with ``kernelcache``,
``helm`` or ``kubectl`` is run here, in a copy of the examples with the example store built,
or named in ``NOT_HERE`` with the reason it cannot (a cluster, a GPU, a registry).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from kernelcache.crd import crd_manifest
from kernelcache.errors import ExitCode, error_line
from kernelcache.store import Store, manifest_checksum
from tests.conftest import (
    EXAMPLES,
    REPO,
    kernelcache_doc,
    publish_files,
    run_kernelcache,
    scaled,
    warm_on_a_full_volume,
)
from tests.helpers import generations

DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
STORE_AS_DOCUMENTED = "/var/lib/kernelcache"
KEY = "team-a/llama/sm_90a"
H200 = ["--arch", "sm_90a", "--gpu-product", generations.PRODUCT]


# --- what the docs quote -----------------------------------------------------------------------


def _cells(row: str) -> list[str]:
    """A markdown table row's cells (a ``\\|`` inside a cell is not a separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def quoted_error_lines() -> dict[str, str]:
    """Every error line the docs quote -> the doc it is in."""
    found: dict[str, str] = {}
    for doc in DOCS:
        column = None
        for line in doc.read_text().splitlines():
            if not line.startswith("|"):
                column = None
            elif column is None:
                headers = _cells(line)
                column = headers.index("typical line") if "typical line" in headers else -1
            elif column >= 0 and not set(line) <= set("|-: "):
                for span in re.findall(r"`([^`]+)`", _cells(line)[column]):
                    found[span] = doc.name
            for span in re.findall(r"`(kernelcache: error: [^`]+)`", line):
                found[span] = doc.name
    return found


def matches(doc_line: str, printed: str) -> bool:
    parts = re.split(r"(…|<[^<>]+>)", doc_line)
    pattern = "".join(".*?" if p == "…" or p.startswith("<") else re.escape(p) for p in parts)
    return re.search(pattern, printed) is not None


# --- the cases that print them ------------------------------------------------------------------


def last_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def published(tmp: Path, **kw) -> tuple[Path, Path]:
    """A store holding KEY's generation (compiled and tuning files, stamped for an H200)."""
    store = tmp / "store"
    return store, generations.publish(store, KEY, **kw)


def verify(store: Path, *args: str, key: str = KEY, code: int) -> str:
    proc = run_kernelcache("verify", "--store", str(store), "--key", key, *args)
    return last_line(proc, code).replace(str(store), STORE_AS_DOCUMENTED)


def edit_manifest(gen: Path, change: Callable[[dict], None], *, reseal: bool = True) -> None:
    path = gen / "MANIFEST.json"
    body = json.loads(path.read_text())
    change(body)
    if reseal:
        body.pop("checksum")
        body["checksum"] = manifest_checksum(body)
    path.write_text(json.dumps(body))


def no_generation(tmp: Path) -> str:
    store, _ = published(tmp)
    return verify(store, "--arch", "sm_120a", key="team-a/llama/sm_120a", code=3)


def stamp_mismatch(tmp: Path) -> str:
    store, _ = published(tmp, stamp=generations.make_stamp(**{"dist/blake3": "0.0.1 record=ab"}))
    return verify(store, *H200, "--check-env", code=4)


def image_not_published(tmp: Path) -> str:
    """A pod on image B, while the store holds only generations built for another image."""
    store, _ = published(tmp)
    return verify(store, *H200, "--expect-image", "registry.example/vllm:0.10.0", code=4)


def volume_full(tmp: Path) -> str:
    command = ["sh", "-c", "dd if=/dev/zero of=$TRITON_CACHE_DIR/k.bin bs=1k count=4096"]
    code, _, stderr = warm_on_a_full_volume(tmp, command)
    assert code == ExitCode.IO, stderr
    return stderr.strip().splitlines()[-1]


def other_gpu_product(tmp: Path) -> str:
    store, _ = published(tmp)
    return verify(store, "--arch", "sm_90a", "--gpu-product", "NVIDIA H100 80GB HBM3", code=4)


def digest_mismatch(tmp: Path) -> str:
    store, gen = published(tmp)
    target = gen / "files" / "cute-dsl" / "gemm_128x256.o"
    target.write_bytes(b"\x00" + target.read_bytes()[1:])
    return verify(store, *H200, code=5)


def another_keys_generation(tmp: Path) -> str:
    store, _ = published(tmp)
    generations.publish(store, "team-a/llama/sm_120a")
    other = Store(store).current("team-a/llama/sm_120a")
    assert other is not None
    shutil.rmtree(Store(store).key_dir(KEY))
    shutil.copytree(other.parent, Store(store).key_dir(KEY), symlinks=True)
    return verify(store, *H200, code=5)


def no_arch_in_stamp(tmp: Path) -> str:
    stamp = generations.make_stamp()
    stamp = {**stamp, "factors": {k: v for k, v in stamp["factors"].items() if k != "arch"}}
    store, _ = published(tmp, stamp=stamp)
    return verify(store, *H200, code=4)


def bad_signature(tmp: Path) -> str:
    from kernelcache.store import generate_keypair

    signer, _ = generate_keypair(tmp / "signer")
    _, other = generate_keypair(tmp / "other")
    store, _ = published(tmp, signing_key=signer)
    return verify(store, *H200, "--public-key", str(other), code=6)


def wrong_field_type(tmp: Path) -> str:
    store, gen = published(tmp)
    edit_manifest(gen, lambda body: body["files"][3].update(size="12"))
    return verify(store, *H200, code=7)


def checksum_mismatch(tmp: Path) -> str:
    store, gen = published(tmp)
    edit_manifest(gen, lambda body: body.update(created="2020-01-01T00:00:00Z"), reseal=False)
    return verify(store, *H200, code=7)


def dotdot_path(tmp: Path) -> str:
    store, gen = published(tmp)
    edit_manifest(gen, lambda body: body["files"][0].update(path="../x"))
    return verify(store, *H200, code=8)


def generation_symlink(tmp: Path) -> str:
    store, gen = published(tmp)
    moved = gen.parent / "elsewhere"
    gen.rename(moved)
    gen.symlink_to(moved)
    return verify(store, *H200, code=8)


def target_holds_a_symlink(tmp: Path) -> str:
    store, gen = published(tmp)
    target = tmp / "pod"
    target.mkdir()
    (target / gen.name).symlink_to(tmp / "elsewhere")
    return verify(store, *H200, "--materialize", str(target), code=8)


def target_in_a_store(tmp: Path) -> str:
    store, gen = published(tmp)
    return verify(store, *H200, "--materialize", str(gen.parent / "copy"), code=8)


def current_symlink(tmp: Path) -> str:
    store, gen = published(tmp)
    current = gen.parent / "CURRENT"
    (gen.parent / "CURRENT.real").write_text(current.read_text())
    current.unlink()
    current.symlink_to("CURRENT.real")
    return verify(store, *H200, code=8)


def hard_link(tmp: Path) -> str:
    store, gen = published(tmp)
    os.link(gen / "files" / "cute-dsl" / "gemm_128x256.o", tmp / "x.o")
    return verify(store, *H200, code=8)


def no_arch_known(tmp: Path) -> str:
    store, _ = published(tmp)
    proc = run_kernelcache(
        "verify", "--store", str(store), "--namespace", "team-a", "--name", "llama",
        PATH="/nonexistent", KERNELCACHE_ARCH="", KERNELCACHE_NODE_NAME="",
    )  # fmt: skip
    return last_line(proc, 9)


def no_store(tmp: Path) -> str:
    proc = run_kernelcache("verify", "--store", STORE_AS_DOCUMENTED + "-nothing-here", "--key", KEY)
    return last_line(proc, 10).replace(STORE_AS_DOCUMENTED + "-nothing-here", STORE_AS_DOCUMENTED)


def store_is_a_file(tmp: Path) -> str:
    (tmp / "store").write_text("")
    return verify(tmp / "store", code=10)


def mode_0000(tmp: Path) -> str:
    store, gen = published(tmp)
    (gen / "files" / "cute-dsl" / "gemm_128x256.o").chmod(0)
    return verify(store, *H200, code=10)


def current_not_a_generation_id(tmp: Path) -> str:
    store, gen = published(tmp)
    (gen.parent / "CURRENT").write_text("../../other\n")
    return verify(store, *H200, code=5)


def locked(tmp: Path) -> str:
    store, _ = published(tmp)
    with Store(store).writer(KEY):
        proc = run_kernelcache("gc", "--store", str(store), "--timeout", "0.1")
    return last_line(proc, 12)


def spec_refused(tmp: Path, doc: dict) -> str:
    spec = tmp / "kc.yaml"
    spec.write_text(yaml.safe_dump(doc))
    proc = run_kernelcache("build", "-f", str(spec), "--store", str(tmp / "s"))
    return last_line(proc, 2)


def misspelled_field(tmp: Path) -> str:
    doc = kernelcache_doc("kc")
    doc["spec"]["modle"] = doc["spec"].pop("model")
    return spec_refused(tmp, doc)


def unknown_arch(tmp: Path) -> str:
    return spec_refused(tmp, kernelcache_doc("kc", arches=("sm_91",)))


def long_name(tmp: Path) -> str:
    return spec_refused(tmp, kernelcache_doc("a" * 64))


def cache_variable_in_env(tmp: Path) -> str:
    warmer = {"type": "command", "command": ["true"], "env": {"TRITON_CACHE_DIR": "/x"}}
    return spec_refused(tmp, kernelcache_doc("kc", warmers=[warmer]))


def nested_spec(tmp: Path) -> str:
    warmer = {"type": "command", "command": ["true"], "workload": {"x": "DEEP"}}
    spec = tmp / "kc.yaml"
    spec.write_text(yaml.safe_dump(kernelcache_doc("kc", warmers=[warmer])).replace(
        "DEEP", "[" * 100 + "]" * 100
    ))  # fmt: skip
    proc = run_kernelcache("build", "-f", str(spec), "--store", str(tmp / "s"))
    return last_line(proc, 2)


def warm(tmp: Path, warmer: dict, code: int = 11) -> str:
    spec = tmp / "kc.yaml"
    spec.write_text(yaml.safe_dump(kernelcache_doc("kc", warmers=[warmer])))
    (tmp / "my_kernels.py").write_text("def warm(workload):\n    raise ValueError('no')\n")
    proc = run_kernelcache("warm", "-f", str(spec), "--store", str(tmp / "s"), "--arch", "sm_90a")
    return last_line(proc, code)


def entry_point_failed(tmp: Path) -> str:
    return warm(tmp, {"type": "cute-dsl", "entryPoints": ["my_kernels:warm"]})


def ran_past_timeout(tmp: Path) -> str:
    sleep = [shutil.which("sleep") or "sleep", "600"]
    return warm(tmp, {"type": "command", "command": sleep, "timeoutSeconds": 1})


def build_failed(tmp: Path) -> str:
    spec = tmp / "kc.yaml"
    warmer = {"type": "command", "command": ["false"]}
    spec.write_text(yaml.safe_dump(kernelcache_doc("kc", warmers=[warmer])))
    proc = run_kernelcache("build", "-f", str(spec), "--store", str(tmp / "s"))
    return last_line(proc, 11)


def cold_compile(tmp: Path) -> str:
    from kernelcache.runtime.cute import CuteDiskCache, Traced

    cache = CuteDiskCache(tmp / "cute-dsl", strict=True)
    return cache._refusal(Traced("my_kernels:gemm", {"ir": "0" * 64}, "", tvm_ffi=False))


def stale_cute_kernel(tmp: Path) -> str:
    """A kernel recorded with one tile size; the same function traced with another, after
    the tile file its compile read was edited."""
    from kernelcache.runtime import observe
    from kernelcache.runtime.cute import CuteDiskCache, Traced

    root = tmp / "cute-dsl"
    (root / "observed").mkdir(parents=True)
    tiles = tmp / "tiles.json"
    tiles.write_text("128")
    ir = "module {{\n  gpu.module @kernels {{\n    cuda.kernel @gemm()\n    block = <i64: {}, 1, 1>"
    recorded = Traced("my_kernels:gemm", {"ir": "1" * 64}, ir.format(128), False)
    files = {str(tiles): observe.file_digest(str(tiles))}
    record = {"format": observe.FORMAT, "python": sys.version, "dists": {}, "env": {}}
    record.update(modules={}, files=files, pth={})
    address, data = observe.digest(record)
    (root / "observed" / f"{address}.json").write_bytes(data)
    (root / f"{recorded.key}.mlir").write_text(recorded.ir)
    meta = {"factors": recorded.factors, "function": recorded.name, "observed": address}
    (root / f"{recorded.key}.json").write_text(json.dumps(meta))
    tiles.write_text("64")
    here = Traced("my_kernels:gemm", {"ir": "2" * 64}, ir.format(64), False)
    return CuteDiskCache(root, strict=True)._refusal(here)


def cannot_write_the_store(tmp: Path) -> str:
    """The compile Job's user (uid 1000) on a store root owned by root, mode 0755: a forked
    child of this process drops to that user and opens a writer, as ``warm`` does."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to become another user")
    root = Path(tempfile.mkdtemp(prefix="kernelcache-docs-"))  # not below a root-only dir
    try:
        root.chmod(0o755)
        store = root / "store"
        store.mkdir(mode=0o755)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report the line, never return into pytest
            try:
                os.setgid(1000)
                os.setuid(1000)
                with Store(store).writer(KEY):
                    pass
            except BaseException as exc:
                os.write(write, error_line(exc).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            line = pipe.read()
        os.waitpid(pid, 0)
        return line.replace(str(store), STORE_AS_DOCUMENTED)
    finally:
        shutil.rmtree(root)


def flashinfer_module_missing(tmp: Path) -> str:
    """A generation whose warm recorded two FlashInfer modules, one of them left out."""
    store = tmp / "store"
    files = {"flashinfer/aot/sampling/sampling.so": b"\x7fELF"}
    report = {
        "warmers": [{"warmer": "vllm m", "flashinfer_modules": ["batch_prefill_x", "sampling"]}]
    }
    publish_files(Store(store), KEY, files, generations.make_stamp(), report)
    return verify(store, *H200, "--materialize", str(tmp / "pod"), code=10)


def vllm_outside_the_range(tmp: Path) -> str:
    """``kernelcache build`` of a vllm warmer with vLLM 0.35.0 installed (the stand-in engine
    under that release's metadata)."""
    from tests.helpers.vllm import fake_env, vllm_doc

    info = tmp / "site" / "vllm-0.35.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.35.0\n")
    (tmp / "kc.yaml").write_text(yaml.safe_dump(vllm_doc(tmp / "vllm-root")))
    env = fake_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp / "site"), env["PYTHONPATH"]])
    proc = run_kernelcache(
        "build", "-f", str(tmp / "kc.yaml"), "--store", str(tmp / "store"), **env
    )
    return last_line(proc, ExitCode.NOT_INSTALLED)


REPRODUCTIONS: dict[str, Callable[[Path], str]] = {
    "team-a/llama/sm_120a: no published generation in /var/lib/kernelcache (arches built: sm_90a)": no_generation,  # noqa: E501
    "stamp mismatch: dist/<distribution>: <version> record=… (generation …) != <version> record=… (this environment)": stamp_mismatch,  # noqa: E501
    "stamp mismatch: extra/engine_image: <A> != <B> (--expect-image); CURRENT is …, … (a new image's generation is published when its compile Job ends: a pod with restartPolicy Always or OnFailure retries this init-container until then; one with Never must be created again)": image_not_published,  # noqa: E501
    "gpu_product: NVIDIA H200 != NVIDIA H100 …": other_gpu_product,
    "command warmer: sh exited with 1 for sm_90a: no space left on device (its output: dd: error writing '…': No space left on device)": volume_full,  # noqa: E501
    "…/files/cute-dsl/….o: digest mismatch": digest_mismatch,
    "…/MANIFEST.json: published for key team-a/llama/sm_120a, not for team-a/llama/sm_90a": another_keys_generation,  # noqa: E501
    "team-a/llama/sm_90a: generation … has no arch in its stamp (written by an older kernelcache): rebuild it (kernelcache build --force)": no_arch_in_stamp,  # noqa: E501
    "…/CURRENT: not a generation id: '../../other'": current_not_a_generation_id,
    "…/MANIFEST.json.sig: does not match MANIFEST.json": bad_signature,
    "…/MANIFEST.json: field files.3.size: …": wrong_field_type,
    "…/MANIFEST.json: checksum mismatch: the manifest changed after it was written": checksum_mismatch,  # noqa: E501
    "…/MANIFEST.json: files: '..' segment: '../x'": dotdot_path,
    "…/sm_90a/<generation>: is a symlink (to '…'); a generation must be a directory of its key": generation_symlink,  # noqa: E501
    "…/CURRENT: is a symlink": current_symlink,
    "…/<generation>: is a symlink (to '…'); a materialize target holds only what kernelcache wrote": target_holds_a_symlink,  # noqa: E501
    "…: lies in a store (…); materialize outside it": target_in_a_store,
    "…/files/….o: has 2 hard links: it can change through a name outside the generation": hard_link,
    "cannot determine this node's GPU arch: no --arch or KERNELCACHE_ARCH; no node name (…); nvidia-smi is not on PATH": no_arch_known,  # noqa: E501
    "/var/lib/kernelcache: store does not exist": no_store,
    "…: store not readable: Not a directory": store_is_a_file,
    "…/files/….o: mode 0000: no user but root can read this file": mode_0000,
    "/var/lib/kernelcache/<namespace>: EACCES (Permission denied): /var/lib/kernelcache is owned by uid 0 gid 0 mode 0755, and this process is uid 1000 gid 1000; …": cannot_write_the_store,  # noqa: E501
    "team-a/llama/sm_90a: another writer holds …/.lock (pid … on …); gave up after <seconds>s": locked,  # noqa: E501
    "spec.modle: unknown field (did you mean model?)": misspelled_field,
    "'sm_91' is not an arch any toolchain knows (known: …)": unknown_arch,
    "metadata.name: String should have at most 63 characters, …": long_name,
    "spec.warmers[0].env.TRITON_CACHE_DIR: kernelcache points it at the generation's files/triton; remove it from env": cache_variable_in_env,  # noqa: E501
    "…: nested deeper than 64 levels": nested_spec,
    "cute-dsl entry point my_kernels:warm failed for sm_90a: …": entry_point_failed,
    "spec.warmers[0] (command <program>) ran past timeoutSeconds=<seconds> for sm_90a": ran_past_timeout,  # noqa: E501
    "kernelcache: error: sm_90a: <reason>": build_failed,
    "kernelcache: error: <what>": no_store,
    "kernelcache: error: sm_90a: vllm warmer: vLLM 0.35.0 is outside the range the vllm toolchain supports (>=0.26.0,<0.35; proven on a GPU: 0.26.0): install a vLLM in the range, or set vllmVersionCheck: warn in the vllm warmer's workload to try this one": vllm_outside_the_range,  # noqa: E501
    "kernelcache: error: …: FlashInfer module batch_prefill_… that the warm loaded is not in the generation (flashinfer/aot/…/….so): FlashInfer with JIT disabled would fail the first request needing it; rebuild the generation": flashinfer_module_missing,  # noqa: E501
    "cute-dsl: my_kernels:gemm in …: no kernel compiled from this IR (ir …); strict mode refuses a cold compile; no kernel of my_kernels:gemm is recorded there": cold_compile,  # noqa: E501
    "cute-dsl: my_kernels:gemm in …: no kernel compiled from this IR (ir …); strict mode refuses a cold compile; nearest recorded kernel …: IR line 4 was 'block = <i64: 128, 1, 1>', here 'block = <i64: 64, 1, 1>'; since its compile: file …/tiles.json (…) differs from the one the kernel was compiled with": stale_cute_kernel,  # noqa: E501
}  # fmt: skip


def test_every_quoted_error_line_has_a_reproduction():
    quoted = quoted_error_lines()
    assert set(quoted) - set(REPRODUCTIONS) == set(), "quoted in the docs, never reproduced"
    assert set(REPRODUCTIONS) - set(quoted) == set(), "reproduced, but no doc quotes it"


@pytest.mark.parametrize("doc_line", sorted(REPRODUCTIONS))
def test_a_quoted_error_line_is_what_the_program_prints(tmp_path, doc_line):
    printed = REPRODUCTIONS[doc_line](tmp_path)
    assert matches(doc_line, printed), (
        f"the docs say\n  {doc_line}\nthe program prints\n  {printed}"
    )


# --- the commands the docs show -----------------------------------------------------------------

PROGRAMS = ("kernelcache", "helm", "kubectl")
HELM = REPO / ".tools" / "bin" / "helm"

# Commands that need what is not here, by their first words: a cluster, a release, a pod.
NOT_HERE = {
    "kubectl": "needs a cluster (the cluster tests apply the same objects to the harness)",
    "helm rollback": "needs an installed release",
    "helm history": "needs an installed release",
    "kernelcache push": "needs a registry (tests/test_oci.py runs it against a real one)",
    "kernelcache pull": "needs a registry (tests/test_oci.py runs it against a real one)",
    # concepts.md's explain examples: both arches built by make demo, and a failing import
    "kernelcache explain default/demo/sm_90a default/demo/sm_120a": "needs make demo's sm_120a",
    "kernelcache explain default/demo/sm_90a env": "needs the kernels' module not to import",
}
# helm commands that change a cluster are run as ``helm template`` with the same chart and
# values (what they would apply); these flags only mean something to an installed release.
RELEASE_FLAGS = {"--create-namespace", "--reuse-values", "--install", "--wait", "--atomic"}
# Commands the docs show failing on purpose: their exit code, as the docs say.
EXPECTED_EXIT = {
    "TRITON_CACHE_DIR=spec.yaml/triton kernelcache doctor store/default/demo/sm_90a/8f05e5cc484aa24068b8334602c145fb --arch sm_120a": 4,  # noqa: E501
    "kernelcache explain env /var/lib/kernelcache/team-a/llama/sm_90a/<generation>": 4,
    "kernelcache explain <generation-a> <generation-b>": 4,
    "kernelcache explain team-a/llama/sm_90a env --store /var/lib/kernelcache": 4,
    "kernelcache explain 3f2a9c1e 7b0d44aa --store /var/lib/kernelcache": 4,
}  # fmt: skip


def fenced_blocks(doc: Path) -> list[tuple[str, list[str]]]:
    """(info string, lines) of each fenced block."""
    blocks, info, lines = [], None, []
    indent = 0
    for line in doc.read_text().splitlines():
        if line.strip().startswith("```"):  # a block in a list item is indented
            if info is None:
                info, lines = line.strip()[3:].strip(), []
                indent = len(line) - len(line.lstrip())
            else:
                blocks.append((info, lines))
                info = None
        elif info is not None:
            lines.append(line[indent:])
    return blocks


def shown_commands() -> dict[str, str]:
    """Every command of a fenced block -> its doc. A block with ``$ `` prompts shows commands
    only on those lines; a ``text`` block is output; a line ending in ``\\`` goes on."""
    found: dict[str, str] = {}
    for doc in DOCS:
        for info, lines in fenced_blocks(doc):
            if info.split(" ")[0] == "text" or info.startswith("yaml"):
                continue
            prompted = any(line.startswith("$ ") for line in lines)
            joined: list[str] = []
            for line in lines:
                if joined and joined[-1].endswith("\\"):
                    joined[-1] = joined[-1][:-1] + line.strip()
                else:
                    joined.append(line)
            for line in joined:
                if prompted and not line.startswith("$ "):
                    continue
                words = line.removeprefix("$ ").split()
                while words and "=" in words[0] and not words[0].startswith("-"):
                    words = words[1:]  # VAR=value before the program
                if words and words[0] in PROGRAMS:
                    found[" ".join(shlex.split(line.removeprefix("$ "), comments=True))] = doc.name
    return found


def files_shown() -> dict[str, str]:
    """The files the docs show whole (a block opened with ``yaml title=NAME``)."""
    return {
        info.split("title=", 1)[1].strip('"'): "\n".join(lines) + "\n"
        for doc in DOCS
        for info, lines in fenced_blocks(doc)
        if "title=" in info
    }


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> dict[str, str]:
    """Where the docs' commands run: the examples, the chart, the files the docs show, and a
    store with the example's sm_90a generation and two generations of team-a/llama/sm_90a.
    Returns the words that stand for what only exists once built (generation ids)."""
    root = tmp_path_factory.mktemp("docs")
    shutil.copytree(EXAMPLES, root / "examples")
    (root / "charts").symlink_to(REPO / "charts")
    for name, text in files_shown().items():
        (root / name).write_text(text)
    # cli.md's doctor example points a cache variable below this file
    shutil.copy(EXAMPLES / "kernelcache.yaml", root / "spec.yaml")
    proc = run_kernelcache("build", "-f", "examples/kernelcache.yaml", "--store", "store",
                           "--arch", "sm_90a", cwd=root)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    store = root / "store"
    first = generations.publish(store, KEY)
    second = generations.publish(store, KEY, stamp=generations.make_stamp(model="other/model"))
    demo = Store(store).current("default/demo/sm_90a")
    assert demo is not None
    return {
        "root": str(root),
        STORE_AS_DOCUMENTED: str(store),
        "8f05e5cc484aa24068b8334602c145fb": demo.name,
        "<generation-a>": str(first),
        "<generation-b>": str(second),
        "<generation>": second.name,
        "3f2a9c1e": first.name[:8],
        "7b0d44aa": second.name[:8],
    }


def test_every_command_shown_runs_here_or_says_why_not():
    for command in shown_commands():
        program = next(w for w in command.split(" ") if "=" not in w)
        skipped = any(command.startswith(start) for start in NOT_HERE)
        assert skipped or program in ("kernelcache", "helm"), command
    assert set(EXPECTED_EXIT) <= set(shown_commands()), "an expected exit of no doc command"


@pytest.mark.parametrize("command", sorted(shown_commands()))
def test_a_command_the_docs_show_runs(sandbox, command):
    if reason := next((why for start, why in NOT_HERE.items() if command.startswith(start)), None):
        pytest.skip(f"{command}: {reason}")
    text = command
    for word, value in sandbox.items():
        text = text.replace(word, value)
    words = shlex.split(text)
    words = words[: next((i for i, w in enumerate(words) if w in (">", "|")), len(words))]
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[0] == "kernelcache":
        proc = run_kernelcache(*words[1:], cwd=Path(sandbox["root"]), **env)
    else:
        if words[1] in ("install", "upgrade"):
            words = [words[0], "template", *[w for w in words[2:] if w not in RELEASE_FLAGS]]
        proc = subprocess.run([str(HELM), *words[1:]], cwd=sandbox["root"], capture_output=True,
                              text=True, timeout=scaled(120),
                              env={**os.environ, **env})  # fmt: skip
    expected = EXPECTED_EXIT.get(command, 0)
    assert proc.returncode == expected, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


# --- what the docs say about the program, the chart, the CRD and the demo ----------------------

EXAMPLE_FILES = sorted((REPO / "examples").glob("*.yaml"))
PAGES = [
    *DOCS,
    REPO / "charts" / "README.md",
    REPO / "charts" / "kernelcache" / "templates" / "NOTES.txt",
]
RELEASE = "kernelcache"  # the one release name every page installs and upgrades


def test_the_readme_command_table_lists_every_subcommand():
    from kernelcache.cli import build_parser
    from kernelcache.completion import subcommands

    readme = (REPO / "README.md").read_text().split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `kernelcache ([a-z]+)", readme, re.M))
    assert listed == set(subcommands(build_parser())), "docs/cli.md's table has each one in full"


def printed_columns(*, wide: bool) -> list[str]:
    """The headers ``kubectl get kc`` prints: NAME, then the CRD's printer columns (those of
    priority 1 only with ``-o wide``)."""
    (version,) = crd_manifest()["spec"]["versions"]
    columns = version["additionalPrinterColumns"]
    return ["NAME", *(c["name"].upper() for c in columns if wide or not c.get("priority"))]


def test_the_kubectl_get_kc_headers_shown_are_the_crds_columns():
    shown = 0
    for path in [*PAGES, *EXAMPLE_FILES]:
        for line in path.read_text().splitlines():
            found = re.search(
                r"kubectl get (?:kc|kernelcaches?)\b([^#`]*)#\s*(NAME|\.\.\.)(.*)", line
            )
            if found is None:
                continue
            columns = printed_columns(wide="-o wide" in found[1])
            words = found[3].split()
            assert words == (columns[-len(words) :] if found[2] == "..." else columns[1:]), (
                f"{path.name}: {line.strip()}"
            )
            shown += 1
    assert shown >= 4


def test_every_kernelcache_a_kubectl_command_names_is_an_example():
    examples = {
        d["metadata"]["name"]
        for path in EXAMPLE_FILES
        for d in yaml.safe_load_all(path.read_text())
        if d and d.get("kind") == "KernelCache"
    }
    named = 0
    for path in [*PAGES, *EXAMPLE_FILES]:
        for name in re.findall(
            r"kubectl \w+ [^#`\n]*?\b(?:kc|kernelcaches?)(?:/| +)([a-z0-9][a-z0-9-]*)",
            path.read_text(),
        ):
            assert name in examples, f"{path.name}: kc {name}"
            named += 1
    assert named >= 8


def test_every_page_names_the_one_release_and_installs_the_crd_with_the_chart():
    for path in [*PAGES, *EXAMPLE_FILES]:
        text = path.read_text()
        for verb, name in re.findall(
            r"\bhelm (install|upgrade|template|rollback|history|uninstall) ([^\s`-]\S*)", text
        ):
            assert name == RELEASE, f"{path.name}: helm {verb} {name}"
        assert "kubectl apply -f crds/" not in text, f"{path.name}: the chart installs the CRD"


def test_every_make_target_the_docs_show_exists():
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    shown = 0
    for path in [*PAGES, *EXAMPLE_FILES]:
        for found in re.findall(r"(?:^\s*|`|&& |# +)make ([^`#&\n]*)", path.read_text(), re.M):
            words = [w for w in found.split() if re.fullmatch(r"[a-z][\w-]*", w)]
            assert words, f"{path.name}: make {found}"
            for word in words:
                assert word in targets, f"{path.name}: make {word}"
                shown += 1
    assert shown >= 5


def test_every_toolchain_doctor_names_has_a_page():
    from kernelcache.toolchains import toolchains

    index = (REPO / "docs" / "warmers" / "README.md").read_text()
    for toolchain in toolchains():  # doctor's rows are toolchain/<label>
        assert (REPO / "docs" / "warmers" / f"{toolchain.label}.md").is_file(), toolchain.label
        assert f"]({toolchain.label}.md)" in index, toolchain.label


SIDE = r"\((?:generation [0-9a-f]{16}|this environment|this build)\)"
# explain's lines, and build --dry-run's (which go on to say what the build would run).
EXPLAIN_LINE = re.compile(rf"[\w/.\-]+: .+ {SIDE} != .+ {SIDE}(?:; .+)?")


def test_every_explain_line_shown_labels_both_sides():
    shown = 0
    for doc in DOCS:
        for _, lines in fenced_blocks(doc):
            for line in lines:  # error lines (kernelcache: ...) are the reproductions' to check
                if " != " in line and re.match(r"(?!kernelcache:)[\w/.\-]+: ", line):
                    assert EXPLAIN_LINE.fullmatch(line), f"{doc.name}: {line}"
                    shown += 1
    assert shown >= 3


def demo_counts(sandbox: dict[str, str]) -> tuple[int, int]:
    """(files, kernels) of the example's sm_90a generation, as the sandbox built it."""
    store = Store(Path(sandbox[STORE_AS_DOCUMENTED]))
    generation = store.current("default/demo/sm_90a")
    assert generation is not None
    files = json.loads((generation / "MANIFEST.json").read_text())["files"]
    return len(files), sum(f["path"].endswith(".o") for f in files)


# What the docs say the demo (examples/kernelcache.yaml) publishes and loads, by page.
DEMO_COUNTS = {
    "README.md": [r"verified: (?P<files>\d+) files", r"(?P<kernels>\d+) kernels ready"],
    "docs/cli.md": [r"published generation \w+ \((?P<files>\d+) files\)",
               r"\((?P<files>\d+) files, (?P<kernels>\d+) compiled\)"],
    "docs/warmers/cute-dsl.md": [r"(?P<kernels>\d+) kernels in (?P<files>\d+) files"],
    "docs/cluster-quickstart.md": [r"(?P<kernels>\d+) loaded from cache"],
}  # fmt: skip


def test_the_demo_counts_the_docs_quote_are_what_the_demo_publishes(sandbox):
    files, kernels = demo_counts(sandbox)
    for name, patterns in DEMO_COUNTS.items():
        text = (REPO / name).read_text()
        for pattern in patterns:
            quoted = list(re.finditer(pattern, text))
            assert quoted, f"{name}: {pattern}"
            for found in quoted:
                said = found.groupdict()
                assert int(said.get("files", files)) == files, f"{name}: {found[0]}"
                assert int(said.get("kernels", kernels)) == kernels, f"{name}: {found[0]}"


def test_the_readme_demo_output_is_what_the_demo_prints(sandbox, tmp_path):
    """README's "What make demo prints" block, against the demo's last two steps run on the
    example's sm_90a generation: counts exact; ids, sizes, seconds and paths any."""
    root = Path(sandbox["root"])
    serve = tmp_path / "serve"
    serve.mkdir()
    args = ("verify", "--store", "store", "-f", "examples/kernelcache.yaml", "--arch", "sm_90a",
            "--check-env", "--materialize", str(serve))  # fmt: skip
    verified = run_kernelcache(*args, cwd=root, PYTHONPATH=str(root / "examples"))
    assert verified.returncode == 0, verified.stderr
    (generation,) = [d for d in serve.iterdir() if d.is_dir()]
    served = subprocess.run(
        [sys.executable, "examples/demo_serve.py"], cwd=root, capture_output=True, text=True,
        timeout=300, env={**os.environ, "CUTE_DSL_ARCH": "sm_90a", "KERNELCACHE_STRICT": "1",
                          "KERNELCACHE_CUTE_DSL_DIR": str(generation / "files" / "cute-dsl")},
    )  # fmt: skip
    assert served.returncode == 0, served.stderr
    printed = (verified.stdout + verified.stderr + served.stdout).splitlines()
    readme = (REPO / "README.md").read_text().split("What `make demo` prints at the end:", 1)[1]
    shown = readme.split("```\n", 2)[1].splitlines()
    assert len(shown) == 2
    for line in shown:
        parts = re.split(r"([0-9a-f]{6,}…|\d+\.\d+|…)", line)  # the separators at odd places
        pattern = "".join(".*" if i % 2 else re.escape(part) for i, part in enumerate(parts))
        assert any(re.fullmatch(pattern, p) for p in printed), f"README shows\n  {line}\n{printed}"


# --- recipes: serving pods that another controller makes ---------------------------------------

RECIPES = ["kserve-inferenceservice.yaml", "leaderworkerset.yaml"]
# KServe's and Knative's container beside the predictor's in Serverless mode.
QUEUE_PROXY = {"name": "queue-proxy", "image": "gcr.io/knative-releases/queue:v1.15"}


def pods_made_by(doc: dict) -> list[dict]:
    """The pods an InferenceService or a LeaderWorkerSet makes, as the webhook sees them:
    the labels, annotations and pod spec each controller copies onto its pods."""
    meta = {"namespace": doc["metadata"]["namespace"], "name": doc["metadata"]["name"]}
    if doc["kind"] == "InferenceService":
        predictor = doc["spec"]["predictor"]
        spec = {k: predictor[k] for k in ("containers", "volumes") if k in predictor}
        spec["containers"] = [*spec["containers"], QUEUE_PROXY]
        labels, annotations = predictor.get("labels", {}), predictor.get("annotations", {})
        return [{"metadata": {**meta, "labels": labels, "annotations": annotations}, "spec": spec}]
    assert doc["kind"] == "LeaderWorkerSet", doc["kind"]
    templates = doc["spec"]["leaderWorkerTemplate"]
    return [
        {"metadata": {**meta, **templates[t]["metadata"]}, "spec": templates[t]["spec"]}
        for t in ("leaderTemplate", "workerTemplate")
    ]


def without_listen_flags(args: list[str]) -> list[str]:
    """Engine arguments without where the server listens (not part of any compile key)."""
    kept, skip = [], False
    for arg in args:
        if not skip and arg not in ("--host", "--port"):
            kept.append(arg)
        skip = arg in ("--host", "--port") and not skip
    return kept


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipes_pods_are_injected_and_start_the_engine_as_it_was_warmed(recipe):
    from kernelcache.contract import LABEL_CACHE
    from kernelcache.controller.config import OperatorConfig
    from kernelcache.controller.webhook import apply_ops, mutate_pod
    from kernelcache.spec import parse_kernelcache
    from kernelcache.toolchains.vllm.engine import serve_command

    kernelcaches = {
        d["metadata"]["name"]: d
        for path in EXAMPLE_FILES
        for d in yaml.safe_load_all(path.read_text())
        if d and d.get("kind") == "KernelCache"
    }
    (doc,) = yaml.safe_load_all((EXAMPLES / recipe).read_text())
    for pod in pods_made_by(doc):
        kc_doc = kernelcaches[pod["metadata"]["labels"][LABEL_CACHE]]
        kc = parse_kernelcache(kc_doc, recipe)
        injected = apply_ops(pod, mutate_pod(pod, kc_doc, OperatorConfig()))
        assert [c["name"] for c in injected["spec"]["initContainers"]] == ["kernelcache"]
        (container,) = [c for c in injected["spec"]["containers"] if c["name"] != "queue-proxy"]
        assert container["image"] == kc.spec.engine.image
        assert {"name": "KERNELCACHE_RUNTIME", "value": "1"} in container["env"]
        (warmer,) = [w for w in kc.spec.warmers if w.type == "vllm"]
        engine = serve_command(warmer.vllm_workload().engine_args(), 0)
        assert without_listen_flags(container["args"]) == without_listen_flags(engine[4:])
        for name, value in warmer.env.items():  # vLLM hashes its variables into its key
            assert {"name": name, "value": value} in container["env"], name
        model = kc.spec.model_volume
        assert model is not None
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == model.mount_path]
        (volume,) = [v for v in injected["spec"]["volumes"] if v["name"] == mount["name"]]
        assert {**volume, "name": "model"} == {"name": "model", **model.volume_source()}


# --- the images ---------------------------------------------------------------------------------

DOCKERFILES = sorted(REPO.glob("*/Dockerfile"))


def dockerignored(path: str, rules: list[str]) -> bool:
    """Whether the builder leaves ``path`` (relative to the context) out: the last rule that
    matches it or a directory above it decides, ``!`` keeping it (Docker's semantics)."""
    from fnmatch import fnmatchcase

    parts = path.split("/")
    ignored = False
    for rule in rules:
        keep = rule.startswith("!")
        pattern = rule.removeprefix("!").strip("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        wildcard = pattern.removeprefix("**/")
        if any(fnmatchcase(p, pattern) for p in prefixes) or (
            pattern.startswith("**/") and any(fnmatchcase(part, wildcard) for part in parts)
        ):
            ignored = not keep
    return ignored


def test_the_build_context_holds_what_the_dockerfiles_copy_and_no_more():
    rules = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = {
        source
        for dockerfile in DOCKERFILES
        for line in dockerfile.read_text().splitlines()
        if line.startswith("COPY ") and "--from" not in line
        for source in line.split()[1:-1]
    }
    assert copied, DOCKERFILES
    for source in copied:
        assert not dockerignored(source, rules), source
    tracked = subprocess.run(
        ["git", "ls-files", "--", *sorted(copied)], cwd=REPO, capture_output=True, text=True,
        check=True,
    ).stdout.split()  # fmt: skip
    assert tracked
    for rel in tracked:  # everything a COPY takes that the repository holds reaches the build
        assert not dockerignored(rel, rules), rel
    outside = (".venv/bin/python", ".tools/bin/helm", ".git/HEAD", "tests/test_docs.py",
               "demo-store/x", "src/kernelcache/__pycache__/cli.cpython-311.pyc")  # fmt: skip
    for left_out in outside:
        assert dockerignored(left_out, rules), left_out


def test_the_serving_image_defaults_to_the_vllm_the_benchmarks_measured():
    measured = re.search(r"vLLM (\d+\.\d+\.\d+)", (REPO / "docs" / "BENCHMARKS.md").read_text())
    assert measured is not None
    default = re.search(
        r"^ARG VLLM_IMAGE=\S+:v(\S+)$", (REPO / "serving" / "Dockerfile").read_text(), re.M
    )
    assert default is not None and default[1] == measured[1]


def test_the_package_license_is_an_spdx_expression_with_its_file():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert all((REPO / f).is_file() for f in project["license-files"])
