"""The flashinfer warmer: env contract, build log, AOT layout, tactics checks, real builds.

FlashInfer imports without a GPU, and its nvcc modules compile for any arch on a CPU-only
machine, so everything up to launching a kernel runs in CI; launching, tuning and serving with
``FLASHINFER_DISABLE_JIT=1`` are the ``gpu`` tests. FlashInfer fixes its cache paths when it is
imported, so every test that imports it does so in a child process of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kernelcache.errors import ExitCode, WarmError
from kernelcache.store import Store, verify
from kernelcache.toolchains.flashinfer import (
    aot_layout,
    check_tactics,
    cuda_arch_list,
    gpu_slug,
    parse_build_log,
    serving_env,
    tactics_file,
)
from tests.conftest import EXAMPLES, scaled, subprocess_env
from tests.conftest import run_kernelcache as kernelcache

HAVE_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(
    not HAVE_FLASHINFER, reason="flashinfer-python is not installed"
)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(not _cuda_available(), reason="torch.cuda.is_available() is false")


def gpu_test(fn):
    """A test that launches FlashInfer kernels: marked ``gpu``, skipped without one."""
    return pytest.mark.gpu(needs_flashinfer(needs_cuda(fn)))


VERSION = "0.7.4"
SINGLE_DECODE = (
    "single_decode_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_"
    "head_dim_qk_128_head_dim_vo_128_posenc_0_use_swa_False_use_logits_cap_False"
)
DECODE_WORKLOAD = {"head_dims": [128], "dtypes": ["bfloat16"]}

# Runs one flashinfer warmer in a fresh process and prints its report as JSON; a WarmError
# is its message on stderr and the warm exit code. FAKE_GPU="name|arch" stands in for the
# visible GPU, so tactics checks run without one.
RUN_WARMER = """
import json, os, sys
from pathlib import Path
from kernelcache.errors import WarmError
from kernelcache.spec import Warmer
from kernelcache.toolchains import flashinfer as fi
if os.environ.get("FAKE_GPU"):
    fi.visible_gpu = lambda: tuple(os.environ["FAKE_GPU"].split("|"))
if os.environ.get("IMPORT_FLASHINFER_FIRST"):
    import flashinfer
config = Warmer.model_validate(json.loads(sys.argv[1]))
try:
    report = fi.FlashInferWarmer(config, Path(sys.argv[2])).run(Path(sys.argv[3]), sys.argv[4])
except WarmError as exc:
    print(exc.message, file=sys.stderr)
    sys.exit(int(exc.code))
