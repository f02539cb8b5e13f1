"""The triton warmer, with real Triton objects.

Without a GPU: the autotuners that ran are watched (kernels run in Triton's interpreter,
``TRITON_INTERPRET=1``, on CPU tensors), configs with a ``pre_hook`` are reported as not
cacheable, ``expect`` fails on them and on kernels that left no autotune result, and a build
for an arch that is not the visible GPU's (here: no GPU at all) is refused in one line.

On a GPU (marked ``gpu``): a full warm of ``examples/triton_kernels.py``, then a fresh serving
process that compiles nothing and benchmarks nothing, while one with an empty cache does both;
and a kernel whose configs have a pre_hook, declared in ``expect``, fails the warm.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kernelcache.errors import ExitCode, WarmError
from kernelcache.store import Store
from tests.conftest import EXAMPLES, one_line_error, serve_python, write_warmer_spec
from tests.conftest import run_kernelcache as kernelcache

HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


def visible_arch() -> str | None:
    """The arch of the visible GPU, as torch sees it, or None without one."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


needs_gpu = pytest.mark.skipif(
    visible_arch() is None, reason="needs a CUDA GPU: Triton compiles only for the GPU it runs on"
)


def write_spec(tmp_path: Path, warmer: dict[str, Any], arch: str) -> Path:
    return write_warmer_spec(tmp_path, {"type": "triton", **warmer}, arch, name="tt")


# Without a GPU.


def fake_bench(kernel_call: Any, quantiles: Any) -> list[float]:
    """The interpreter has no GPU to time on: run the config once, call every config equal."""
    kernel_call()
    return [1.0, 1.0, 1.0]


@pytest.fixture
def interpreted(monkeypatch):
    """Two autotuned kernels made in interpreter mode, one of them with pre_hook configs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when a kernel is decorated
    import triton
    import triton.language as tl

    def zero_output(nargs: dict[str, Any]) -> None:
        nargs["out_ptr"].zero_()

    def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    def add_one_hooked(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    plain = triton.autotune(
        [triton.Config({"BLOCK": b}) for b in (16, 32)], key=["n"], do_bench=fake_bench
    )(triton.jit(add_one))
    hooked = triton.autotune(
        [triton.Config({"BLOCK": b}, pre_hook=zero_output) for b in (16, 32)],
        key=["n"],
        do_bench=fake_bench,
    )(triton.jit(add_one_hooked))
    return plain, hooked


def launch(kernel: Any) -> Any:
    import torch

    x, out = torch.arange(100.0), torch.empty(100)
    kernel[lambda meta: ((100 + meta["BLOCK"] - 1) // meta["BLOCK"],)](x, out, 100)
    return torch.equal(out, x + 1)


def test_the_watch_reports_autotuners_whose_configs_have_a_pre_hook(interpreted):
    from triton.runtime.autotuner import Autotuner

    from kernelcache.toolchains.triton import TritonWatch

    plain, hooked = interpreted
    original_run = Autotuner.run
    with TritonWatch().installed() as watch:
        assert launch(plain) and launch(hooked)
    assert Autotuner.run is original_run
    assert sorted(watch.autotuners) == ["add_one", "add_one_hooked"]
    assert watch.not_cacheable == ["add_one_hooked"]
    assert not plain.cache_results  # the interpreter never saves tuning


def test_a_single_config_with_a_pre_hook_has_nothing_to_cache(interpreted):
    import triton

    from kernelcache.toolchains.triton import has_pre_hook

    plain, hooked = interpreted
    single = triton.autotune([hooked.configs[0]], key=["n"])(plain.fn)
    assert has_pre_hook(hooked) and not has_pre_hook(plain) and not has_pre_hook(single)


def test_expect_fails_on_a_pre_hook_and_on_a_missing_autotune_result():
    from kernelcache.toolchains.triton import TritonReport, check_expected

    report = TritonReport(warmer="triton", autotuned=["matmul"], not_cacheable=["hooked"])
    check_expected(["matmul"], report)
    with pytest.raises(WarmError, match=r"expected kernel hooked cannot be cached: .* pre_hook"):
        check_expected(["matmul", "hooked"], report)
    with pytest.raises(WarmError, match="expected kernel other left no autotune result"):
        check_expected(["other"], report)
    long_name = "k" * 200  # Triton cuts names to 150 characters in its file names
    check_expected([long_name], TritonReport(warmer="triton", autotuned=[long_name[:150]]))


def test_the_arch_must_be_the_visible_gpus():
    from triton.backends.compiler import GPUTarget

    from kernelcache.toolchains.triton import check_arch

    hopper = GPUTarget("cuda", 90, 32)
    check_arch("sm_90a", hopper)
    check_arch("sm_90", hopper)
    with pytest.raises(
        WarmError, match=r"visible GPU is cuda 90, not sm_100a.*cannot cross-compile"
    ):
        check_arch("sm_100a", hopper)
    with pytest.raises(WarmError, match="cannot cross-compile"):
        check_arch("sm_90a", GPUTarget("hip", "gfx942", 64))


def test_a_moved_cache_is_found_only_by_the_relocatable_manager(tmp_path, monkeypatch):
    """Triton's group file names a kernel's files by where they were written."""
    from triton.runtime.cache import FileCacheManager

    from kernelcache.toolchains.triton import TRITON_CACHE_MANAGER as CACHE_MANAGER

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "staging"))
    writer = FileCacheManager("key")
    group = {name: writer.put(b"bits", name) for name in ("k.cubin", "k.json")}
    writer.put_group("k.json", group)
    (tmp_path / "staging").rename(tmp_path / "generation")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "generation"))
    assert FileCacheManager("key").get_group("k.json") == {}  # stock Triton: a miss

    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_MANAGER", CACHE_MANAGER)
    found = knobs.cache.manager_class("key").get_group("k.json")
    assert found == {n: str(tmp_path / "generation" / "key" / n) for n in group}
    assert knobs.cache.manager_class("key").get_group("other.json") is None


def test_a_warm_for_another_arch_than_the_visible_gpu_is_one_line(tmp_path):
    arch = "sm_100a" if visible_arch() != "sm_100a" else "sm_90a"
    spec = write_spec(tmp_path, {"entryPoints": ["triton_kernels:warm"]}, arch)
    proc = kernelcache("warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", arch)
    assert proc.returncode == ExitCode.WARM_FAILED
    assert "cannot cross-compile" in one_line_error(proc)
    assert Store(tmp_path / "s").current(f"default/tt/{arch}") is None


# On a GPU.

WORKLOAD = {"shapes": [[512, 512, 512], [1024, 1024, 1024]], "dtypes": ["float16"]}
CONFIGS = 8  # examples/triton_kernels.py tunes over eight configs

HOOKED_KERNELS = """
import torch
import triton
import triton.language as tl


