"""Bad input through the real CLI: one plain stderr line naming what is wrong, the exit code
of its documented class, and nothing published or changed (bad warmers: tests/test_bad_warmers.py).

Warmers here are commands and tiny entry points that compile nothing, so the file stays cheap.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from kernelcache.errors import ExitCode
from kernelcache.store import Store, manifest_checksum
from tests.conftest import (
    HAVE_CUTE,
    REPO,
    checked,
    entry_point_spec,
    kernelcache_doc,
    one_line_error,
    run_kernelcache,
    subprocess_env,
    write_warmer_spec,
    writes_one_file,
)

KEY = "default/kc/sm_90a"


@pytest.fixture
def published(tmp_path: Path) -> Path:
    """A store holding one generation of KEY."""
    spec = write_warmer_spec(tmp_path, writes_one_file())
    proc = run_kernelcache("build", "-f", str(spec), "--store", str(tmp_path / "store"))
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "store"


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


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
    # A setting that changes compiled code, set here and not at the build.
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{subprocess_env()['PYTHONPATH']}"}
    env["CUTE_DSL_LINEINFO"] = "1"

    proc = run_kernelcache("verify", "--store", str(store), "--key", KEY, "--check-env", **env)
    assert proc.returncode == ExitCode.STAMP_MISMATCH, proc.stderr
    verify_line = one_line_error(proc)
    proc = run_kernelcache("explain", KEY, "env", "--store", str(store), **env)
    assert proc.returncode == ExitCode.STAMP_MISMATCH
    (explain_line,) = proc.stdout.splitlines()
    assert explain_line.startswith("setting/CUTE_DSL_LINEINFO: ")
    assert f"(generation {generation[:16]}) != " in explain_line
    assert explain_line.endswith("(this environment)")
    assert explain_line in verify_line


# --- documents nested past any real one: refused as the file's class, naming it ----------------


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def deep_manifest(tmp_path: Path, depth: int) -> Path:
    path = tmp_path / "gen" / "MANIFEST.json"
    path.parent.mkdir()
    path.write_text(nested(depth))
    return path


@pytest.mark.parametrize("depth", [100_000, 80])  # past the recursion limit; past ours only
def test_a_deeply_nested_manifest_is_a_malformed_manifest_naming_it(tmp_path, depth):
    manifest = deep_manifest(tmp_path, depth)
    proc = run_kernelcache("explain", str(manifest), str(manifest))
    assert proc.returncode == ExitCode.MALFORMED_MANIFEST, proc.stderr
    line = one_line_error(proc)
    assert str(manifest) in line and "nested deeper than" in line, line
    # doctor reports it as its generation row, and every other check after it
    proc = run_kernelcache("doctor", str(manifest.parent), "--arch", "sm_90a", "--json")
    assert proc.returncode == ExitCode.MALFORMED_MANIFEST, proc.stderr
    checks = {c["check"]: c for c in checked("doctor", proc.stdout)["checks"]}
    detail = checks["generation"]["detail"]
    assert str(manifest) in detail and "nested deeper than" in detail, detail
    assert "startup-hook" in checks


@pytest.mark.parametrize("depth", [20_000, 80])
def test_a_deeply_nested_spec_is_a_spec_error_naming_the_file(tmp_path, depth):
    warmer = {**writes_one_file(), "workload": {"x": "DEEP"}}
    text = yaml.safe_dump(kernelcache_doc("kc", warmers=[warmer])).replace("DEEP", nested(depth))
    line = refused(tmp_path, text)
    assert str(tmp_path / "kc.yaml") in line and "nested deeper than" in line


def test_a_deeply_nested_node_map_is_no_gpu_info_naming_the_node(published, tmp_path):
    node_map = tmp_path / "node-map"
    node_map.mkdir()
    (node_map / "node-a").write_text('{"a": ' + nested(100_000) + "}")
    proc = run_kernelcache(
        "verify", "--store", str(published), "--namespace", "default", "--name", "kc",
        "--node-name", "node-a", "--node-map", str(node_map),
    )  # fmt: skip
    assert proc.returncode == ExitCode.NO_GPU_INFO, proc.stderr
    line = one_line_error(proc)
    assert "node node-a" in line and "nested deeper than" in line


def test_a_deeply_nested_history_is_ignored_and_gc_still_runs(published):
    """HISTORY.json only orders generations: nested past any real one it counts as empty
    (with a warning), as any malformed history does; gc and inspect go on."""
    (published / KEY / "HISTORY.json").write_text(nested(100_000))
    for command in ("gc", "inspect"):
        proc = run_kernelcache(command, "--store", str(published))
        assert proc.returncode == 0, proc.stderr
        assert "internal error" not in proc.stderr


# --- keygen: both files or neither ------------------------------------------------------------


@pytest.mark.parametrize("present", ["kernelcache.pub", "kernelcache.key", "dangling-pub"])
def test_keygen_next_to_either_existing_file_writes_nothing(tmp_path, present):
    keys = tmp_path / "keys"
    keys.mkdir()
    if present == "dangling-pub":  # a link to nothing is still a name keygen must not take
        (keys / "kernelcache.pub").symlink_to(tmp_path / "nowhere")
        present = "kernelcache.pub"
    else:
        (keys / present).write_text("old\n")
    proc = run_kernelcache("keygen", str(keys))
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert f"{keys / present}: already exists" in one_line_error(proc)
    assert sorted(os.listdir(keys)) == ["kernelcache.pub" if "pub" in present else present]


def test_keygen_into_a_file_says_it_is_not_a_directory(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    proc = run_kernelcache("keygen", str(target))
    assert proc.returncode == ExitCode.USAGE
    assert f"{target}: not a directory" in one_line_error(proc)
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_keygen_writes_a_pair_that_signs_and_verifies(tmp_path):
    from kernelcache.store import load_private_key, load_public_key

    proc = run_kernelcache("keygen", str(tmp_path / "keys"))
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path / "keys")) == ["kernelcache.key", "kernelcache.pub"]
    private = load_private_key(tmp_path / "keys" / "kernelcache.key")
    public = load_public_key(tmp_path / "keys" / "kernelcache.pub")
    public.verify(private.sign(b"m"), b"m")  # raises on a mismatched pair
    assert (tmp_path / "keys" / "kernelcache.key").stat().st_mode & 0o777 == 0o600


# --- names that become label values or object names -----------------------------------------


def test_a_name_longer_than_a_label_value_is_refused_by_file_and_api(tmp_path):
    from kernelcache.crd import crd_manifest
    from kernelcache.errors import SpecError
    from kernelcache.spec import parse_kernelcache

    doc = kernelcache_doc("a" * 64, warmers=[writes_one_file()])
    line = refused(tmp_path, yaml.safe_dump(doc))
    assert "metadata.name" in line and "63" in line
    with pytest.raises(SpecError, match=r"metadata\.name"):
        parse_kernelcache(doc, "admission")  # the webhook's check
    rules = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert {"self.metadata.name.size() <= 63"} == {
        r["rule"] for r in rules["x-kubernetes-validations"]
    }
    doc["metadata"]["name"] = "a" * 63
    assert parse_kernelcache(doc, "admission").metadata.name == "a" * 63


@pytest.mark.parametrize(
    ("field", "spec"),
    [
        ("spec.verification.signing.secretName",
         {"verification": {"signing": {"enabled": True, "secretName": "Keys_Of_Mine"}}}),
        ("spec.storage.existingClaim", {"storage": {"existingClaim": "claim/x"}}),
        ("spec.imagePullSecrets[0].name", {"imagePullSecrets": [{"name": "a" * 254}]}),
    ],
)  # fmt: skip
def test_an_object_name_the_api_server_would_refuse_is_refused_naming_the_field(
    tmp_path, field, spec
):
    line = refused(tmp_path, good_yaml(**spec))
    assert field in line, line


# --- lines that said the wrong thing ----------------------------------------------------------


def test_explain_of_a_directory_without_a_manifest_says_so(published, tmp_path):
    gen = Store(published).current(KEY)
    proc = run_kernelcache("explain", str(gen), str(tmp_path))
    assert proc.returncode == ExitCode.USAGE
    line = one_line_error(proc)
    assert f"{tmp_path}: a directory without MANIFEST.json" in line
    assert "No such file" not in line


def test_doctor_takes_a_key_or_generation_id_with_store(published):
    gen = Store(published).current(KEY)
    assert gen is not None
    for ref in (KEY, gen.name[:12]):
        proc = run_kernelcache("doctor", ref, "--store", str(published), "--arch", "sm_90a",
                               "--json")  # fmt: skip
        assert "needs --store" not in proc.stderr
        report = json.loads(proc.stdout)
        stamp_row = next(c for c in report["checks"] if c["check"] == "stamp")
        assert gen.name in stamp_row["detail"], stamp_row


def test_doctor_without_an_arch_never_calls_the_stamp_a_hit(published):
    gen = Store(published).current(KEY)
    env = {"CUTE_DSL_ARCH": "", "PATH": "/nonexistent"}  # no arch given, none to be found
    proc = run_kernelcache("doctor", str(gen), "--json", **env)
    report = json.loads(proc.stdout)
    rows = {c["check"]: c for c in report["checks"]}
    assert rows["gpu"]["status"] == "fail"
    assert rows["stamp"]["status"] == "fail" and "(a hit)" not in rows["stamp"]["detail"]
    assert proc.returncode == ExitCode.NO_GPU_INFO


# --- the smaller ones ---------------------------------------------------------------------------


def test_gc_names_the_lock_holder_and_gives_up_after_its_timeout(published):
    with Store(published).writer(KEY):  # a build warming this key
        proc = run_kernelcache("gc", "--store", str(published), "--timeout", "0.2")
    assert proc.returncode == ExitCode.LOCKED, proc.stderr
    waiting, error = proc.stderr.strip().splitlines()
    assert f"{KEY}: waiting for the writer lock (pid {os.getpid()}" in waiting
    assert error.startswith("kernelcache: error: ") and "gave up after 0.2s" in error


def test_inspect_lists_healthy_keys_beside_one_with_a_broken_current(published):
    from tests.helpers.generations import publish

    publish(published, "default/other/sm_90a")
    (published / KEY / "CURRENT").write_text("not-a-generation\n")
    for json_flag in ([], ["--json"]):
        proc = run_kernelcache("inspect", "--store", str(published), *json_flag)
        assert proc.returncode == ExitCode.INTEGRITY, proc.stderr
        assert "default/other/sm_90a" in proc.stdout
        assert f"{published / KEY / 'CURRENT'}: not a generation id" in one_line_error(proc)
    rows = checked("inspect", proc.stdout)
    broken = [r for r in rows if "error" in r]
    assert [r["key"] for r in broken] == [KEY]
    assert broken[0]["error"]["exit_code"] == ExitCode.INTEGRITY


@pytest.mark.parametrize("var", ["TRITON_CACHE_DIR", "VLLM_CACHE_ROOT"])
def test_a_warmer_env_that_sets_a_cache_variable_is_refused_naming_it(tmp_path, var):
    line = refused(tmp_path, good_yaml().replace(
        "  - type: command\n", f"  - type: command\n    env:\n      {var}: /elsewhere\n"
    ))  # fmt: skip
    assert f"spec.warmers[0].env.{var}" in line and "files/" in line


# --- a kernel module that does not import here --------------------------------------------------


def test_a_kernel_module_missing_here_is_named_as_an_import_not_a_stale_stamp(tmp_path):
    """A module the build read and this environment cannot find (a PYTHONPATH, a folder not
    copied) is not a stamp to rebuild: its own class, the module, the import's error and
    where it was looked for; the factor as a field."""
    from kernelcache import stamp
    from kernelcache.errors import NotInstalledError, error_object

    recorded = stamp.collect(
        arch="sm_90a", distributions=[], sources={"kc_no_such_kernels": "blake3:" + "0" * 64}
    )
    with pytest.raises(NotInstalledError) as caught:
        stamp.check_environment(recorded.to_dict(), "0" * 32, "sm_90a")
    message = caught.value.message
    assert "kernel module kc_no_such_kernels does not import here" in message
    assert "ModuleNotFoundError: No module named 'kc_no_such_kernels'" in message
    assert "looked in " in message and "site-packages" not in message
    assert error_object(caught.value)["error"]["factor"] == "source/kc_no_such_kernels"
    assert caught.value.code == ExitCode.NOT_INSTALLED


def test_a_spec_copied_without_its_kernels_says_where_they_were_looked_for(tmp_path):
    spec = tmp_path / "copied" / "kc.yaml"
    spec.parent.mkdir()
    doc = yaml.safe_load((REPO / "examples" / "kernelcache.yaml").read_text())
    spec.write_text(yaml.safe_dump(doc))  # demo_kernels.py stays behind
    proc = run_kernelcache(
        "warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", "sm_90a",
        PYTHONPATH=str(REPO / "src"),
    )  # fmt: skip
    assert proc.returncode == ExitCode.WARM_FAILED, proc.stderr
    line = one_line_error(proc)
    assert "cannot import demo_kernels, beside the spec or on sys.path" in line
    assert f"looked in {spec.parent}" in line and "No module named 'demo_kernels'" in line


# --- a directory that is not a store --------------------------------------------------------------


@pytest.mark.parametrize("command", [["inspect"], ["gc", "--dry-run"], ["verify", "--key", KEY]])
def test_a_directory_that_is_not_a_store_is_refused_not_read_as_an_empty_one(tmp_path, command):
    """A typo'd --store that exists (the project folder, a home directory) is named, with
    what it holds, in the I/O class: never an empty table and exit 0."""
    (tmp_path / "src").mkdir()
    (tmp_path / "README.md").write_text("")
    arch = ["--arch", "sm_90a"] if command[0] == "verify" else []
    proc = run_kernelcache(*command, "--store", str(tmp_path), *arch)
    assert proc.returncode == ExitCode.IO, proc.stderr
    line = one_line_error(proc)
    assert f"{tmp_path}: not a store" in line and "README.md, src" in line


def test_an_empty_directory_is_no_store_to_list_but_one_before_its_first_publish_is(tmp_path):
    """An empty directory listed as a store is most often the wrong path: not an empty
    table and exit 0. A key's directory whose first build is still running is a store."""
    fresh = tmp_path / "fresh"
    (fresh / "lost+found").mkdir(parents=True)  # a new volume's
    proc = run_kernelcache("inspect", "--store", str(fresh), "--json")
    assert proc.returncode == ExitCode.IO
    assert json.loads(proc.stdout)["error"]["message"].endswith(
        f"{fresh}: not a store: no generation published in it (an empty directory; build, "
        "warm or pull publishes one)"
    )
    writing = tmp_path / "writing"
    (writing / "default" / "kc" / "sm_90a").mkdir(parents=True)
    (writing / "default" / "kc" / "sm_90a" / ".lock").write_text("")  # its first build runs
    proc = run_kernelcache("inspect", "--store", str(writing), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == [], proc.stderr
