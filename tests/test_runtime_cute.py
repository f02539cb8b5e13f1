"""The CuTe-DSL disk layer with real compiles and exports, on CPU for any arch."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import DEMO_WORKLOAD as WORKLOAD
from tests.conftest import EXAMPLES, needs_cute, scaled, serve_python, subprocess_env

pytestmark = needs_cute

KERNELS = 6  # per dtype: one add and two tiled scales


def serve(cache: Path, arch: str = "sm_90a", script: Path = EXAMPLES / "demo_serve.py", **env):
    # the script's folder comes first on sys.path, so it imports the demo_kernels beside it
    """Run the example as a fresh serving process; returns (hits, compiled, stdout)."""
    proc = serve_python(
        script,
        "--workload",
        json.dumps(WORKLOAD),
        timeout=scaled(300),
        **{"KERNELCACHE_CUTE_DSL_DIR": str(cache), "CUTE_DSL_ARCH": arch, **env},
    )
    match = re.search(r"(\d+) loaded from cache, (\d+) compiled", proc.stdout)
    assert match, proc.stdout + proc.stderr
    return int(match[1]), int(match[2]), proc


def test_second_process_loads_every_kernel_with_zero_compiles(tmp_path):
    hits, compiled, first = serve(tmp_path)
    assert (hits, compiled) == (0, KERNELS)
    assert first.returncode == 1  # the example reports compiles as a failure of "serving warm"
    assert len(list(tmp_path.glob("*.o"))) == KERNELS
    assert len(list(tmp_path.glob("*.json"))) == KERNELS
    assert not list(tmp_path.glob(".tmp-*"))

    hits, compiled, second = serve(tmp_path, KERNELCACHE_STRICT="1")
    assert (hits, compiled) == (KERNELS, 0)
    assert second.returncode == 0


def test_a_kernel_is_keyed_by_its_ir_not_by_its_source_text(tmp_path):
    """A comment is no new kernel; a constant the kernels trace through is a new one each."""
    module_dir = tmp_path / "src"
    module_dir.mkdir()
    script = module_dir / "demo_serve.py"
    kernels = module_dir / "demo_kernels.py"
    shutil.copy(EXAMPLES / "demo_serve.py", script)
    shutil.copy(EXAMPLES / "demo_kernels.py", kernels)
    cache = tmp_path / "cache"
    assert serve(cache, script=script)[:2] == (0, KERNELS)
    kernels.write_text("# a comment moves every line\n" + kernels.read_text())
    assert serve(cache, script=script, KERNELCACHE_STRICT="1")[:2] == (KERNELS, 0)
    kernels.write_text(kernels.read_text().replace("THREADS = 128", "THREADS = 64"))
    assert serve(cache, script=script)[:2] == (0, KERNELS)
    assert len(list(cache.glob("*.o"))) == 2 * KERNELS


def test_changed_dsl_stack_misses(tmp_path):
    """Installing another DSL library variant (as cu12 → cu13 would) changes every key."""
    cache = tmp_path / "cache"
    assert serve(cache)[:2] == (0, KERNELS)
    site = tmp_path / "site"
    info = site / "nvidia_cutlass_dsl_libs_cu13-4.8.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nvidia-cutlass-dsl-libs-cu13\nVersion: 4.8.1\n"
    )
    (info / "RECORD").write_text("nvidia_cutlass_dsl/cu13/lib/x.so,sha256=abc,3\n")
    hits, compiled, _ = serve(cache, PYTHONPATH=f"{site}:{subprocess_env()['PYTHONPATH']}")
    assert (hits, compiled) == (0, KERNELS)


def test_other_arch_lives_beside_the_first(tmp_path):
    assert serve(tmp_path, arch="sm_90a")[:2] == (0, KERNELS)
    assert serve(tmp_path, arch="sm_120a")[:2] == (0, KERNELS)
    assert serve(tmp_path, arch="sm_90a")[:2] == (KERNELS, 0)
    assert serve(tmp_path, arch="sm_120a")[:2] == (KERNELS, 0)
    arches = {json.loads(p.read_text())["factors"]["arch"] for p in tmp_path.glob("*.json")}
    assert arches == {"sm_90a", "sm_120a"}


def test_concurrent_processes_share_one_directory(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLES / "demo_serve.py"), "--workload", json.dumps(WORKLOAD)],
            env=subprocess_env(KERNELCACHE_CUTE_DSL_DIR=str(tmp_path)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(3)
    ]
    for proc in procs:
        proc.communicate(timeout=scaled(300))
        assert proc.returncode in (0, 1)
    assert len(list(tmp_path.glob("*.o"))) == KERNELS
    assert not list(tmp_path.glob(".tmp-*"))
    assert serve(tmp_path)[:2] == (KERNELS, 0)


@pytest.fixture
def cute_cache():
    from kernelcache.runtime import cute as cute_cache

    return cute_cache


def _first_specialization():
    import demo_kernels

    return next(iter(demo_kernels.specializations(WORKLOAD)))


def test_threads_compile_each_key_once(tmp_path, cute_cache):
    _, fn, args = _first_specialization()
    cache = cute_cache.CuteDiskCache(tmp_path)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.compile(fn, *args))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert cache.stats.misses == 1
    assert len(list(tmp_path.glob("*.o"))) == 1


def test_strict_mode_refuses_a_cold_compile_naming_the_kernel(tmp_path, cute_cache):
    _, fn, args = _first_specialization()
    cache = cute_cache.CuteDiskCache(tmp_path, strict=True)
    expected = r"cute-dsl: demo_kernels:add in .*: no kernel compiled from this IR"
    with pytest.raises(cute_cache.ColdCompileError, match=expected):
        cache.compile(fn, *args)


def test_half_written_metadata_is_a_miss_not_a_crash(tmp_path, cute_cache):
    _, fn, args = _first_specialization()
    cute_cache.CuteDiskCache(tmp_path).compile(fn, *args)
    (meta,) = tmp_path.glob("*.json")
    meta.write_text(meta.read_text()[:20])
    cache = cute_cache.CuteDiskCache(tmp_path)
    cache.compile(fn, *args)
    assert (cache.stats.hits, cache.stats.misses) == (0, 1)
    assert json.loads(meta.read_text())["function"] == "demo_kernels:add"


def test_tampered_factors_are_a_miss(tmp_path, cute_cache):
    """A hit needs the saved factors to equal the computed ones, not just the file name."""
    _, fn, args = _first_specialization()
    cute_cache.CuteDiskCache(tmp_path).compile(fn, *args)
    (meta,) = tmp_path.glob("*.json")
    data = json.loads(meta.read_text())
    data["factors"]["arch"] = "sm_120a"
    meta.write_text(json.dumps(data))
    cache = cute_cache.CuteDiskCache(tmp_path)
    cache.compile(fn, *args)
    assert cache.stats.misses == 1


def test_unwritable_cache_dir_still_serves_misses(tmp_path, cute_cache):
    """Persisting is best effort: a cache dir that cannot be written costs a compile, no error."""
    _, fn, args = _first_specialization()
    (tmp_path / "a-file").write_text("")
    cache = cute_cache.CuteDiskCache(tmp_path / "a-file" / "cache")  # mkdir fails: ENOTDIR
    assert cache.compile(fn, *args) is not None
    assert cache.stats.misses == 1


def test_install_routes_cute_compile_through_the_cache(tmp_path, cute_cache):
    import cutlass.cute as cute

    _, fn, args = _first_specialization()
    original = cute.compile
    cute_cache.install()
    try:
        with cute_cache.cache_dir(tmp_path) as cache:
            cute.compile(fn, *args)
            cute.compile(fn, *args)
            assert (cache.stats.misses, len(list(tmp_path.glob("*.o")))) == (1, 1)
    finally:
        cute_cache.uninstall()
    assert cute.compile is original


def test_a_hopper_tma_wgmma_gemm_is_exported_and_loaded_with_zero_compiles(tmp_path):
    """The benchmark's kernel (examples/hopper_gemm.py: TMA descriptors built on the host, an
    mbarrier pipeline, WGMMA; sm_90a only) compiles on the CPU, is exported per shape, and a
    second strict process gets every shape from the cache."""
    workload = {"shapes": [[256, 128, 64], [128, 256, 128]]}
    script = (
        "import json, sys; from kernelcache.runtime import cute as layer\n"
        "layer.install(); import hopper_gemm\n"
        "names = hopper_gemm.warm(json.loads(sys.argv[1]))\n"
        "stats = layer.default_cache().stats\n"
        "print(json.dumps([names, stats.hits, stats.misses]))\n"
    )

    def run(**env: str) -> tuple[list[str], int, int]:
        proc = subprocess.run(
            [sys.executable, "-c", script, json.dumps(workload)],
            env=subprocess_env(
                KERNELCACHE_CUTE_DSL_DIR=str(tmp_path), CUTE_DSL_ARCH="sm_90a", **env
            ),
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        assert proc.returncode == 0, proc.stderr
        names, hits, misses = json.loads(proc.stdout.strip().splitlines()[-1])
        return names, hits, misses

    names, hits, misses = run()
    assert names == ["hopper_gemm[256x128x64]", "hopper_gemm[128x256x128]"]
    assert (hits, misses) == (0, 2) and len(list(tmp_path.glob("*.o"))) == 2
    assert run(KERNELCACHE_STRICT="1")[1:] == (2, 0)


def test_strict_refusal_names_the_first_ir_difference_and_what_moved(tmp_path, cute_cache):
    """Against the nearest recorded kernel of the same function: the IR line that differs, and
    which input its compile read has moved since (the record explains; it is not the key)."""
    import demo_kernels

    _, fn, args = _first_specialization()
    cute_cache.CuteDiskCache(tmp_path).compile(fn, *args)
    (meta,) = tmp_path.glob("*.json")
    assert (tmp_path / f"{meta.stem}.mlir").read_text().startswith("!memref")
    demo_kernels.THREADS = 64  # what the next trace reads: a global, as another module sets it
    try:
        with pytest.raises(cute_cache.ColdCompileError) as refused:
            cute_cache.CuteDiskCache(tmp_path, strict=True).compile(fn, *args)
    finally:
        demo_kernels.THREADS = 128
    message = str(refused.value)
    assert f"nearest recorded kernel {meta.stem}: IR line" in message, message
    assert "exact_block_dim = array<i64: 128" in message and "array<i64: 64" in message
    assert "\n" not in message
