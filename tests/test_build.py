"""The local pipeline through the real CLI: build → verify → explain → inspect → gc.

Every run is a real ``kernelcache`` process with real CuTe-DSL compiles (CPU-only, any arch).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from kernelcache.errors import ExitCode
from kernelcache.store import Store, verify
from tests.conftest import (
    EXAMPLES,
    SMALL_WORKLOAD,
    needs_cute,
    one_line_error,
    scaled,
    subprocess_env,
    write_spec,
)
from tests.conftest import run_kernelcache as kernelcache

pytestmark = needs_cute


def test_build_publishes_every_arch_and_verifies(tmp_path):
    spec, store = write_spec(tmp_path), tmp_path / "store"
    proc = kernelcache("build", "-f", str(spec), "--store", str(store))
    assert proc.returncode == 0, proc.stderr
    assert "sm_90a" in proc.stdout and "sm_120a" in proc.stdout and "published" in proc.stdout
    assert sorted(Store(store).keys()) == ["default/demo/sm_120a", "default/demo/sm_90a"]
    for arch in ("sm_90a", "sm_120a"):
        manifest = Store(store).current_manifest(f"default/demo/{arch}")
        assert manifest is not None and manifest.stamp["factors"]["arch"] == arch
        assert {w["compiled"] for w in manifest.report["warmers"]} == {2}
        assert all(f.path.startswith("cute-dsl/") for f in manifest.files)
        ok = kernelcache(
            "verify", "--store", str(store), "--key", f"default/demo/{arch}", "--check-env",
            PYTHONPATH=f"{tmp_path}:{subprocess_env()['PYTHONPATH']}",
        )  # fmt: skip
        assert ok.returncode == 0, ok.stderr
        assert "verified" in ok.stdout


def test_rebuild_with_the_same_stamp_is_up_to_date_and_a_change_is_a_new_generation(tmp_path):
    spec, store = write_spec(tmp_path), tmp_path / "store"
    key = "default/demo/sm_90a"
    assert (
        kernelcache("build", "-f", str(spec), "--store", str(store), "--arch", "sm_90a").returncode
        == 0
    )
    first = Store(store).current_manifest(key)
    again = kernelcache("build", "-f", str(spec), "--store", str(store), "--arch", "sm_90a")
    assert again.returncode == 0 and "up-to-date" in again.stdout
    assert Store(store).current_manifest(key).generation == first.generation

    changed = write_spec(
        tmp_path, **{"warmers.0.workload": {**SMALL_WORKLOAD, "tiles": [[64, 64]]}}
    )
    assert (
        kernelcache(
            "build", "-f", str(changed), "--store", str(store), "--arch", "sm_90a"
        ).returncode
        == 0
    )
    second = Store(store).current_manifest(key)
    assert second.generation != first.generation
    assert [m.generation for m in Store(store).generations(key)] == [
        first.generation,
        second.generation,
    ]

    explained = kernelcache(
        "explain",
        str(Store(store).key_dir(key) / first.generation),
        str(Store(store).key_dir(key) / second.generation),
    )
    assert explained.returncode == ExitCode.STAMP_MISMATCH
    assert explained.stdout.splitlines()[0].startswith("workload:")

    # retention: generations=1 keeps the current one and one besides it after a third build
    third = write_spec(
        tmp_path,
        **{
            "warmers.0.workload": {**SMALL_WORKLOAD, "dtypes": ["float32"]},
            "retention.generations": 1,
        },
    )
    assert (
        kernelcache("build", "-f", str(third), "--store", str(store), "--arch", "sm_90a").returncode
        == 0
    )
    ids = [m.generation for m in Store(store).generations(key)]
    assert len(ids) == 2 and first.generation not in ids and second.generation in ids


def test_verify_names_a_flipped_byte_and_a_missing_generation(tmp_path):
    spec, store = write_spec(tmp_path), tmp_path / "store"
    assert (
        kernelcache("build", "-f", str(spec), "--store", str(store), "--arch", "sm_120a").returncode
        == 0
    )
    gen = Store(store).current("default/demo/sm_120a")
    victim = sorted((gen / "files" / "cute-dsl").glob("*.o"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    proc = kernelcache("verify", "--store", str(store), "-f", str(spec), "--arch", "sm_120a")
    assert proc.returncode == ExitCode.INTEGRITY
    assert victim.name in one_line_error(proc)

    missing = kernelcache("verify", "--store", str(store), "-f", str(spec), "--arch", "sm_90a")
    assert missing.returncode == ExitCode.MISSING_GENERATION
    assert "default/demo/sm_90a" in one_line_error(missing)


def test_a_build_is_up_to_date_only_when_strict_pods_would_load_every_kernel(tmp_path):
    """The stamp holds no CuTe-DSL kernel's source: a comment leaves the generation current,
    a constant the kernels trace through makes the build trace them, find them missing and
    compile a new generation (no --force), which strict serving loads; reverted, the kept
    generation is made current again. ``explain env`` says which recorded input moved."""
    spec, store = write_spec(tmp_path), tmp_path / "store"
    key, kernels = "default/demo/sm_90a", tmp_path / "demo_kernels.py"
    path = f"{tmp_path}:{subprocess_env()['PYTHONPATH']}"

    def build() -> str:
        proc = kernelcache("build", "-f", str(spec), "--store", str(store), "--arch", "sm_90a")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    assert "published" in build()
    first = Store(store).current_manifest(key)
    original = kernels.read_text()
    kernels.write_text("# a comment moves every line\n" + original)
    assert "up-to-date" in build()
    kernels.write_text(original.replace("THREADS = 128", "THREADS = 64"))
    checked = kernelcache("verify", "--store", str(store), "--key", key, "--check-env",
                          PYTHONPATH=path)  # fmt: skip
    assert checked.returncode == 0, checked.stderr  # the stamp cannot see it; the IR can
    explained = kernelcache("explain", "env", key, "--store", str(store), PYTHONPATH=path)
    assert "cute-dsl demo_kernels:add: since its compile: module demo_kernels" in explained.stdout
    rebuilt = build()
    assert "would be refused" in rebuilt and "no kernel compiled from this IR" in rebuilt
    assert "published" in rebuilt
    second = Store(store).current_manifest(key)
    assert second.generation != first.generation
    served = subprocess.run(
        [sys.executable, str(tmp_path / "demo_serve.py"), "--workload", json.dumps(SMALL_WORKLOAD)],
        env=subprocess_env(
            KERNELCACHE_CUTE_DSL_DIR=str(Store(store).current(key) / "files" / "cute-dsl"),
            KERNELCACHE_STRICT="1",
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "2 loaded from cache, 0 compiled" in served.stdout, served.stdout + served.stderr
    kernels.write_text(original)
    assert "re-pointed" in build()
    assert Store(store).current_manifest(key).generation == first.generation


def test_a_build_compiles_only_the_kernels_whose_keys_moved(tmp_path):
    """An edit that moves one of the two kernels: ``build --dry-run`` traces them as the build
    does and says it would compile (not "up-to-date"), ``verify --check-env`` and ``explain
    env`` say plainly that the stamp cannot judge them (never "a hit"); the build compiles
    that one kernel and takes the other from the current generation. A setting that moves
    the stamp but no kernel's key (``CUTE_DSL_COMPILER_OPT`` spelling out the default
    opt-level) publishes a generation that compiled nothing."""
    spec, store = write_spec(tmp_path), tmp_path / "store"
    key, kernels = "default/demo/sm_90a", tmp_path / "demo_kernels.py"
    path = f"{tmp_path}:{subprocess_env()['PYTHONPATH']}"

    def build(*args: str, **env: str) -> subprocess.CompletedProcess:
        return kernelcache(
            "build", "-f", str(spec), "--store", str(store), "--arch", "sm_90a", *args, **env
        )

    def compiled() -> int:
        report = Store(store).current_manifest(key).report
        return sum(w["compiled"] for w in report["warmers"])

    assert build().returncode == 0 and compiled() == 2
    original = kernels.read_text()
    assert "    i = bidx * THREADS + tidx\n" in original
    kernels.write_text(original.replace("i = bidx * THREADS + tidx", "i = tidx + bidx * THREADS"))

    dry = build("--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    (planned,) = json.loads(dry.stdout)["results"]
    assert planned["status"] == "would-compile", planned
    assert "strict pods would refuse it" in planned["message"]
    assert "demo_kernels:add" in planned["message"]
    checked = kernelcache("verify", "--store", str(store), "--key", key, "--check-env",
                          PYTHONPATH=path)  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    assert "keyed by their traced IR" in checked.stderr and "not known" in checked.stderr
    explained = kernelcache("explain", "env", key, "--store", str(store), PYTHONPATH=path)
    # Not a hit: the kernels whose module changed are named, each loads only if it traces
    # to the IR it was compiled from.
    assert "a hit" not in explained.stdout and "but no hit here" in explained.stdout
    assert "demo_kernels:add: since its compile: module demo_kernels" in explained.stdout
    as_json = kernelcache("explain", "env", key, "--store", str(store), "--json", PYTHONPATH=path)
    shown = json.loads(as_json.stdout)
    assert shown["hit"] is False and "keyed by their traced IR" in shown["unchecked"][0]
    assert {k["function"] for k in shown["kernels"]} == {
        "demo_kernels:add",
        "demo_kernels:scale_tiled",
    }

    rebuilt = build()
    assert rebuilt.returncode == 0 and "published" in rebuilt.stdout, rebuilt.stderr
    assert compiled() == 1  # the edited kernel; the other taken from the earlier generation
    assert verify(Store(store).current(key)).ok

    spelled = build(CUTE_DSL_COMPILER_OPT="opt-level=3")  # a setting: a new stamp
    assert spelled.returncode == 0 and "published" in spelled.stdout, spelled.stderr
    assert compiled() == 0


def test_materialized_generation_serves_a_fresh_process_with_zero_compiles(tmp_path):
    spec, store = write_spec(tmp_path), tmp_path / "store"
    assert (
        kernelcache("build", "-f", str(spec), "--store", str(store), "--arch", "sm_90a").returncode
        == 0
    )
    target = tmp_path / "serve"
    target.mkdir()
    proc = kernelcache(
        "verify",
        "--store",
        str(store),
        "--key",
        "default/demo/sm_90a",
        "--materialize",
        str(target),
    )
    assert proc.returncode == 0, proc.stderr
    (generation,) = [p for p in target.iterdir() if p.is_dir()]
    served = subprocess.run(
        [sys.executable, str(tmp_path / "demo_serve.py"), "--workload", json.dumps(SMALL_WORKLOAD)],
        env=subprocess_env(
            KERNELCACHE_CUTE_DSL_DIR=str(generation / "files" / "cute-dsl"), KERNELCACHE_STRICT="1"
        ),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert served.returncode == 0, served.stdout + served.stderr
    assert "2 loaded from cache, 0 compiled" in served.stdout


def test_two_builders_of_one_key_publish_one_generation(tmp_path):
    spec, store = write_spec(tmp_path), tmp_path / "store"
    results = []

    def run() -> None:
        results.append(
            kernelcache("warm", "-f", str(spec), "--store", str(store), "--arch", "sm_90a")
        )

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    assert sorted(r.stdout.split(":")[1].split()[0] for r in results) == ["published", "up-to-date"]
    key = "default/demo/sm_90a"
    assert len(Store(store).generations(key)) == 1
    assert verify(Store(store).current(key)).ok


def test_a_failing_entry_point_is_one_line_and_exit_code(tmp_path):
    spec = write_spec(tmp_path, **{"warmers.0.entryPoints": ["demo_kernels:no_such_function"]})
    proc = kernelcache("warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", "sm_90a")
    assert proc.returncode == ExitCode.WARM_FAILED
    assert "demo_kernels:no_such_function" in one_line_error(proc)
    assert (
        not Store(tmp_path / "s").keys()
        or Store(tmp_path / "s").current("default/demo/sm_90a") is None
    )


def test_a_declared_warmer_that_produced_nothing_fails(tmp_path):
    spec = write_spec(tmp_path, **{"warmers.0.workload": {"sizes": [], "dtypes": []}})
    proc = kernelcache("build", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", "sm_90a")
    assert proc.returncode == ExitCode.WARM_FAILED
    assert "produced nothing" in proc.stderr


def test_command_warmer_reports_what_each_cache_dir_received(tmp_path):
    script = (
        "import os, pathlib; "
        "pathlib.Path(os.environ['TRITON_CACHE_DIR'], 'k.bin').write_bytes(b'x' * 10)"
    )
    spec = write_spec(
        tmp_path, warmers=[{"type": "command", "command": [sys.executable, "-c", script]}]
    )
    store = tmp_path / "store"
    proc = kernelcache("warm", "-f", str(spec), "--store", str(store), "--arch", "sm_90a")
    assert proc.returncode == 0, proc.stderr
    manifest = Store(store).current_manifest("default/demo/sm_90a")
    assert [f.path for f in manifest.files] == ["triton/k.bin"]
    assert manifest.report["warmers"][0]["dirs"] == {"triton": {"files": 1, "bytes": 10}}

    empty = write_spec(
        tmp_path, warmers=[{"type": "command", "command": [sys.executable, "-c", "pass"]}]
    )
    proc = kernelcache("warm", "-f", str(empty), "--store", str(store), "--arch", "sm_90a")
    assert proc.returncode == ExitCode.WARM_FAILED
    assert "produced nothing" in one_line_error(proc)


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["build", "-f", "nope.yaml", "--store", "s"], ExitCode.USAGE, "nope.yaml"),
        (["verify", "--store", "s"], ExitCode.USAGE, "--key"),
        (["verify", "--store", "s", "--key", "default/demo/sm_90a"], ExitCode.IO, "store"),
    ],
)
def test_bad_invocations_are_one_line(tmp_path, args, code, needle):
    proc = kernelcache(*args, cwd=tmp_path)
    assert proc.returncode == code
    assert needle in one_line_error(proc)


def test_unknown_arch_is_refused_naming_the_declared_ones(tmp_path):
    spec = write_spec(tmp_path)
    proc = kernelcache(
        "build", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", "sm_100a"
    )
    assert proc.returncode == ExitCode.USAGE
    assert "sm_100a" in one_line_error(proc) and "sm_90a" in proc.stderr


def test_help_lists_the_exit_codes():
    proc = kernelcache("--help")
    assert proc.returncode == 0
    for code in ExitCode:
        assert f"{int(code):>2}  " in proc.stdout


# A `command` warmer that logs each run, so a test can tell a build from a re-point.
COUNTING_WARMER = (
    "import json, os, pathlib; w = json.loads(os.environ['KERNELCACHE_WORKLOAD']); "
    "open(w['log'], 'a').write('run\\n'); "
    "pathlib.Path(os.environ['TRITON_CACHE_DIR'], 'k.bin').write_text(str(w['version']))"
)


def test_a_reverted_spec_makes_its_kept_generation_current_without_building(tmp_path):
    """v1, v2, then v1 again: the warm re-points CURRENT at v1's generation, runs no warmer
    and says so in its result (what a compile Job leaves as termination message); then v3,
    and `gc --keep 1` keeps v1's, the generation CURRENT named before v3 (it was first
    created before v2's)."""
    runs, store = tmp_path / "runs", tmp_path / "store"
    key = "default/demo/sm_90a"

    def warm(version: int) -> dict:
        warmer = {
            "type": "command",
            "command": [sys.executable, "-c", COUNTING_WARMER],
            "workload": {"version": version, "log": str(runs)},
        }
        spec = write_spec(tmp_path, warmers=[warmer])
        result = tmp_path / "result.json"
        proc = kernelcache(
            "warm", "-f", str(spec), "--store", str(store), "--arch", "sm_90a",
            "--result", str(result),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return json.loads(result.read_text())

    v1, v2 = warm(1), warm(2)
    assert (v1["status"], v2["status"]) == ("published", "published")
    again = warm(1)
    assert runs.read_text().count("run") == 2  # no warmer ran for the revert
    assert again["status"] == "re-pointed"
    assert again["generation"] == v1["generation"] and again["compiled"] == 0
    assert Store(store).current(key).name == v1["generation"]
    ok = kernelcache("verify", "--store", str(store), "--key", key)
    assert ok.returncode == 0, ok.stderr

    v3 = warm(3)
    assert v3["status"] == "published"
    gc = kernelcache("gc", "--store", str(store), key, "--keep", "1")
    assert gc.returncode == 0, gc.stderr
    assert gc.stdout.split() == [f"{key}:", "removed", "1", "generation(s)", v2["generation"]]
    kept = sorted(m.generation for m in Store(store).generations(key))
    assert kept == sorted([v1["generation"], v3["generation"]])


def mixed_fleet(tmp_path: Path, b12x_classes: list[str] | None) -> Path:
    """The b12x example with an H100 class added, built by a warmer of its own; the b12x
    warmer names ``b12x_classes`` (None: none, so it is for every class)."""
    kc = yaml.safe_load((EXAMPLES / "b12x-blackwell-consumer.yaml").read_text())
    kc["spec"]["gpuClasses"].append(
        {"name": "h100", "arch": "sm_90a", "nodeSelector": {"nvidia.com/gpu.product": "H100"}}
    )
    (b12x,) = kc["spec"]["warmers"]
    b12x.pop("gpuClasses", None)  # the example names the classes already
    if b12x_classes is not None:
        b12x["gpuClasses"] = b12x_classes
    script = "import os, pathlib; pathlib.Path(os.environ['TRITON_CACHE_DIR'], 'k.bin').touch()"
    kc["spec"]["warmers"].append(
        {"type": "command", "command": [sys.executable, "-c", script], "gpuClasses": ["h100"]}
    )
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(kc))
    return path


