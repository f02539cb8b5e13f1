"""Bad input through the real CLI: one plain stderr line naming what is wrong, the exit code
of its documented class, and nothing published or changed.

Warmers here are commands and tiny entry points that compile nothing, so the file stays cheap.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from kernelcache.errors import ExitCode
from kernelcache.store import Store, manifest_checksum
from tests.conftest import (
    HAVE_CUTE,
    kernelcache_doc,
    one_line_error,
    run_kernelcache,
    subprocess_env,
    write_warmer_spec,
)

KEY = "default/kc/sm_90a"


def writes_one_file() -> dict:
    """A command warmer that leaves one Triton cache file: a publishable generation."""
    script = "import os; open(os.path.join(os.environ['TRITON_CACHE_DIR'], 'k'), 'w').write('x')"
    return {"type": "command", "command": [sys.executable, "-c", script]}


def entry_point_spec(tmp_path: Path, body: str, **warmer) -> Path:
    """A cute-dsl warmer whose entry point ``ep:warm`` has ``body`` (it compiles nothing)."""
    (tmp_path / "ep.py").write_text(
        "import os, signal, subprocess, sys, time\n\n\ndef warm(workload):\n"
        + "".join(f"    {line}\n" for line in body.splitlines())
    )
    return write_warmer_spec(tmp_path, {"type": "cute-dsl", "entryPoints": ["ep:warm"], **warmer})


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.fixture
def published(tmp_path: Path) -> Path:
    """A store holding one generation of KEY."""
    spec = write_warmer_spec(tmp_path, writes_one_file())
    proc = run_kernelcache("build", "-f", str(spec), "--store", str(tmp_path / "store"))
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "store"


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# --- warmers: deadlines and their own exit codes --------------------------------------------


def test_timeout_ends_an_entry_point_and_the_processes_it_started(tmp_path):
    spec = entry_point_spec(
        tmp_path,
        "child = subprocess.Popen(['sleep', '60'])\n"
        "open('child.pid', 'w').write(str(child.pid))\n"
        "try:\n    time.sleep(60)\nexcept Exception:\n    time.sleep(60)",  # cannot swallow it
        timeoutSeconds=5,  # past the warm's start-up, so the entry point does run
    )
    start = time.monotonic()
    proc = run_kernelcache("warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch",
                           "sm_90a", cwd=tmp_path)  # fmt: skip
    assert time.monotonic() - start < 20
    assert proc.returncode == ExitCode.WARM_FAILED
    assert "ran past timeoutSeconds=5" in one_line_error(proc)
    assert "ep:warm" in proc.stderr
    assert not alive(int((tmp_path / "child.pid").read_text()))
    assert Store(tmp_path / "s").current(KEY) is None


@pytest.mark.slow
def test_timeout_holds_for_an_entry_point_that_ignores_the_alarm(tmp_path):
    spec = entry_point_spec(
        tmp_path,
        "signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "child = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "open('child.pid', 'w').write(str(child.pid))\n"
        "time.sleep(60)",
        timeoutSeconds=5,  # past the warm's start-up, so the entry point does run
    )
    start = time.monotonic()
    proc = run_kernelcache("warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch",
                           "sm_90a", cwd=tmp_path)  # fmt: skip
    assert time.monotonic() - start < 30
    assert proc.returncode == ExitCode.WARM_FAILED
    assert "ran past timeoutSeconds=5" in one_line_error(proc)
    assert not alive(int((tmp_path / "child.pid").read_text()))
    assert Store(tmp_path / "s").current(KEY) is None


def test_timeout_of_a_command_kills_its_whole_process_group_under_build(tmp_path):
    """A background child holding the build's pipe kept `build` waiting for it."""
    script = "sleep 60 & echo $! > bg.pid; sleep 60"
    spec = write_warmer_spec(
        tmp_path, {"type": "command", "command": ["sh", "-c", script], "timeoutSeconds": 3}
    )
    start = time.monotonic()
    proc = run_kernelcache("build", "-f", str(spec), "--store", str(tmp_path / "s"))
    assert time.monotonic() - start < 20
    assert proc.returncode == ExitCode.WARM_FAILED
    assert "ran past timeoutSeconds=3" in proc.stderr.splitlines()[-1]
    assert not alive(int((tmp_path / "bg.pid").read_text()))
    assert Store(tmp_path / "s").current(KEY) is None