print(json.dumps(report.to_dict()))
"""


def python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=scaled(900),
    )


def run_warmer(
    tmp_path: Path, arch: str, warmer: dict, **env: str
) -> tuple[subprocess.CompletedProcess, Path]:
    """One warm of ``warmer`` (camelCase spec fields) into ``tmp_path/files``."""
    files = tmp_path / "files"
    files.mkdir(exist_ok=True)
    config = json.dumps({"type": "flashinfer", **warmer})
    return python(RUN_WARMER, config, str(tmp_path), str(files), arch, **env), files


def report_of(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def warm_error(proc: subprocess.CompletedProcess) -> str:
    """The one-line message of a failed warm (FlashInfer's own logging may precede it)."""
    assert proc.returncode == ExitCode.WARM_FAILED, proc.stdout + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def write_module(tmp_path: Path, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(source)


# --- pure helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "expected"),
    [
        ("sm_90a", "9.0a"),
        ("sm_100a", "10.0a"),
        ("sm_103a", "10.3a"),
        ("sm_120a", "12.0a"),
        ("sm_120f", "12.0f"),
        ("sm_89", "8.9"),
    ],
)
def test_arch_list_is_flashinfers_major_dot_minor_format(arch, expected):
    assert cuda_arch_list(arch) == expected


def test_a_malformed_arch_is_a_warm_error():
    with pytest.raises(WarmError, match="sm90a"):
        cuda_arch_list("sm90a")


def test_tactics_live_under_a_slug_of_the_gpu_product(tmp_path):
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug("NVIDIA RTX PRO 6000 Blackwell Server Edition") == (
        "nvidia-rtx-pro-6000-blackwell-server-edition"
    )
    assert tactics_file(tmp_path, "NVIDIA H200") == tmp_path / "tactics" / "nvidia-h200.json"


def test_serving_env_carries_the_arch_list_the_warm_used(tmp_path):
    assert serving_env(tmp_path, "sm_120a") == {
        "FLASHINFER_WORKSPACE_BASE": str(tmp_path),
        "FLASHINFER_CUDA_ARCH_LIST": "12.0a",
        "FLASHINFER_DISABLE_JIT": "1",
    }


def test_build_log_tells_real_builds_from_noops_and_filters_by_pid(tmp_path):
    log = tmp_path / "build.jsonl"
    lines = [
        # A cold nvcc build, its ninja no-op in a later process, a CuTe-DSL compile (logged
        # only when it compiles, so never a no-op however short), a parallel prebuild.
        {"toolchain": "nvcc", "name": SINGLE_DECODE, "seconds": 12.304, "pid": 100, "time": 1.5},
        {"toolchain": "nvcc", "name": SINGLE_DECODE, "seconds": 0.011, "pid": 200, "time": 2.5},
        {"toolchain": "cute_dsl", "name": "gemm_sm90a_cute_dsl/k0", "seconds": 0.3, "pid": 200,
         "time": 3.5},
        {"toolchain": "nvcc", "name": "prebuild[2 modules]", "seconds": 22.754, "pid": 200,
         "time": 4.5},
    ]  # fmt: skip
    text = "".join(json.dumps(line) + "\n" for line in lines)
    log.write_text(text + "not json\n" + '{"toolchain": "nvcc", "name": "x"}\n' + '{"tool')

    records = parse_build_log(log)
    assert [(r.name, r.noop) for r in records] == [
        (SINGLE_DECODE, False),
        (SINGLE_DECODE, True),
        ("gemm_sm90a_cute_dsl/k0", False),
        ("prebuild[2 modules]", False),
    ]
    assert records[0].seconds == 12.304 and records[0].pid == 100 and records[0].time == 1.5
    assert [r.name for r in parse_build_log(log, pid=100)] == [SINGLE_DECODE]
    assert [r.noop for r in parse_build_log(log, pid=200, noop_threshold=30)] == [
        True,
        False,
        True,
    ]
    assert parse_build_log(tmp_path / "absent.jsonl") == []


def fake_workspace(base: Path) -> Path:
    """A FlashInfer workspace as a build leaves it: nvcc modules, a CuTe-DSL module, locks."""
    workspace = base / ".cache" / "flashinfer" / VERSION / "90a"
    jit = workspace / "cached_ops"
    for name in (SINGLE_DECODE, "gemm"):
        module = jit / name
        module.mkdir(parents=True)
        (module / f"{name}.so").write_bytes(name.encode() * 3)
        (module / f"{name}_binding.cuda.o").write_bytes(b"object")
        (module / "build.ninja").write_text("rule cxx\n")
    failed = jit / "batch_decode_failed"
    failed.mkdir()
    (failed / "build.ninja").write_text("rule cxx\n")  # its build failed: no .so
    cute = jit / "gemm_sm90a_cute_dsl"
    cute.mkdir()
    (cute / "k0.o").write_bytes(b"o")
    (cute / "meta.json").write_text("{}")
    (jit / "tmp").mkdir()
    (jit / "tmp" / f"{SINGLE_DECODE}.lock").write_text("")
    (workspace / "generated" / SINGLE_DECODE).mkdir(parents=True)
    return workspace


def test_aot_layout_copies_each_built_module_library_and_nothing_else(tmp_path):
    workspace = fake_workspace(tmp_path / "flashinfer")
    target = tmp_path / "flashinfer" / "aot"
    assert aot_layout(workspace, target) == sorted(["gemm", SINGLE_DECODE])
    laid = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert laid == sorted(["gemm/gemm.so", f"{SINGLE_DECODE}/{SINGLE_DECODE}.so"])
    so = target / SINGLE_DECODE / f"{SINGLE_DECODE}.so"
    assert so.read_bytes() == SINGLE_DECODE.encode() * 3 and not so.is_symlink()
    assert aot_layout(workspace, target) == sorted(["gemm", SINGLE_DECODE])  # idempotent


def tactics(path: Path, gpu_name: object, **entries: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"_metadata": {"flashinfer_version": VERSION, "gpu": gpu_name}, **entries}
    path.write_text(json.dumps(data))
    return path


def test_tactics_file_must_exist_and_be_stamped_for_this_gpu(tmp_path):
    path = tmp_path / "tactics" / "nvidia-h200.json"
    with pytest.raises(WarmError, match=r"tactics/nvidia-h200.json did not appear"):
        check_tactics(path, "NVIDIA H200")

    tactics(path, "NVIDIA B200", op=["Runner", 3])
    with pytest.raises(WarmError) as info:
        check_tactics(path, "NVIDIA H200")
    assert info.value.message.endswith(
        "is stamped for NVIDIA B200, this GPU is NVIDIA H200: FlashInfer will ignore it"
    )

    tactics(path, "unknown", op=["Runner", 3])
    with pytest.raises(WarmError, match="unknown GPU: FlashInfer will ignore it"):
        check_tactics(path, "NVIDIA H200")

    path.write_text("[]")
    with pytest.raises(WarmError, match="not a FlashInfer autotuner cache"):
        check_tactics(path, "NVIDIA H200")

    tactics(path, "*", a=["R", 1], b=["R", 2], _generation="x")
    assert check_tactics(path, "NVIDIA H200") == 2
    tactics(path, "NVIDIA H200", a=["R", 1], _records={"ns": {"k1": 1, "k2": 2}})
    assert check_tactics(path, "NVIDIA H200") == 3


def test_importing_the_warmer_imports_neither_flashinfer_nor_torch():
    proc = python(
        "import sys, kernelcache.toolchains.flashinfer\n"
        "print(sorted({'flashinfer', 'torch'} & set(sys.modules)))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --- FlashInfer imported (CPU) --------------------------------------------------------------

ENV_PROBE = """
import json, sys
from pathlib import Path
import flashinfer
from flashinfer.jit import env as jit_env
from kernelcache.toolchains.flashinfer import use_aot_dir
before = str(jit_env.get_aot_path(sys.argv[2]))
use_aot_dir(Path(sys.argv[1]))
print(json.dumps({
    "version": flashinfer.__version__,
    "base": str(jit_env.FLASHINFER_BASE_DIR),
    "workspace": str(jit_env.FLASHINFER_WORKSPACE_DIR),
    "jit": str(jit_env.FLASHINFER_JIT_DIR),
    "aot_before": before,
    "aot": [str(a.path) for a in jit_env.get_aot_artifacts(sys.argv[2])],
}))
"""


@needs_flashinfer
@pytest.mark.parametrize(("arch", "arch_dir"), [("sm_90a", "90a"), ("sm_120a", "120a")])
def test_flashinfer_puts_its_workspace_and_finds_aot_modules_where_we_say(tmp_path, arch, arch_dir):
    base, aot = tmp_path / "files" / "flashinfer", tmp_path / "files" / "flashinfer" / "aot"
    aot_layout(fake_workspace(tmp_path / "built"), aot)
    proc = python(ENV_PROBE, str(aot), SINGLE_DECODE, **serving_env(base, arch))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["base"] == str(base)
    assert seen["workspace"] == str(base / ".cache" / "flashinfer" / seen["version"] / arch_dir)
    assert seen["jit"] == seen["workspace"] + "/cached_ops"
    # Without use_aot_dir FlashInfer looks inside its own package, not in the generation.
    assert seen["aot_before"].endswith(f"flashinfer/data/aot/{SINGLE_DECODE}/{SINGLE_DECODE}.so")
    assert seen["aot"] == [str(aot / SINGLE_DECODE / f"{SINGLE_DECODE}.so")]


NOOP_OPS = "def warm(workload):\n    return []\n"


@needs_flashinfer
@pytest.mark.parametrize(
    ("warmer", "env", "needle"),
    [
        (
            {"expect": ["module:single_decode_x"]},
            {},
            "declared module single_decode_x did not appear under "
            f"flashinfer/.cache/flashinfer/{VERSION}/90a/cached_ops for sm_90a (built: none)",
        ),
        ({"expect": ["kernel:x"]}, {}, "expect entry 'kernel:x' is neither"),
        ({"expect": ["tactics"]}, {}, "expect 'tactics' needs the workload's tune: true"),
        (
            {"workload": {"tune": True}},
            {"CUDA_VISIBLE_DEVICES": ""},
            "tune: true needs a sm_90a GPU, and none is visible",
        ),
        (
            {"workload": {"tune": True}},
            {"FAKE_GPU": "NVIDIA B200|sm_100a"},
            "the visible GPU is NVIDIA B200 (sm_100a)",
        ),
        (
            {"workload": {"tune": True}, "expect": ["tactics"]},
            {"FAKE_GPU": "NVIDIA H200|sm_90a"},
            "tactics file tactics/nvidia-h200.json did not appear: FlashInfer tuned nothing",
        ),
        (
            {},
            {"IMPORT_FLASHINFER_FIRST": "1"},
            "flashinfer was imported in this process before the warmer set",
        ),
    ],
)
def test_a_declared_artifact_that_did_not_appear_fails_in_one_line(tmp_path, warmer, env, needle):
    write_module(tmp_path, "noop_ops", NOOP_OPS)
    # A FlashInfer imported before the warmer writes here, not into the user's home.
    env = {"FLASHINFER_WORKSPACE_BASE": str(tmp_path / "elsewhere"), **env}
    proc, _ = run_warmer(tmp_path, "sm_90a", {"entryPoints": ["noop_ops:warm"], **warmer}, **env)
    assert needle in warm_error(proc)


@needs_flashinfer
def test_a_tactics_file_stamped_for_another_gpu_is_refused_and_left_as_it_was(tmp_path):
    write_module(tmp_path, "noop_ops", NOOP_OPS)
    stamped = tactics(
        tmp_path / "files" / "flashinfer" / "tactics" / "nvidia-h200.json",
        "NVIDIA B200",
        op=["Runner", 3],
    )
    before = stamped.read_bytes()
    warmer = {"entryPoints": ["noop_ops:warm"], "workload": {"tune": True}}
    proc, _ = run_warmer(tmp_path, "sm_90a", warmer, FAKE_GPU="NVIDIA H200|sm_90a")
    assert warm_error(proc).endswith(
        "tactics file tactics/nvidia-h200.json is stamped for NVIDIA B200, this GPU is "
        "NVIDIA H200: FlashInfer will ignore it"
    )
    assert stamped.read_bytes() == before  # FlashInfer declined to save into it


@needs_flashinfer
def test_an_entry_point_that_raises_is_one_line_naming_it(tmp_path):
    write_module(tmp_path, "bad_ops", "def warm(workload):\n    raise RuntimeError('a\\nb')\n")
    proc, _ = run_warmer(tmp_path, "sm_90a", {"entryPoints": ["bad_ops:warm"]})
    assert warm_error(proc) == "entry point bad_ops:warm failed for sm_90a: RuntimeError: a"


def _cuda_home() -> Path | None:
    """A CUDA toolkit FlashInfer can build with: nvcc, and cudart to link against."""
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    has_toolkit = (home / "bin" / "nvcc").exists() and (home / "lib64").is_dir()
    return home if has_toolkit and shutil.which("ninja") and shutil.which("gcc") else None


def link_env(tmp_path: Path) -> dict[str, str]:
    """Lets FlashInfer link its modules on a machine without a GPU driver.

    Its modules link ``-lcuda``, which a full toolkit provides as ``lib64/stubs/libcuda.so``;
    where the stub is missing a stand-in is built (the library is only linked, never loaded).
    """
    home = _cuda_home()
    assert home is not None
    env = {"CUDA_HOME": str(home)}
    if not (home / "lib64" / "stubs" / "libcuda.so").exists():
        stub = tmp_path / "stubs"
        stub.mkdir()
        (stub / "stub.c").write_text("void kernelcache_stub(void) {}\n")
        subprocess.run(
            ["gcc", "-shared", "-fPIC", str(stub / "stub.c"), "-o", str(stub / "libcuda.so"),
             "-Wl,-soname,libcuda.so.1"],
            check=True,
        )  # fmt: skip
        env["LIBRARY_PATH"] = str(stub)
    return env


@needs_flashinfer
@pytest.mark.skipif(_cuda_home() is None, reason="no CUDA toolkit (nvcc, lib64), ninja or gcc")
@pytest.mark.slow
def test_build_compiles_a_decode_module_for_sm90a_without_a_gpu_and_lays_it_out_for_aot(
    tmp_path,
):
    (tmp_path / "flashinfer_ops.py").write_text((EXAMPLES / "flashinfer_ops.py").read_text())
    doc = yaml.safe_load((EXAMPLES / "kernelcache.yaml").read_text())
    doc["spec"]["gpuClasses"] = [{"name": "h200", "arch": "sm_90a"}]
    doc["spec"]["warmers"] = [
        {
            "type": "flashinfer",
            "entryPoints": ["flashinfer_ops:warm"],
            "expect": [f"module:{SINGLE_DECODE}"],
            "env": link_env(tmp_path),
            "workload": DECODE_WORKLOAD,
        }
    ]
    spec, store = tmp_path / "kc.yaml", tmp_path / "store"
    spec.write_text(yaml.safe_dump(doc))
    proc = kernelcache("build", "-f", str(spec), "--store", str(store), CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr[-3000:]

    key = "default/demo/sm_90a"
    manifest = Store(store).current_manifest(key)
    (report,) = manifest.report["warmers"]
    assert report["arch_list"] == "9.0a"
    assert report["workspace"] == f"flashinfer/.cache/flashinfer/{VERSION}/90a"
    assert report["modules"] == report["aot"] == [SINGLE_DECODE]
    assert report["kernels"] == [SINGLE_DECODE]
    assert report["compiled"] == 1 and report["noops"] == []
    (build,) = report["builds"]
    assert build["toolchain"] == "nvcc" and build["seconds"] > 1 and not build["noop"]
    assert report["tactics"] is None

    generation = Store(store).current(key)
    files = generation / "files"
    workspace_so = files / report["workspace"] / "cached_ops" / SINGLE_DECODE
    aot_so = files / "flashinfer" / "aot" / SINGLE_DECODE / f"{SINGLE_DECODE}.so"
    assert aot_so.read_bytes() == (workspace_so / f"{SINGLE_DECODE}.so").read_bytes()
    assert aot_so.read_bytes()[:4] == b"\x7fELF"
    listed = {f.path for f in manifest.files}
    assert f"flashinfer/aot/{SINGLE_DECODE}/{SINGLE_DECODE}.so" in listed
    assert verify(generation).ok


# --- GPU: build, tune, then serve with JIT disabled -----------------------------------------

SERVE_DECODE = """
import json, os, sys
from pathlib import Path
flashinfer_dir, aot, arch = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
from kernelcache.toolchains import flashinfer as fi
os.environ.update(fi.serving_env(flashinfer_dir, arch))
import torch, flashinfer
if aot:
    fi.use_aot_dir(Path(aot))
q = torch.randn(32, 128, dtype=torch.bfloat16, device="cuda")
k = torch.randn(256, 8, 128, dtype=torch.bfloat16, device="cuda")
try:
    out = flashinfer.single_decode_with_kv_cache(q, k, k)
except flashinfer.jit.MissingJITCacheError as exc:
    print("missing", exc.spec.name)
    sys.exit(3)
torch.cuda.synchronize()
assert torch.isfinite(out).all()
print("served", tuple(out.shape))
"""


def visible_arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


@gpu_test
def test_gpu_decode_module_built_once_then_served_from_aot_with_jit_disabled(tmp_path):
    arch = visible_arch()
    warmer = {
        "entryPoints": ["flashinfer_ops:warm"],
        "expect": [f"module:{SINGLE_DECODE}"],
        "workload": DECODE_WORKLOAD,
    }
    proc, files = run_warmer(tmp_path, arch, warmer)
    report = report_of(proc)
    assert report["modules"] == report["aot"] == [SINGLE_DECODE]
    (build,) = report["builds"]
    assert build["name"] == SINGLE_DECODE and build["seconds"] > 1
    assert report["kernels"] == ["single_decode[bfloat16,hd=128]"]

    # The same warm again: FlashInfer goes through ninja, which finds it up to date.
    again = report_of(run_warmer(tmp_path, arch, warmer)[0])
    assert again["builds"] == [] and [n["name"] for n in again["noops"]] == [SINGLE_DECODE]

    flashinfer_dir = files / "flashinfer"
    aot = flashinfer_dir / "aot"
    # JIT disabled refuses the warm workspace on its own ...
    refused = python(SERVE_DECODE, str(flashinfer_dir), "", arch)
    assert refused.returncode == 3, refused.stderr[-3000:]
    assert refused.stdout.split() == ["missing", SINGLE_DECODE]
    # ... and loads the AOT layout, even with an empty workspace: nothing is built.
    empty = tmp_path / "empty-workspace"
    log = tmp_path / "serve-log.jsonl"
    served = python(SERVE_DECODE, str(empty), str(aot), arch, FLASHINFER_JIT_BUILD_LOG=str(log))
    assert served.returncode == 0, served.stderr[-3000:]
    assert "served (32, 128)" in served.stdout
    assert parse_build_log(log) == []

    # The example's serving process on the generation: every op from the cache.
    main = subprocess.run(
        [sys.executable, str(EXAMPLES / "flashinfer_ops.py"), "--files", str(files),
         "--arch", arch, "--workload", json.dumps(DECODE_WORKLOAD)],
        env=subprocess_env(), capture_output=True, text=True, timeout=scaled(600),
    )  # fmt: skip
    assert main.returncode == 0, main.stdout + main.stderr[-3000:]
    assert "0 compiled" in main.stdout


@gpu_test
def test_gpu_module_compiled_without_a_visible_gpu_serves_on_the_gpu(tmp_path):
    arch = visible_arch()
    warmer = {"entryPoints": ["flashinfer_ops:warm"], "workload": DECODE_WORKLOAD}
    env = link_env(tmp_path) if _cuda_home() else {}
    proc, files = run_warmer(tmp_path, arch, warmer, CUDA_VISIBLE_DEVICES="", **env)
    report = report_of(proc)
    assert report["kernels"] == [SINGLE_DECODE]  # the prebuild path: nothing was launched
    served = python(SERVE_DECODE, str(tmp_path / "empty"), str(files / "flashinfer" / "aot"), arch)
    assert served.returncode == 0, served.stderr[-3000:]


TUNED_BMM = """
import json, sys
from flashinfer.autotuner import AutoTuner, autotune
import flashinfer_ops
with autotune(True, cache=sys.argv[1]):
    flashinfer_ops.run_ops({"bmm_fp8": [[1, 128, 256, 512]]})
# Profiles measured in this process (counted only when a tactic was profiled, not on a hit).
print(json.dumps(AutoTuner.get().stats.tuned_op_successful_configs))
"""


@gpu_test
def test_gpu_bmm_fp8_tuned_in_the_warm_is_not_profiled_again(tmp_path):
    import torch

    arch, product = visible_arch(), torch.cuda.get_device_name()
    warmer = {
        "entryPoints": ["flashinfer_ops:warm"],
        "expect": ["tactics"],
        "workload": {"dtypes": [], "bmm_fp8": [[1, 128, 256, 512]], "tune": True},
    }
    proc, files = run_warmer(tmp_path, arch, warmer)
    report = report_of(proc)
    path = files / "flashinfer" / "tactics" / f"{gpu_slug(product)}.json"
    assert report["tactics"] == {
        "file": f"flashinfer/tactics/{gpu_slug(product)}.json",
        "gpu": product,
        "entries": report["tactics"]["entries"],
    }
    assert report["tactics"]["entries"] >= 1
    assert json.loads(path.read_text())["_metadata"]["gpu"] == product

    env = {"FLASHINFER_WORKSPACE_BASE": str(files / "flashinfer")}
    cold = python(TUNED_BMM, str(tmp_path / "cold.json"), **env)
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert json.loads(cold.stdout.strip().splitlines()[-1])  # profiled without the file
    warm = python(TUNED_BMM, str(path), **env)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert json.loads(warm.stdout.strip().splitlines()[-1]) == {}  # every shape from the file