def test_a_warmer_naming_its_gpu_classes_lets_one_kernelcache_cover_a_mixed_fleet(tmp_path):
    spec = mixed_fleet(tmp_path, ["rtx-pro-6000", "rtx-5090"])
    store = tmp_path / "store"
    proc = kernelcache("warm", "-f", str(spec), "--store", str(store), "--arch", "sm_90a")
    assert proc.returncode == 0, proc.stderr
    manifest = Store(store).current_manifest("default/qwen3-moe-b12x/sm_90a")
    assert [w["warmer"] for w in manifest.report["warmers"]] == [f"command {sys.executable}"]
    # The b12x warmer still applies to every class when it names none: sm_90a fails on it.
    every = mixed_fleet(tmp_path, None)
    proc = kernelcache("warm", "-f", str(every), "--store", str(store), "--arch", "sm_90a")
    assert proc.returncode == ExitCode.WARM_FAILED
    assert "b12x warmer: kernels are for sm_120a or sm_121a, not sm_90a" in one_line_error(proc)


def test_a_warmer_naming_a_gpu_class_that_does_not_exist_is_one_line(tmp_path):
    spec = mixed_fleet(tmp_path, ["rtx-pro-6000", "rtx-5900"])
    proc = kernelcache("warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", "sm_90a")
    assert proc.returncode == ExitCode.USAGE
    assert one_line_error(proc) == (
        f"kernelcache: error: {spec}: spec.warmers[0].gpuClasses[1]: no GPU class named "
        "'rtx-5900' (gpuClasses: rtx-pro-6000, rtx-5090, h100)"
    )


