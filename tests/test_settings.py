"""Toolchain settings that change compiled code are factors, named by the toolchains themselves.

The end-to-end case is the real CLI with real CuTe-DSL compiles: a build under
``CUTE_DSL_LINEINFO=1`` after a plain one. The lists are checked against what each
toolchain says when it runs (the DSL's settings manager, Triton's C++ core), so a list read
wrongly from the sources fails here.
"""

from __future__ import annotations

import subprocess

import pytest

from kernelcache import stamp as stamps
from kernelcache.errors import ExitCode
from kernelcache.settings import SETTING_PREFIX, compile_settings
from kernelcache.store import Store
from tests.conftest import (
    dsl_declared_settings,
    needs_cute,
    one_line_error,
    subprocess_env,
    write_spec,
)
from tests.conftest import run_kernelcache as kernelcache


def settings_of(**environ: str) -> set[str]:
    return {name.removeprefix(SETTING_PREFIX) for name in compile_settings(environ)}


@needs_cute
def test_a_dsl_setting_that_changes_the_code_is_a_new_generation(tmp_path):
    spec, store, key = write_spec(tmp_path), tmp_path / "store", "default/demo/sm_90a"

    def build(**env: str) -> subprocess.CompletedProcess[str]:
        proc = kernelcache(
            "build", "-f", str(spec), "--store", str(store), "--arch", "sm_90a", **env
        )
        assert proc.returncode == 0, proc.stderr
        return proc

    build()
    plain = Store(store).current_manifest(key)
    assert plain is not None
    lined = build(CUTE_DSL_LINEINFO="1")
    assert "published" in lined.stdout, lined.stdout
    with_lineinfo = Store(store).current_manifest(key)
    assert with_lineinfo is not None and with_lineinfo.generation != plain.generation
    assert with_lineinfo.stamp["factors"]["setting/CUTE_DSL_LINEINFO"] == "1"

    explained = kernelcache(
        "explain",
        str(Store(store).key_dir(key) / plain.generation),
        str(Store(store).key_dir(key) / with_lineinfo.generation),
    )
    assert explained.returncode == ExitCode.STAMP_MISMATCH
    assert [line.partition(":")[0] for line in explained.stdout.splitlines()] == [
        "setting/CUTE_DSL_LINEINFO"
    ]
    checked = kernelcache(
        "verify", "--store", str(store), "--key", key, "--check-env",
        PYTHONPATH=f"{tmp_path}:{subprocess_env()['PYTHONPATH']}",
    )  # fmt: skip
    assert checked.returncode == ExitCode.STAMP_MISMATCH
    assert "setting/CUTE_DSL_LINEINFO" in one_line_error(checked)


@needs_cute
def test_the_cute_dsl_list_is_what_the_dsl_keys_its_own_cache_on():
    """Every ``CUTE_DSL_*`` variable the DSL's settings manager marks ``affects_compile``, as
    the DSL itself reports it when imported, and none that it does not mark."""
    declared = dsl_declared_settings()
    found = settings_of(**dict.fromkeys(declared, "1"))
    assert found == {n for n, marked in declared.items() if marked} - {"CUTE_DSL_ARCH"}
    assert {"CUTE_DSL_LINEINFO", "CUTE_DSL_DEBUG", "CUTE_DSL_COMPILER_OPT"} <= found
    assert "CUTE_DSL_ARCH" not in found  # the arch factor
    assert not found & {"CUTE_DSL_DUMP_DIR", "CUTE_DSL_NO_CACHE", "CUTE_DSL_LOG_LEVEL"}