def zero_output(nargs):
    nargs["out_ptr"].zero_()


@triton.autotune([triton.Config({"BLOCK": b}, pre_hook=zero_output) for b in (128, 256)], key=["n"])
@triton.jit
def add_one_hooked(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def warm(workload):
    x = torch.arange(1000.0, device="cuda")
    out = torch.empty_like(x)
    add_one_hooked[lambda meta: (triton.cdiv(1000, meta["BLOCK"]),)](x, out, 1000)
    assert torch.equal(out, x + 1)
    return ["add_one_hooked"]
"""


def serve(cache_dir: Path) -> tuple[int, str]:
    """examples/triton_kernels.py as a fresh serving process on ``cache_dir``."""
    from kernelcache.toolchains.triton import TRITON_CACHE_MANAGER as CACHE_MANAGER

    proc = serve_python(
        EXAMPLES / "triton_kernels.py",
        "--workload",
        json.dumps(WORKLOAD),
        TRITON_CACHE_DIR=str(cache_dir),
        TRITON_CACHE_AUTOTUNING="1",
        TRITON_CACHE_MANAGER=CACHE_MANAGER,
    )
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, proc.stdout.strip().splitlines()[-1]


@pytest.mark.gpu
@needs_gpu
def test_warm_then_a_fresh_process_compiles_nothing_and_tunes_nothing(tmp_path):
    arch = visible_arch()
    warmer = {
        "entryPoints": ["triton_kernels:warm"],
        "expect": ["matmul_kernel"],
        "workload": WORKLOAD,
    }
    spec, store = write_spec(tmp_path, warmer, arch), tmp_path / "store"
    proc = kernelcache("build", "-f", str(spec), "--store", str(store))
    assert proc.returncode == 0, proc.stderr
    key = f"default/tt/{arch}"
    manifest = Store(store).current_manifest(key)
    (report,) = manifest.report["warmers"]
    assert report["autotuned"] == ["matmul_kernel"] and report["not_cacheable"] == []
    assert report["compiled"] >= CONFIGS
    assert report["kernels"] == [
        f"matmul_kernel[float16,{m}x{n}x{k}]" for m, n, k in WORKLOAD["shapes"]
    ]
    tuned = [f.path for f in manifest.files if f.path.endswith("/matmul_kernel.autotune.json")]
    assert len(tuned) == len(WORKLOAD["shapes"])  # one tuning key per shape

    target = tmp_path / "serve"
    target.mkdir()
    proc = kernelcache("verify", "--store", str(store), "--key", key, "--materialize", str(target))
    assert proc.returncode == 0, proc.stderr
    (generation,) = [p for p in target.iterdir() if p.is_dir()]
    code, line = serve(generation / "files" / "triton")
    assert code == 0 and "0 compiled, 0 configs benchmarked" in line, line

    code, line = serve(tmp_path / "empty")
    assert code == 1 and f"{CONFIGS * len(WORKLOAD['shapes'])} configs benchmarked" in line, line


@pytest.mark.gpu
@needs_gpu
def test_a_kernel_whose_configs_have_a_pre_hook_is_reported_and_fails_when_expected(tmp_path):
    arch = visible_arch()
    (tmp_path / "hooked_kernels.py").write_text(HOOKED_KERNELS)
    warmer = {"entryPoints": ["hooked_kernels:warm"], "expect": ["add_one_hooked"]}
    spec, store = write_spec(tmp_path, warmer, arch), tmp_path / "store"
    proc = kernelcache("warm", "-f", str(spec), "--store", str(store), "--arch", arch)
    assert proc.returncode == ExitCode.WARM_FAILED
    assert "expected kernel add_one_hooked cannot be cached" in one_line_error(proc)

    spec = write_spec(tmp_path, {"entryPoints": ["hooked_kernels:warm"]}, arch)
    proc = kernelcache("warm", "-f", str(spec), "--store", str(store), "--arch", arch)
    assert proc.returncode == 0, proc.stderr
    assert "add_one_hooked" in proc.stderr and "re-tune in every serving process" in proc.stderr
    (report,) = Store(store).current_manifest(f"default/tt/{arch}").report["warmers"]
    assert report["not_cacheable"] == ["add_one_hooked"] and report["autotuned"] == []
    assert report["compiled"] == 2
