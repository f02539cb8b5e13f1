"""The toolchain registry: one module per toolchain, found rather than listed, light at import,
and each toolchain's serving side used by the runtime as it declares it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

from kernelcache import stamp as stamps
from kernelcache import toolchains
from kernelcache.runtime import metrics
from kernelcache.spec import Warmer as WarmerSpec
from kernelcache.store import Store
from kernelcache.toolchains.base import Toolchain
from kernelcache.toolchains.flashinfer import BuildLogTail
from tests.conftest import scaled, subprocess_env

HEAVY = ("torch", "cutlass", "triton", "flashinfer", "tvm_ffi", "numpy", "vllm", "pydantic")


def test_every_warmer_type_of_the_spec_is_provided_by_exactly_one_toolchain():
    provided = [w.type for t in toolchains.toolchains() for w in t.warmers]
    declared = typing.get_args(WarmerSpec.model_fields["type"].annotation)
    assert sorted(provided) == sorted(declared)
    for kind in declared:
        assert toolchains.warmer_class(kind).type == kind


def test_the_cache_variables_are_the_union_of_the_toolchains_declarations():
    assert toolchains.cache_env() == {
        "KERNELCACHE_CUTE_DSL_DIR": "cute-dsl",
        "CUTE_DSL_CACHE_DIR": "cute-dsl-jit",
        "TRITON_CACHE_DIR": "triton",
        "TORCHINDUCTOR_CACHE_DIR": "inductor",
        "FLASHINFER_WORKSPACE_BASE": "flashinfer",
        "VLLM_CACHE_ROOT": "vllm",
        "VLLM_TUNED_CONFIG_FOLDER": "vllm-moe",
        "SGLANG_CACHE_DIR": "sglang",
    }
    assert toolchains.serving_settings() == {
        "TRITON_CACHE_AUTOTUNING": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "TRITON_CACHE_MANAGER": "kernelcache.toolchains.triton:GenerationCacheManager",
        "VLLM_ENABLE_STARTUP_PLAN": "1",
    }


def test_tuning_scoped_files_are_what_the_toolchains_declare():
    tuned = [
        "triton/ABC/matmul.autotune.json",
        "inductor/xy/kernel.best_config",
        "flashinfer/tactics/nvidia-h200.json",
        "vllm/startup_plan/startup_plan_f706e831b001afa9.json",
        "vllm/flashinfer_autotune_cache/0.6.14/90a/e846db17/autotune_configs.json",
        "vllm-moe/E=64,N=1024,device_name=NVIDIA_H200.json",
    ]
    compiled = ["triton/ABC/matmul.cubin", "flashinfer/aot/m/m.so", "cute-dsl/k.o"]
    assert [p for p in tuned + compiled if toolchains.is_tuning_file(p)] == tuned


def test_a_new_toolchain_is_one_module(tmp_path, monkeypatch):
    """Found by the registry, its cache variable pointed, its warmer type resolvable."""
    (tmp_path / "zz_example.py").write_text(
        textwrap.dedent(
            """
            from kernelcache.toolchains.base import Toolchain, Warmer

            class ExampleWarmer(Warmer):
                type = "zz-example"
                fills = ("zz-example",)

                def produce(self, files_dir, arch, report):
                    (files_dir / "zz-example" / "k.bin").write_bytes(b"k")

            TOOLCHAIN = Toolchain(
                name="zz-example", cache_env={"ZZ_EXAMPLE_DIR": "zz-example"},
                warmers=(ExampleWarmer,),
            )
            """
        )
    )
    monkeypatch.setattr(toolchains, "__path__", [*toolchains.__path__, str(tmp_path)])
    toolchains.toolchains.cache_clear()
    try:
        assert "zz-example" in [t.name for t in toolchains.toolchains()]
        assert toolchains.cache_env()["ZZ_EXAMPLE_DIR"] == "zz-example"
        warmer = toolchains.warmer_class("zz-example")(WarmerSpec(type="command", command=["x"]))
        report = warmer.run(tmp_path / "files", "sm_90a")
        assert (report.files, report.dirs) == (1, {"zz-example": {"files": 1, "bytes": 1}})
    finally:
        toolchains.toolchains.cache_clear()
        sys.modules.pop("kernelcache.toolchains.zz_example", None)


def test_the_serving_side_imports_no_compiler_and_nothing_of_the_build_side():
    """The .pth hook runs install() in every process: no torch, Triton, DSL or FlashInfer, and
    none of the build, CLI or operator modules."""
    script = (
        "import json, sys; from kernelcache import runtime, toolchains\n"
        "runtime.install()\n"
        "[t.name for t in toolchains.toolchains()]\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    env = subprocess_env()
    env.pop("KERNELCACHE_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=scaled(120)
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert "kernelcache.toolchains.vllm" in loaded  # every toolchain was imported
    for module in ("kernelcache.build", "kernelcache.cli", "kernelcache.controller"):
        assert module not in loaded
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]


def test_install_sets_the_flashinfer_arch_list_the_warm_recorded(tmp_path):
    """FlashInfer names its workspace after the arch list; left to itself it picks "12.0f"
    or "12.0a" by CUDA version, so the list the generation was warmed with is set."""

    def generation(root: Path, reports: list[dict]) -> Path:
        store = Store(root)
        stamp = stamps.collect(arch="sm_120a", distributions=[])
        with store.writer("default/demo/sm_120a") as writer:
            staging = writer.staging()
            (staging / "flashinfer" / "tactics").mkdir(parents=True)
            (staging / "flashinfer" / "tactics" / "x.json").write_text("{}")
            writer.publish(staging, stamp.to_dict(), {"warmers": reports})
        current = store.current("default/demo/sm_120a")
        assert current is not None
        return current

    script = (
        "import json; from kernelcache import runtime; print(json.dumps(runtime.install().env))"
    )

    def installed(directory: Path) -> dict:
        env = subprocess_env(KERNELCACHE_DIR=str(directory), KERNELCACHE_ARCH="sm_120a")
        env.pop("FLASHINFER_CUDA_ARCH_LIST", None)
        proc = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=scaled(120),
        )
        assert proc.returncode == 0, proc.stderr
        return dict(json.loads(proc.stdout))

    b12x = generation(tmp_path / "a", [{"warmer": "b12x", "arch_list": "12.0f"}])
    assert installed(b12x)["FLASHINFER_CUDA_ARCH_LIST"] == "12.0f"
    assert "FLASHINFER_DISABLE_JIT" not in installed(b12x)  # permissive, and no AOT modules
    mixed = [
        {"warmer": "flashinfer", "arch_list": "12.0a"},
        {"warmer": "b12x", "arch_list": "12.0f"},
    ]
    assert "FLASHINFER_CUDA_ARCH_LIST" not in installed(generation(tmp_path / "b", mixed))


def test_a_short_cute_dsl_line_in_the_build_log_is_a_compile_in_serving_as_in_the_warm(tmp_path):
    """One rule for both readers: a CuTe-DSL kernel is logged only after it compiled."""
    log = tmp_path / "builds.jsonl"
    log.write_text("")
    tail = BuildLogTail(log, min_seconds=0.5)
    record = {"toolchain": "cute_dsl", "name": "toolchains_test_moe/k0", "seconds": 0.3,
              "pid": os.getpid(), "time": 1.0}  # fmt: skip
    log.write_text(json.dumps(record) + "\n")
    before = metrics.cold_compiles().get(("flashinfer", "toolchains_test_moe/k0"), 0)
    tail.poll()
    assert metrics.cold_compiles().get(("flashinfer", "toolchains_test_moe/k0"), 0) == before + 1


def test_a_tree_read_in_place_is_its_toolchains_alone_and_placed_by_none() -> None:
    """Image mode leaves a toolchain's cache trees on the read-only mount only when it
    declares that its serving side only reads them: each tree is one toolchain's, and one
    read in place is never moved by ``place`` (which works on the copy)."""
    owners: dict[str, list[str]] = {}
    for toolchain in toolchains.toolchains():
        for sub in toolchain.cache_env.values():
            owners.setdefault(sub, []).append(toolchain.name)
    assert {sub: names for sub, names in owners.items() if len(names) > 1} == {}
    readers = [t for t in toolchains.toolchains() if t.reads_in_place]
    assert all(type(t).place is Toolchain.place for t in readers)
    assert toolchains.in_place_dirs() == {sub for t in readers for sub in t.cache_env.values()}
    # Checked against what each library does on a read-only, noexec tree (docs/distribution.md):
    assert [t.name for t in readers] == ["cute-dsl"]


def test_a_warm_failure_caused_by_a_full_disk_is_named_so(tmp_path: Path) -> None:
    """ENOSPC (or a quota) anywhere in a warmer's failure, or in its output: a full volume."""
    import errno

    from kernelcache.errors import WarmError
    from kernelcache.toolchains.base import volume_full

    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "k.bin"))
        except OSError as exc:
            raise WarmError("cute-dsl entry point m:f failed for sm_90a: OSError") from exc
    except WarmError as failed:
        said = volume_full(failed, tmp_path)
    assert said == f"no space left writing {tmp_path / 'k.bin'} (ENOSPC: No space left on device)"
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert "EDQUOT" in (volume_full(quota, tmp_path) or "")
    assert volume_full(WarmError("sh exited with 1"), tmp_path) is None  # a disk with room
    line = "cp: error writing 'x': No space left on device"
    assert line in (volume_full(WarmError("sh exited with 1"), tmp_path, line) or "")
