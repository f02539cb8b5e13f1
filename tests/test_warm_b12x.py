"""The b12x warmer with the real FlashInfer and CuTe DSL, on a machine without a GPU.

A small NVFP4 MoE config is warmed for an sm_120a GPU class (188 SMs): FlashInfer's wrapper
picks the kernels, they compile for sm_120a on the CPU, and a fresh serving process (the
runtime installed, the wrapper driven through its real kernel lookup) finds every one of
them without compiling. Launching them needs a Blackwell GPU: the serving process never
calls a kernel (see tests/helpers/b12x_serve.py). Then every factor FlashInfer keys its
kernels on is changed in turn, and verify refuses the generation naming that factor.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelcache import stamp as stamps
from kernelcache.errors import ExitCode
from kernelcache.spec import B12xWorkload
from tests.conftest import scaled

from .conftest import (
    kernelcache_doc,
    needs_cute,
    one_line_error,
    run_kernelcache,
    serve_python,
    subprocess_env,
)

pytestmark = [pytest.mark.slow, needs_cute]

flashinfer_spec = importlib.util.find_spec("flashinfer")
if flashinfer_spec is None:
    pytest.skip("flashinfer is not installed", allow_module_level=True)

SERVE = Path(__file__).parent / "helpers" / "b12x_serve.py"
ARCH = "sm_120a"
SM_COUNT = 188
KEY = f"ci/tiny-moe/{ARCH}"
WORKLOAD = {
    "experts": 8,
    "topK": 2,
    "hiddenSize": 256,
    "intermediateSize": 256,
    "maxNumTokens": 64,
    "batchSizes": [1, 16, 64],  # direct micro, and two static kernels of different occupancy
    "compileWorkers": 2,
}


def b12x_spec(path: Path, gpu: dict[str, Any] | None = None, **workload: Any) -> Path:
    gpu = gpu or {"name": "rtx-pro-6000", "arch": ARCH, "smCount": SM_COUNT, "compileOn": "cpu"}
    doc = kernelcache_doc(
        "tiny-moe",
        "ci",
        model="test/tiny-moe-nvfp4",
        gpuClasses=[gpu],
        warmers=[{"type": "b12x", "workload": {**WORKLOAD, **workload}}],
    )
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One warmed store (built once for the module) and the b12x warmer's report."""
    root = tmp_path_factory.mktemp("b12x")
    spec = b12x_spec(root / "kc.yaml")
    proc = run_kernelcache("warm", "-f", str(spec), "--store", str(root / "store"), "--arch", ARCH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "b12x: [3/3]" in proc.stdout + proc.stderr  # progress per kernel
    (manifest,) = (root / "store").glob(f"{KEY}/*/MANIFEST.json")
    (report,) = json.loads(manifest.read_text())["report"]["warmers"]
    return root / "store", report


def materialize(store: Path, target: Path, **env: str) -> Path:
    target.mkdir()
    proc = run_kernelcache(
        "verify", "--store", str(store), "--key", KEY, "--arch", ARCH, "--check-env",
        "--materialize", str(target), **env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (generation,) = [p for p in target.iterdir() if p.is_dir()]
    return generation


def serve(generation: Path, tmp_path: Path, *, strict: bool) -> subprocess.CompletedProcess:
    return serve_python(
        SERVE,
        json.dumps(WORKLOAD),
        str(SM_COUNT),
        KERNELCACHE_DIR=str(generation),
        KERNELCACHE_STRICT="1" if strict else "0",
        CUTE_DSL_ARCH=ARCH,
        FLASHINFER_CUDA_ARCH_LIST="12.0f",  # what FlashInfer detects on an sm_120 GPU
        FLASHINFER_JIT_BUILD_LOG=str(tmp_path / "build-log.jsonl"),
        HOME=str(tmp_path),
    )


def test_the_report_lists_what_was_compiled(warmed: tuple[Path, dict[str, Any]]) -> None:
    _, report = warmed
    assert report["targets"] == [f"{ARCH}/{SM_COUNT}sm"]
    assert report["arch_list"] == "12.0f"
    assert report["module_dir"].endswith("/120f/cached_ops/b12x_moe_sm120a_cute_dsl")
    assert len(report["kernels"]) == 2 and all(k.startswith("static_") for k in report["kernels"])
    assert len(report["direct_micro"]) == 1
    timed = report["compile_seconds"]
    assert set(timed) == set(report["kernels"]) | set(report["direct_micro"])
    assert all(seconds > 0 for seconds in timed.values())
    assert report["serial_seconds"] == pytest.approx(sum(timed.values()), abs=0.01)


def test_a_fresh_serving_process_finds_every_kernel_and_compiles_none(
    warmed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    store, report = warmed
    generation = materialize(store, tmp_path / "serve")
    proc = serve(generation, tmp_path, strict=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(k["name"] for k in served["loaded"]) == report["kernels"]
    assert served["builds"] == [] and served["compiles"] == {}
    assert served["cache_hits"] == len(report["direct_micro"])  # through the disk layer


def test_a_kernel_missing_from_the_generation_is_compiled_in_serving_and_seen(
    warmed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    store, report = warmed
    generation = materialize(store, tmp_path / "serve")
    missing = report["kernels"][0]
    kernel_file = generation / "files" / report["module_dir"] / f"{missing}.o"
    kernel_file.unlink()
    proc = serve(generation, tmp_path, strict=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout.splitlines()[-1])
    assert served["builds"] == [f"b12x_moe_sm120a_cute_dsl/{missing}"]  # FlashInfer's record

    kernel_file.unlink()  # FlashInfer kept what it compiled (this copy is writable)
    refused = serve(generation, tmp_path, strict=True)
    assert refused.returncode != 0
    refusal = f"flashinfer: cold compile of b12x_moe_sm120a_cute_dsl/{missing} in strict mode"
    assert refusal in refused.stderr


@pytest.mark.parametrize(
    ("env", "factor"),
    [
        ({"KERNELCACHE_SM_COUNT": "170"}, "gpu/sm_count"),
        ("install", "flashinfer/install"),
        ("dsl-package", "flashinfer/cute-dsl-fingerprint"),
    ],
    ids=["sm-count", "install-path", "dsl-package-record"],
)
def test_verify_refuses_what_flashinfer_would_silently_rebuild(
    warmed: tuple[Path, dict[str, Any]], tmp_path: Path, env: Any, factor: str
) -> None:
    """FlashInfer wipes and recompiles its kernels on any of these; verify must say so first."""
    store, _ = warmed
    if env == "install":  # the same FlashInfer, imported from another path
        moved = tmp_path / "moved"
        moved.mkdir()
        assert flashinfer_spec is not None and flashinfer_spec.origin is not None
        (moved / "flashinfer").symlink_to(Path(flashinfer_spec.origin).parent)
        env = {"PYTHONPATH": f"{moved}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    elif env == "dsl-package":  # one more nvidia-cutlass-dsl* distribution installed
        extra = tmp_path / "extra"
        info = extra / "nvidia_cutlass_dsl_libs_extra-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: nvidia-cutlass-dsl-libs-extra\nVersion: 1.0\n"
        )
        (info / "RECORD").write_text("nvidia_cutlass_dsl_libs_extra-1.0.dist-info/METADATA,,\n")
        env = {"PYTHONPATH": f"{extra}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    target = tmp_path / "serve"
    target.mkdir()
    proc = run_kernelcache(
        "verify", "--store", str(store), "--key", KEY, "--arch", ARCH, "--check-env",
        "--materialize", str(target), **env,
    )  # fmt: skip
    assert proc.returncode == ExitCode.STAMP_MISMATCH, proc.stderr
    assert f"stamp mismatch: {factor}:" in one_line_error(proc)
    assert not any(target.iterdir())  # nothing handed to the serving container


def test_the_same_sm_count_on_the_node_passes(
    warmed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    store, _ = warmed
    materialize(store, tmp_path / "serve", KERNELCACHE_SM_COUNT=str(SM_COUNT))


def test_the_sm_count_changes_the_kernels_and_the_key(tmp_path: Path) -> None:
    """Kernels are sized to the SM count: another count, other kernels, another stamp."""
    script = f"""
import json, os
from kernelcache.spec import B12xWorkload
from kernelcache.toolchains import b12x
workload = B12xWorkload.model_validate({WORKLOAD!r})
names = {{}}
for sm in (188, 110):
    with b12x.answered_for(b12x.Target("{ARCH}", sm, sm)):
        names[sm] = sorted(b12x.record(workload, b12x.Target("{ARCH}", sm, sm)))
print(json.dumps(names))
"""
    env = subprocess_env(
        CUTE_DSL_ARCH=ARCH,
        FLASHINFER_CUDA_ARCH_LIST="12.0f",
        FLASHINFER_WORKSPACE_BASE=str(tmp_path),
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=scaled(300)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = json.loads(proc.stdout.splitlines()[-1])
    assert names["188"] != names["110"]
    assert len(names["188"]) == len(names["110"]) == 3

    at_188 = stamps.collect(arch=ARCH, distributions=[], sm_counts=[188])
    at_110 = stamps.collect(arch=ARCH, distributions=[], sm_counts=[110])
    assert at_188.digest != at_110.digest
    assert [d.name for d in stamps.explain(at_188, at_110)] == ["gpu/sm_count"]


def test_one_generation_serves_every_sm_count_of_the_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two GPU classes of one arch (an RTX 5090 and an RTX PRO 6000): both counts are kept."""
    recorded = stamps.collect(arch=ARCH, distributions=[], sm_counts=[188, 170, 188])
    assert recorded.factors["gpu/sm_count"] == "170,188"
    for count, same in (("170", True), ("188", True), ("132", False)):
        monkeypatch.setenv("KERNELCACHE_SM_COUNT", count)
        here = stamps.environment_stamp(recorded)
        assert (here.digest == recorded.digest) is same, count


@pytest.mark.parametrize(
    ("gpu", "problem"),
    [
        ({"name": "rtx-pro-6000", "arch": ARCH}, "gpuClasses rtx-pro-6000: smCount is required"),
        ({"name": "h200", "arch": "sm_90a", "smCount": 132}, "sm_120a or sm_121a, not sm_90a"),
    ],
    ids=["no-sm-count", "not-blackwell-consumer"],
)
def test_a_warm_that_cannot_be_right_fails_with_one_line(
    tmp_path: Path, gpu: dict[str, Any], problem: str
) -> None:
    spec = b12x_spec(tmp_path / "kc.yaml", gpu=gpu)
    proc = run_kernelcache(
        "warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", gpu["arch"]
    )
    assert proc.returncode == ExitCode.WARM_FAILED
    assert problem in one_line_error(proc)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"topK": 9}, "workload.topK: 9 is more than the 8 experts"),
        ({"hiddenSize": 200}, "workload.hiddenSize: Input should be a multiple of 128"),
        ({"intermediateSize": 250, "tensorParallel": 4}, "workload.intermediateSize: 250 does"),
        ({"batchSizes": [1, 128]}, "workload.batchSizes: 128 is more than maxNumTokens (64)"),
        ({"quantization": "fp8"}, "workload.quantization: Input should be"),
        ({"experts": None}, "workload.experts: Input should be a valid integer"),
    ],
)
def test_a_bad_moe_config_is_named_before_anything_runs(
    tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    spec = b12x_spec(tmp_path / "kc.yaml", **change)
    proc = run_kernelcache("warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", ARCH)
    assert proc.returncode == ExitCode.USAGE
    assert f"spec.warmers[0].{field}" in one_line_error(proc)


def test_intermediate_size_is_sliced_by_tensor_parallelism() -> None:
    workload = B12xWorkload.model_validate(
        {**WORKLOAD, "intermediateSize": 1024, "tensorParallel": 4}
    )
    assert workload.intermediate_per_slice == 256


def test_a_compile_worker_that_dies_fails_the_warm_instead_of_hanging(tmp_path: Path) -> None:
    """A worker killed mid-compile (the kernel OOM killer, say) ends the warm with one line."""
    script = """
import os, signal
from kernelcache.errors import WarmError
from kernelcache.toolchains import b12x
target = b12x.Target("sm_120a", 188, 188)
kernels = [
    b12x.Recorded("fine", lambda: None, True, target),
    b12x.Recorded("killed", lambda: os.kill(os.getpid(), signal.SIGKILL), True, target),
]
try:
    b12x.compile_all(kernels, 2, __import__("pathlib").Path(os.environ["CUTE_DIR"]))
except WarmError as exc:
    print(exc.message)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=subprocess_env(CUTE_DIR=str(tmp_path), CUTE_DSL_ARCH=ARCH),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "b12x warmer:" in proc.stdout and "a compile worker died" in proc.stdout