@pytest.mark.parametrize("command", ["warm", "build"])
@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("sys.exit(3)", "called sys.exit(3)"),  # 3 is "no generation"
        ("sys.exit(0)", "called sys.exit(0)"),  # not a success either
        ("return 5", "returned int"),
        ("return 'gemm'", "returned str"),
    ],
)
def test_an_entry_points_exit_or_odd_return_is_a_failed_warm(tmp_path, command, body, needle):
    spec = entry_point_spec(tmp_path, body)
    args = ["-f", str(spec), "--store", str(tmp_path / "s"), "--arch", "sm_90a"]
    proc = run_kernelcache(command, *args)
    assert proc.returncode == ExitCode.WARM_FAILED, proc.stderr
    line = proc.stderr.strip().splitlines()[-1] if command == "build" else one_line_error(proc)
    assert "ep:warm" in line and needle in line
    assert Store(tmp_path / "s").current(KEY) is None


def test_a_warm_process_ended_by_its_warmer_is_a_failed_warm_in_build(tmp_path):
    spec = entry_point_spec(tmp_path, "os._exit(3)")
    proc = run_kernelcache("build", "-f", str(spec), "--store", str(tmp_path / "s"))
    assert proc.returncode == ExitCode.WARM_FAILED
    assert "exited with 3" in proc.stderr.splitlines()[-1]


# --- command lines ----------------------------------------------------------------------------


def test_gc_keep_negative_is_a_usage_error_and_removes_nothing(published):
    before = tree(published)
    proc = run_kernelcache("gc", "--store", str(published), "--keep", "-1")
    assert proc.returncode == ExitCode.USAGE
    assert "--keep" in one_line_error(proc) and "-1" in proc.stderr
    assert tree(published) == before


def test_any_bad_command_line_is_one_line():
    proc = run_kernelcache("inspect")
    assert proc.returncode == ExitCode.USAGE
    assert "--store" in one_line_error(proc)


def test_warm_result_into_a_missing_directory_is_refused_before_warming(tmp_path):
    spec = write_warmer_spec(tmp_path, writes_one_file())
    store = tmp_path / "store"
    result = tmp_path / "no-such-dir" / "result.json"
    proc = run_kernelcache("warm", "-f", str(spec), "--store", str(store), "--arch", "sm_90a",
                           "--result", str(result))  # fmt: skip
    assert proc.returncode == ExitCode.USAGE
    assert str(result.parent) in one_line_error(proc)
    assert not store.exists()


@pytest.mark.parametrize("command", ["inspect", "gc", "verify", "explain"])
@pytest.mark.parametrize("what", ["missing", "file"])
def test_a_store_that_is_missing_or_a_file_is_an_io_error(tmp_path, command, what):
    root = tmp_path / "store"
    if what == "file":
        root.write_text("")
    args = {"verify": ["--key", KEY], "explain": [KEY, "env"]}.get(command, [])
    proc = run_kernelcache(command, "--store", str(root), *args)
    assert proc.returncode == ExitCode.IO, proc.stderr
    assert str(root) in one_line_error(proc)
    assert (root.is_file() and root.read_text() == "") if what == "file" else not root.exists()


@pytest.mark.parametrize("command", ["inspect", "gc"])
def test_a_key_not_in_the_store_is_no_generation_and_is_not_created(published, command):
    before = tree(published)
    proc = run_kernelcache(command, "--store", str(published), "default/other/sm_90a")
    assert proc.returncode == ExitCode.MISSING_GENERATION
    assert "default/other/sm_90a" in one_line_error(proc)
    assert tree(published) == before


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["build", "-f", "kc.yaml", "--store", ""], "--store"),
        (["warm", "-f", "kc.yaml", "--arch", "sm_90a", "--store", ""], "--store"),
        (["verify", "--key", KEY, "--store", ""], "--store"),
        (["inspect", "--store", ""], "--store"),
        (["gc", "--store", ""], "--store"),
        (["warm", "-f", "kc.yaml", "--arch", "sm_90a", "--store", "s", "--result", ""], "--result"),
        (["verify", "--key", KEY, "--store", "s", "--materialize", ""], "--materialize"),
        (["keygen", ""], "dir"),
    ],
)
def test_an_empty_path_is_refused_not_taken_as_the_current_directory(tmp_path, args, flag):
    write_warmer_spec(tmp_path, writes_one_file())
    proc = run_kernelcache(*args, cwd=tmp_path)
    assert proc.returncode == ExitCode.USAGE
    assert f"argument {flag}: must not be empty" in one_line_error(proc)
    assert tree(tmp_path) == ["kc.yaml"]