def test_triton_settings_cover_what_its_core_keys_its_cache_on():
    """Each variable Triton's C++ core lists and ``triton/knobs.py`` declares is found without
    importing Triton; the core-only ones when Triton is asked, as a build does."""
    triton = pytest.importorskip("triton._C.libtriton")
    probe = dict.fromkeys(
        ["TRITON_DISABLE_LINE_INFO", "TRITON_DEFAULT_FP_FUSION", "TRITON_F32_DEFAULT",
         "TRITON_OVERRIDE_ARCH", "DISABLE_PTXAS_OPT", "TRITON_ENABLE_ASAN", "USE_IR_LOC",
         "NVPTX_ENABLE_DUMP", "DISABLE_MMA_V3", "MLIR_ENABLE_DUMP", "TRITON_CACHE_DIR",
         "TRITON_CACHE_AUTOTUNING", "TRITON_PRINT_AUTOTUNING", "TRITON_HOME", "PTXAS_OPTIONS"],
        "1",
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        for name, value in probe.items():
            patch.setenv(name, value)
        core = set(triton.get_cache_invalidating_env_vars())
        statically = settings_of(**probe)
        asked = {n.removeprefix(SETTING_PREFIX) for n in compile_settings(ask_triton=True)}
    knobs_declared = {n for n in probe if not n.startswith(("DISABLE_MMA", "MLIR_"))}
    assert core & knobs_declared <= statically
    assert core <= asked
    assert "PTXAS_OPTIONS" in statically  # a compile option in knobs, not in the core's list
    assert not statically & {"TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "TRITON_HOME"}
    assert "TRITON_PRINT_AUTOTUNING" not in statically


def test_inductor_settings_are_its_cache_keyed_config_entries():
    found = settings_of(
        TORCHINDUCTOR_USE_FAST_MATH="1",  # use_fast_math
        TORCHINDUCTOR_PROLOGUE_FUSION="1",  # read through a helper function
        TORCHINDUCTOR_MAX_AUTOTUNE="1",  # Config(env_name_force=...)
        TORCHINDUCTOR_COMPILE_THREADS="1",  # compile_threads: outside the cache key
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",  # fx_graph_cache: outside the cache key
        TORCHINDUCTOR_CACHE_DIR="/var/cache/inductor",
    )
    assert found == {
        "TORCHINDUCTOR_USE_FAST_MATH",
        "TORCHINDUCTOR_PROLOGUE_FUSION",
        "TORCHINDUCTOR_MAX_AUTOTUNE",
    }


def test_flashinfer_and_b12x_switches_are_settings_but_not_logs_caches_or_locations():
    found = settings_of(
        B12X_PAGED_KV_TMA="1",
        B12X_FUSED_INDEXER="0",
        FLASHINFER_JIT_LINEINFO="1",
        FLASHINFER_NVFP4_4OVER6="1",
        B12X_TIMING="1",
        B12X_LOG_CUTE_COMPILES="1",
        B12X_COMPILE_DISK_CACHE="0",
        B12X_COMPILE_CACHE_DIR="/cache",
        FLASHINFER_LOGLEVEL="3",
        FLASHINFER_WORKSPACE_BASE="/work",
        FLASHINFER_CUDA_ARCH_LIST="12.0f",  # kernelcache sets it from the arch factor
        FLASHINFER_DISABLE_JIT="1",  # kernelcache's strict serving
        FLASHINFER_JIT_BUILD_LOG="/tmp/log",
    )
    assert found == {
        "B12X_PAGED_KV_TMA",
        "B12X_FUSED_INDEXER",
        "FLASHINFER_JIT_LINEINFO",
        "FLASHINFER_NVFP4_4OVER6",
    }


def test_a_location_is_never_a_setting():
    assert settings_of(TRITON_LIBDEVICE_PATH="libdevice.10.bc", PTXAS_OPTIONS="/opt/x") == set()


def test_a_recorded_setting_is_measured_again_even_unlisted(monkeypatch):
    """A build that asked Triton recorded a core-only variable; the check measures it."""
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    recorded = stamps.collect(arch="sm_90a", distributions=[], settings=["DISABLE_MMA_V3"])
    assert recorded.factors["setting/DISABLE_MMA_V3"] == "1"
    monkeypatch.delenv("DISABLE_MMA_V3")
    (diff,) = stamps.explain(recorded, stamps.environment_stamp(recorded))
    assert (diff.name, diff.left, diff.right) == ("setting/DISABLE_MMA_V3", "1", None)