def tuning_names() -> dict[str, str]:
    """A file name under files/ that each toolchain declaring tuning takes for tuning."""
    from kernelcache.toolchains import toolchains

    names = {}
    for toolchain in toolchains():
        for suffix in toolchain.tuning_suffixes:
            names[toolchain.name] = f"{toolchain.name}-tuned/k/op{suffix}"
        for prefix in toolchain.tuning_prefixes:
            names[toolchain.name] = f"{prefix}op.json"
    return names


@pytest.mark.parametrize("declared", [True, False], ids=["gpu-product", "none-declared"])
def test_tuning_built_off_gpu_is_scoped_by_the_declared_product(tmp_path, declared):
    """A build where no GPU of the arch is visible (this machine; ``compileOn: cpu``): the
    tuning each toolchain writes carries the class's declared gpuProduct, so a strict pod on
    that product takes it; with none declared the build publishes the compiled files only,
    which strict pods on any product take. (Before: the stamp had no product and every
    strict pod refused the generation.)"""
    tuned = tuning_names()
    assert {"triton", "inductor", "flashinfer"} <= set(tuned), tuned
    files = [*tuned.values(), "triton/k/op.cubin"]
    script = (
        "import json, os, pathlib; root = pathlib.Path(os.environ['KERNELCACHE_FILES'])\n"
        "for rel in json.loads(os.environ['KERNELCACHE_WORKLOAD'])['files']:\n"
        "    (root / rel).parent.mkdir(parents=True, exist_ok=True); (root / rel).write_text('{}')"
    )
    warmer = {"type": "command", "command": [sys.executable, "-c", script],
              "workload": {"files": files}}  # fmt: skip
    spec = write_spec(tmp_path, warmers=[warmer])
    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["gpuClasses"] = [doc["spec"]["gpuClasses"][0]]  # h200, sm_90a
    doc["spec"]["gpuClasses"][0]["compileOn"] = "cpu"
    if not declared:
        del doc["spec"]["gpuClasses"][0]["gpuProduct"]
    spec.write_text(yaml.safe_dump(doc))
    store = tmp_path / "store"
    proc = kernelcache("warm", "-f", str(spec), "--store", str(store), "--arch", "sm_90a")
    assert proc.returncode == 0, proc.stderr
    manifest = Store(store).current_manifest("default/demo/sm_90a")
    published = sorted(f.path for f in manifest.files)
    if declared:
        assert manifest.stamp["factors"]["gpu_product"] == "NVIDIA H200"
        assert published == sorted(files)
    else:
        assert "gpu_product" not in manifest.stamp["factors"]
        assert published == ["triton/k/op.cubin"]
        assert f"dropped {len(tuned)} tuning file(s)" in proc.stderr, proc.stderr
    for product, served in (("NVIDIA-H200", True), ("NVIDIA-H100", not declared)):
        args = ["verify", "--store", str(store), "--key", "default/demo/sm_90a"]
        proc = kernelcache(*args, "--policy", "strict", "--gpu-product", product)
        assert (proc.returncode == 0) is served, proc.stderr
        if not served:
            assert "stamp mismatch: gpu_product" in one_line_error(proc)