# --- terminal escapes -------------------------------------------------------------------------


def test_error_lines_and_warmer_output_carry_no_escapes_when_piped(tmp_path):
    red = "\\x1b[31m"
    spec = entry_point_spec(
        tmp_path, f"print('{red}progress')\nraise RuntimeError('{red}boom\\nmore')"
    )
    for command in ("warm", "build"):
        proc = run_kernelcache(command, "-f", str(spec), "--store", str(tmp_path / "s"),
                               "--arch", "sm_90a")  # fmt: skip
        assert proc.returncode == ExitCode.WARM_FAILED
        assert "\x1b" not in proc.stderr and "boom more" in proc.stderr.splitlines()[-1]

    script = f"import sys; print('{red}out'); print('{red}err', file=sys.stderr); sys.exit(1)"
    spec = write_warmer_spec(
        tmp_path, {"type": "command", "command": [sys.executable, "-c", script]}
    )
    proc = run_kernelcache(
        "warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", "sm_90a"
    )
    assert proc.returncode == ExitCode.WARM_FAILED
    assert "out" in proc.stdout and "err" in proc.stderr
    assert "\x1b" not in proc.stdout + proc.stderr


def test_a_file_name_with_escapes_in_the_store_is_reported_without_them(published, tmp_path):
    files = Store(published).current(KEY) / "files" / "triton"
    (files / "evil\x1b[2J\x1b]0;title\x07name").write_text("")
    log = tmp_path / "termination-log"
    proc = run_kernelcache("verify", "--store", str(published), "--key", KEY,
                           "--termination-log", str(log))  # fmt: skip
    assert proc.returncode == ExitCode.INTEGRITY
    line = one_line_error(proc)
    assert "evilname: not in manifest" in line and "\x1b" not in line + log.read_text()


# --- spec files -------------------------------------------------------------------------------


def spec_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kc.yaml"
    path.write_text(text)
    return path


def good_yaml(**spec) -> str:
    return yaml.safe_dump(
        kernelcache_doc("kc", warmers=[writes_one_file()], **spec), sort_keys=False
    )


def refused(tmp_path: Path, text: str) -> str:
    """Build the spec; it must be refused as a usage error, with nothing published."""
    proc = run_kernelcache("build", "-f", str(spec_file(tmp_path, text)), "--store",
                           str(tmp_path / "s"))  # fmt: skip
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert not (tmp_path / "s").exists()
    return one_line_error(proc)


def test_a_duplicate_key_is_refused_naming_it(tmp_path):
    text = good_yaml().replace("  model: example/model\n", "  model: a/b\n  model: c/d\n")
    assert "duplicate key 'model'" in refused(tmp_path, text)


def test_snake_case_field_names_are_refused_naming_the_camel_case_one(tmp_path):
    text = good_yaml().replace("gpuClasses:", "gpu_classes:")
    line = refused(tmp_path, text)
    assert "spec.gpu_classes: unknown field" in line and "gpuClasses" in line


def test_a_misspelled_required_field_names_the_unknown_key(tmp_path):
    line = refused(tmp_path, good_yaml().replace("  model:", "  modle:"))
    assert "spec.modle: unknown field (did you mean model?)" in line


def test_a_file_larger_than_the_api_server_takes_is_refused_before_parsing(tmp_path):
    text = good_yaml() + "# padding\n" * 2_000_000  # 20 MB
    start = time.monotonic()
    assert "larger than" in refused(tmp_path, text)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("quantity", [1, "1", "20Gi", "500m", "1.5", ".5", "1e3", "+2"])
def test_resource_quantities_as_in_a_pod_are_accepted(tmp_path, quantity):
    doc = kernelcache_doc("kc", warmers=[writes_one_file()])
    doc["spec"]["gpuClasses"][0]["resources"] = {"limits": {"nvidia.com/gpu": quantity}}
    spec = spec_file(tmp_path, yaml.safe_dump(doc))
    proc = run_kernelcache("build", "-f", str(spec), "--store", str(tmp_path / "s"))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("quantity", [-1, "-1", "20 Gi", "1.2.3", "Gi", "2gb", 0.5, True])
def test_bad_resource_quantities_are_refused_naming_the_field(tmp_path, quantity):
    doc = kernelcache_doc("kc", warmers=[writes_one_file()])
    doc["spec"]["gpuClasses"][0]["resources"] = {"requests": {"memory": quantity}}
    line = refused(tmp_path, yaml.safe_dump(doc))
    assert "spec.gpuClasses[0].resources.requests.memory" in line and "quantity" in line


def test_an_arch_no_toolchain_knows_is_refused_with_the_spec(tmp_path):
    doc = kernelcache_doc("kc", arches=("sm_91",), warmers=[writes_one_file()])
    line = refused(tmp_path, yaml.safe_dump(doc))
    assert "gpuClasses[0].arch" in line and "'sm_91'" in line and "sm_90a" in line


def test_an_arch_no_toolchain_knows_is_refused_by_verify(published):
    proc = run_kernelcache("verify", "--store", str(published), "--namespace", "default",
                           "--name", "kc", "--arch", "sm_91")  # fmt: skip
    assert proc.returncode == ExitCode.NO_GPU_INFO
    assert "'sm_91'" in one_line_error(proc)


@pytest.mark.skipif(not HAVE_CUTE, reason="nvidia-cutlass-dsl is not installed")
def test_the_known_arches_are_the_dsls_and_turing():
    from cutlass.base_dsl.enums import Arch

    from kernelcache.arch import KNOWN_ARCHES

    assert set(KNOWN_ARCHES) == set(Arch.__members__) | {"sm_75"}


# --- manifests --------------------------------------------------------------------------------


def test_an_edited_entry_with_a_recomputed_checksum_is_refused_naming_the_entry(published):
    gen_dir = Store(published).current(KEY)
    manifest_path = gen_dir / "MANIFEST.json"
    body = json.loads(manifest_path.read_text())
    body["files"][0]["size"] += 1
    body.pop("checksum")
    body["checksum"] = manifest_checksum(body)
    manifest_path.write_text(json.dumps(body))
    proc = run_kernelcache("verify", "--store", str(published), "--key", KEY)
    assert proc.returncode == ExitCode.INTEGRITY
    assert f"files/{body['files'][0]['path']}: size 1 != manifest 2" in one_line_error(proc)


# --- explain ----------------------------------------------------------------------------------


def test_explain_takes_keys_and_generation_ids_and_labels_both_sides(tmp_path, published):
    store = Store(published)
    first = store.current_manifest(KEY).generation
    spec = write_warmer_spec(tmp_path, {**writes_one_file(), "workload": {"batch": 8}})
    assert run_kernelcache("build", "-f", str(spec), "--store", str(published)).returncode == 0
    second = store.current_manifest(KEY).generation
    assert first != second

    proc = run_kernelcache("explain", first[:12], KEY, "--store", str(published))
    assert proc.returncode == ExitCode.STAMP_MISMATCH, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith("workload: ")
    assert f"(generation {first[:16]}) != " in line and line.endswith(f"(generation {second[:16]})")

    proc = run_kernelcache("explain", KEY, "env", "--store", str(published))
    assert proc.returncode == 0 and "a hit" in proc.stdout

    for ref in ("default/nope/sm_90a", "0123456789abcdef"):
        proc = run_kernelcache("explain", ref, "env", "--store", str(published))
        assert proc.returncode == ExitCode.MISSING_GENERATION
        assert ref in one_line_error(proc)


def test_explain_and_check_env_label_the_sides_the_same_way(tmp_path):
    writes = "open(os.path.join(os.environ['KERNELCACHE_CUTE_DSL_DIR'], 'k.bin'), 'w').write('x')"
    spec = entry_point_spec(tmp_path, writes)
    store = tmp_path / "store"
    proc = run_kernelcache("build", "-f", str(spec), "--store", str(store))
    assert proc.returncode == 0, proc.stderr
    generation = Store(store).current_manifest(KEY).generation
    entry_point_spec(tmp_path, writes + "  # changed")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{subprocess_env()['PYTHONPATH']}"}

    proc = run_kernelcache("verify", "--store", str(store), "--key", KEY, "--check-env", **env)
    assert proc.returncode == ExitCode.STAMP_MISMATCH, proc.stderr
    verify_line = one_line_error(proc)
    proc = run_kernelcache("explain", KEY, "env", "--store", str(store), **env)
    assert proc.returncode == ExitCode.STAMP_MISMATCH
    (explain_line,) = proc.stdout.splitlines()
    assert explain_line.startswith("source/ep: ")
    assert f"(generation {generation[:16]}) != " in explain_line
    assert explain_line.endswith("(this environment)")
    assert explain_line in verify_line
