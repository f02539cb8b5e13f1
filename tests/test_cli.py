"""The CLI's surface through the real ``kernelcache`` in fresh processes: ``--json`` checked
against the schemas in ``docs/cli-schemas``, build's streamed output and summary, gc
``--dry-run``, ``--version``, help text and shell completion.

One store is built once for the module (two arches of the example CuTe-DSL kernels plus a
command warmer that prints): every read-only test reuses it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest
import yaml

from kernelcache import __version__
from kernelcache.errors import ExitCode
from kernelcache.store import Store
from kernelcache.store.manifest import load_manifest
from tests.conftest import (
    REPO,
    SMALL_WORKLOAD,
    checked,
    free_port,
    needs_cute,
    publish_files,
    run_kernelcache,
    scaled,
    subprocess_env,
    wait_until,
    write_spec,
    write_warmer_spec,
)

# A command warmer that prints, then waits for the test's go-ahead file: its line must reach
# build's stderr while the warm is still running, not when it ends.
ECHO_WARMER = (
    "import os, pathlib, sys, time; "
    "print('warm-up step 1 of the engine', flush=True); "
    "print('\\x1b[32mcoloured\\x1b[0m line', flush=True); "
    "sys.stdout.buffer.write(bytes([0x6e, 0x6f, 0x74, 0x20, 0xff, 0x0a])); sys.stdout.flush(); "
    "go = pathlib.Path(os.environ['KERNELCACHE_TEST_GO']); "
    "[time.sleep(0.05) for _ in range(2400) if not go.exists()]; "
    "pathlib.Path(os.environ['TRITON_CACHE_DIR'], 'k.bin').write_bytes(b'x' * 10)"
)


def popen_kernelcache(*args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kernelcache", *args],
        env=subprocess_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Any]:
    """``build --json`` of both arches, its go-ahead given once the echo line streamed."""
    tmp = tmp_path_factory.mktemp("cli")
    spec = write_spec(tmp)
    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["warmers"].append(
        {"type": "command", "command": [sys.executable, "-c", ECHO_WARMER]}
    )
    spec.write_text(yaml.safe_dump(doc))
    store, go = tmp / "store", tmp / "go"
    proc = popen_kernelcache(
        "build", "-f", str(spec), "--store", str(store), "--json", KERNELCACHE_TEST_GO=str(go)
    )
    assert proc.stderr is not None and proc.stdout is not None
    streamed = []
    for line in proc.stderr:
        streamed.append(line)
        if "warm-up step 1 of the engine" in line:
            go.touch()  # seen while the warmer waits: streamed, not collected at the end
    stdout = proc.stdout.read()
    assert proc.wait(timeout=scaled(600)) == 0, "".join(streamed)
    return {"spec": spec, "store": store, "stdout": stdout, "stderr": "".join(streamed), "tmp": tmp}


pytestmark = needs_cute


def test_build_streams_the_warmers_output_and_kernels_as_plain_lines(built):
    stderr = built["stderr"]
    assert "sm_90a: warm-up step 1 of the engine" in stderr
    assert "sm_120a: warm-up step 1 of the engine" in stderr
    assert "sm_90a: not \ufffd" in stderr  # a byte that is not UTF-8 does not end the build
    assert "sm_90a: [1] cute-dsl demo_kernels:add:" in stderr
    assert "elapsed" in stderr
    assert "sm_90a: coloured line" in stderr
    assert "\x1b" not in stderr  # piped: no escape codes, not even a warmer's own


def test_build_json_has_its_schema_and_a_summary_per_toolchain(built):
    payload = checked("build", built["stdout"])
    assert [r["arch"] for r in payload["results"]] == ["sm_120a", "sm_90a"]
    for result in payload["results"]:
        assert result["status"] == "published"
        totals = {t["toolchain"]: t for t in result["toolchains"]}
        assert totals["cute-dsl"]["compiled"] == 2 and totals["cute-dsl"]["bytes"] > 0
        assert totals["command"]["files"] == 1
        assert {k["kernel"] for k in result["slowest_kernels"]} == {
            "demo_kernels:add",
            "demo_kernels:scale_tiled",
        }


def test_build_table_names_the_slowest_kernels_per_toolchain(built):
    proc = run_kernelcache(
        "build", "-f", str(built["spec"]), "--store", str(built["tmp"] / "fresh"),
        "--arch", "sm_90a", "--arch", "sm_90a",
        KERNELCACHE_TEST_GO=str(built["tmp"] / "go"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "compiled per toolchain" in proc.stdout
    assert "demo_kernels:add" in proc.stdout.split("compiled per toolchain")[1]
    assert proc.stderr.count("warming demo") == 1  # --arch twice warms once
    assert proc.stdout.count("sm_90a") == 3  # one row per table, nothing for the repeat


def test_a_failed_warm_says_why_once(tmp_path):
    spec = write_spec(tmp_path, **{"warmers.0.entryPoints": ["demo_kernels:no_such_function"]})
    proc = run_kernelcache(
        "build", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", "sm_90a"
    )
    assert proc.returncode == ExitCode.WARM_FAILED
    assert proc.stderr.count("cannot import") == 1, proc.stderr
    assert "kernelcache: error: sm_90a: entry point demo_kernels:no_such_function" in proc.stderr
    assert "error: kernelcache: error" not in proc.stderr


def test_a_second_builder_says_it_waits_for_the_lock(built):
    key = "default/demo/sm_90a"
    with Store(built["store"]).writer(key):
        proc = popen_kernelcache(
            "build", "-f", str(built["spec"]), "--store", str(built["store"]), "--arch", "sm_90a"
        )
        assert proc.stderr is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
        reader.start()
        said = wait_until(
            lambda: [line for line in lines if "waiting for the writer lock" in line],
            timeout=scaled(120),
            what="the waiting line",
        )
        assert proc.poll() is None  # still waiting while we hold the lock
    assert proc.wait(timeout=scaled(120)) == 0
    assert key in said[0] and "pid" in said[0]


def test_warm_verify_explain_inspect_json(built):
    store, spec = str(built["store"]), str(built["spec"])
    env = {"PYTHONPATH": f"{built['tmp']}:{subprocess_env()['PYTHONPATH']}"}
    warm = run_kernelcache(
        "warm", "-f", spec, "--store", store, "--arch", "sm_90a", "--json",
        KERNELCACHE_TEST_GO=str(built["tmp"] / "go"),
    )  # fmt: skip
    assert warm.returncode == 0, warm.stderr
    assert checked("warm", warm.stdout)["status"] == "up-to-date"

    ok = run_kernelcache(
        "verify", "--store", store, "-f", spec, "--arch", "sm_90a", "--json", **env
    )
    assert ok.returncode == 0, ok.stderr
    assert checked("verify", ok.stdout)["key"] == "default/demo/sm_90a"
    missing = run_kernelcache("verify", "--store", store, "--key", "default/demo/sm_80", "--json")
    assert missing.returncode == ExitCode.MISSING_GENERATION
    failed = checked("verify", missing.stdout)
    assert failed["ok"] is False and failed["error"]["exit_code"] == ExitCode.MISSING_GENERATION

    gens = [Store(store).current(f"default/demo/{arch}") for arch in ("sm_90a", "sm_120a")]
    differ = run_kernelcache("explain", str(gens[0]), str(gens[1]), "--json")
    assert differ.returncode == ExitCode.STAMP_MISMATCH
    diffs = checked("explain", differ.stdout)["differences"]
    assert {"factor": "arch", "left": "sm_90a", "right": "sm_120a"} in diffs
    same = run_kernelcache("explain", str(gens[0]), str(gens[0] / "MANIFEST.json"), "--json")
    assert same.returncode == 0 and checked("explain", same.stdout)["hit"] is True

    inspect = run_kernelcache("inspect", "--store", store, "--json")
    assert inspect.returncode == 0
    assert {row["key"] for row in checked("inspect", inspect.stdout)} == {
        "default/demo/sm_90a",
        "default/demo/sm_120a",
    }


def test_gc_dry_run_removes_nothing_and_names_what_would_go(tmp_path):
    store = tmp_path / "store"
    key = "default/demo/sm_90a"
    for n in (1, 2):  # gc reads generations, not what they hold: published as a build does
        stamp = {"digest": f"blake3:{n}", "factors": {"arch": "sm_90a"}, "factor_digests": {}}
        publish_files(Store(store), key, {"cute-dsl/k.o": bytes([n])}, stamp)
    first = Store(store).generations(key)[0].generation
    dry = run_kernelcache("gc", "--store", str(store), "--keep", "0", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert checked("gc", dry.stdout) == {
        "dry_run": True,
        "keep": 0,
        "keys": [{"key": key, "removed": [first]}],
    }
    assert len(Store(store).generations(key)) == 2
    text = run_kernelcache("gc", "--store", str(store), "--keep", "0", "--dry-run")
    assert f"{key}: would remove 1 generation(s) {first}" in text.stdout
    real = run_kernelcache("gc", "--store", str(store), "--keep", "0", "--json")
    assert checked("gc", real.stdout)["keys"][0]["removed"] == [first]
    assert [m.generation for m in Store(store).generations(key)] == [Store(store).current(key).name]


def test_version():
    proc = run_kernelcache("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"kernelcache {__version__}"


def test_exit_codes_once_in_the_top_help_and_help_without_rst():
    top = run_kernelcache("--help")
    for code in ExitCode:
        assert f"{int(code):>2}  " in top.stdout
    for command in ("build", "warm", "verify", "explain", "inspect", "gc", "doctor", "completion"):
        page = run_kernelcache(command, "--help").stdout
        assert "exit codes: see kernelcache --help" in page
        assert " 12  " not in page and "``" not in page and ":func:" not in page, page


def test_bash_completion_is_generated_from_the_parser():
    script = run_kernelcache("completion", "bash").stdout

    def complete(*words: str) -> list[str]:
        line = " ".join(f"'{w}'" for w in words)
        shell = (
            f"{script}\nCOMP_WORDS=(kernelcache {line}); COMP_CWORD={len(words)}; "
            'COMP_LINE="${COMP_WORDS[*]}"; _kernelcache; printf "%s\\n" "${COMPREPLY[@]}"'
        )
        proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
        return proc.stdout.split()

    assert complete("bu") == ["build"]
    assert "doctor" in complete("")
    assert "--dry-run" in complete("gc", "--store", "s", "--")
    assert complete("completion", "z") == ["zsh"]
    zsh = run_kernelcache("completion", "zsh").stdout
    assert zsh.startswith("autoload -U +X bashcompinit") and "complete -o filenames" in zsh


def test_a_warm_result_fits_a_termination_message(tmp_path):
    """The compile Job's result is its termination message (4096 bytes at most): with many
    kernels compiled it keeps the slowest few, not every one."""
    tiles = [[16, 16], [32, 32], [64, 64], [16, 32], [32, 64], [64, 128]]
    spec = write_spec(tmp_path, **{"warmers.0.workload": {**SMALL_WORKLOAD, "tiles": tiles}})
    result = tmp_path / "result.json"
    proc = run_kernelcache(
        "warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch", "sm_90a",
        "--result", str(result), KERNELCACHE_PROGRESS="1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("kernelcache: compiled cute-dsl kernel ") == 7
    written = checked("warm", result.read_text())
    assert written["compiled"] == 7 and len(written["slowest_kernels"]) == 5
    seconds = [k["seconds"] for k in written["slowest_kernels"]]
    assert seconds == sorted(seconds, reverse=True)
    assert len(result.read_bytes()) < 4096


def test_the_docs_cover_every_command_exit_code_and_warmer():
    from kernelcache.cli import build_parser
    from kernelcache.completion import subcommands
    from kernelcache.spec import WARMER_TYPES

    page = (REPO / "docs" / "cli.md").read_text()
    for command in subcommands(build_parser()):
        assert f"`kernelcache {command}" in page, command
    for kind in WARMER_TYPES:
        assert (REPO / "docs" / "warmers" / f"{kind}.md").is_file(), kind


def test_the_exit_code_table_of_the_docs_and_help_is_the_codes_table():
    """docs/cli.md's table, row for row, is ``EXIT_CODE_HELP``, and that holds every code."""
    from kernelcache.errors import EXIT_CODE_HELP

    page = (REPO / "docs" / "cli.md").read_text()
    table = page[page.index("| code | class |") :].split("\n\n", 1)[0].splitlines()[2:]
    documented = {int(row.split("|")[1]): row.split("|")[2].strip() for row in table}
    assert documented == {int(code): text for code, text in EXIT_CODE_HELP.items()}
    assert set(EXIT_CODE_HELP) == set(ExitCode)
    top = run_kernelcache("--help").stdout
    for code, text in EXIT_CODE_HELP.items():
        assert f"{int(code):>2}  {text}" in top


# --- --json: one object for every outcome, valid against the command's schema -----------------

SCHEMA_FILES = sorted(p.stem for p in (REPO / "docs" / "cli-schemas").glob("*.json"))


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Any]:
    """A store with one generation, a spec that is invalid, a deep MANIFEST.json."""
    from tests.helpers.generations import KEY, publish

    tmp = tmp_path_factory.mktemp("json-failures")
    gen = publish(tmp / "store")
    bad = tmp / "bad.yaml"
    bad.write_text("apiVersion: kernelcache.dev/v1alpha1\nkind: KernelCache\nmetadata: {}\n")
    deep = tmp / "deep" / "MANIFEST.json"
    deep.parent.mkdir()
    deep.write_text("[" * 100_000)
    return {"store": str(tmp / "store"), "key": KEY, "gen": str(gen), "bad": str(bad),
            "deep": str(deep), "missing": str(tmp / "no-store")}  # fmt: skip


# command -> failure class -> its arguments (after the command; --json is added)
FAILURES: dict[str, dict[str, list[str]]] = {
    "build": {
        "usage": ["--store", "{store}"],
        "spec": ["-f", "{bad}", "--store", "{store}"],
    },
    "warm": {
        "usage": ["-f", "{bad}", "--store", "{store}"],
        "spec": ["-f", "{bad}", "--store", "{store}", "--arch", "sm_90a"],
    },
    "verify": {
        "usage": ["--store", "{store}", "--policy", "lax"],
        "spec": ["-f", "{bad}", "--store", "{store}"],
        "io": ["--store", "{missing}", "--key", "{key}"],
        "missing": ["--store", "{store}", "--key", "ns/other/sm_90a", "--arch", "sm_90a"],
    },
    "explain": {
        "usage": ["{gen}"],
        "io": ["{key}", "env", "--store", "{missing}"],
        "missing": ["ns/other/sm_90a", "env", "--store", "{store}"],
        "manifest": ["{deep}", "{gen}"],
    },
    "inspect": {
        "usage": ["--store", "{store}", "a", "b"],
        "io": ["--store", "{missing}"],
        "missing": ["--store", "{store}", "ns/other/sm_90a"],
    },
    "gc": {
        "usage": ["--store", "{store}", "--keep", "-1"],
        "io": ["--store", "{missing}"],
        "missing": ["--store", "{store}", "ns/other/sm_90a"],
    },
    "push": {
        "usage": ["--store", "{store}"],
        "missing": ["--store", "{store}", "--key", "ns/other/sm_90a", "registry.example.com/c/d"],
    },
    "pull": {
        "usage": ["registry.example.com/c/d:latest", "--store", "{store}"],  # a tag, no digest
    },
    "doctor": {  # a generation it cannot find or read is one of its rows (test_doctor.py)
        "usage": ["--no-such-flag"],
        "spec": ["-f", "{bad}"],
    },
}
CLASS_CODE = {
    "usage": ExitCode.USAGE,
    "spec": ExitCode.USAGE,
    "io": ExitCode.IO,
    "missing": ExitCode.MISSING_GENERATION,
    "manifest": ExitCode.MALFORMED_MANIFEST,
}
CASES = [
    pytest.param(
        command,
        what,
        id=f"{command}-{what}",
    )
    for command, classes in FAILURES.items()
    for what in classes
]


@pytest.mark.parametrize(("command", "what"), CASES)
def test_every_json_command_prints_one_object_valid_against_its_schema_when_it_fails(
    stores, capsys, command, what
):
    from kernelcache.cli import main

    args = [a.format(**stores) for a in FAILURES[command][what]]
    code = main([command, *args, "--json"])
    out, err = capsys.readouterr()
    assert code == CLASS_CODE[what], err
    payload = checked(command, out)  # exactly one JSON document, valid against the schema
    line = err.strip().splitlines()[-1]
    failure = payload.get("error") or payload  # warm's is its failed result
    assert failure["exit_code"] == code
    assert failure["message"] in line
    if "error" in payload:  # the class and what the failure is about, as fields
        assert failure["class"] == ExitCode(code).name.lower()
        if what == "io":
            assert failure["path"] == stores["missing"]


def test_a_json_failure_names_the_spec_field_and_the_stamp_factor(stores, capsys):
    from kernelcache.cli import main
    from kernelcache.errors import error_object
    from kernelcache.stamp import FactorDiff, stamp_mismatch

    assert main(["doctor", "-f", stores["bad"], "--json"]) == ExitCode.USAGE
    failure = json.loads(capsys.readouterr().out)["error"]
    assert (failure["class"], failure["path"]) == ("usage", stores["bad"])
    assert failure["field"].startswith("metadata")
    mismatch = stamp_mismatch([FactorDiff("dist/torch", "2.11.0", "2.12.0")])
    assert mismatch is not None
    failure = error_object(mismatch)["error"]
    assert (failure["class"], failure["factor"]) == ("stamp_mismatch", "dist/torch")


def test_every_json_command_has_a_schema_with_the_one_failure_shape():
    from kernelcache.cli import build_parser
    from kernelcache.completion import subcommands

    error = json.loads((REPO / "docs" / "cli-schemas" / "error.json").read_text())
    shape = {k: v for k, v in error.items() if k not in ("$schema", "$id", "title", "description")}
    with_json = [n for n, p in subcommands(build_parser()).items()
                 if any("--json" in a.option_strings for a in p._actions)]  # fmt: skip
    assert set(with_json) <= set(SCHEMA_FILES), with_json
    assert set(FAILURES) == set(with_json)  # the matrix above covers every one
    for name in set(with_json) - {"warm"}:  # warm's failure is its failed result
        schema = json.loads((REPO / "docs" / "cli-schemas" / f"{name}.json").read_text())
        assert shape in schema["oneOf"], name


def test_a_failed_warm_writes_and_prints_its_result(tmp_path):
    script = "import sys; print('engine exploded', file=sys.stderr); sys.exit(3)"
    warmer = {"type": "command", "command": [sys.executable, "-c", script]}
    spec = write_spec(tmp_path, warmers=[warmer])
    result = tmp_path / "result.json"
    proc = run_kernelcache("warm", "-f", str(spec), "--store", str(tmp_path / "s"),
                           "--arch", "sm_90a", "--result", str(result), "--json")  # fmt: skip
    assert proc.returncode == ExitCode.WARM_FAILED, proc.stderr
    printed, written = checked("warm", proc.stdout), checked("warm", result.read_text())
    assert printed == written
    assert written["status"] == "failed" and written["exit_code"] == ExitCode.WARM_FAILED
    assert written["message"] in proc.stderr.strip().splitlines()[-1]


# --- tables at any width, completion of values ------------------------------------------------


def test_tables_at_60_columns_keep_the_key_columns_whole(built):
    from kernelcache.store import Store as _Store

    key = "default/demo/sm_90a"
    gen = _Store(built["store"]).current(key)
    assert gen is not None
    narrow = {"COLUMNS": "60"}
    shown = {
        "inspect": run_kernelcache("inspect", "--store", str(built["store"]), **narrow).stdout,
        "build": run_kernelcache("build", "-f", str(built["spec"]), "--store",
                                 str(built["store"]), "--arch", "sm_90a", **narrow).stdout,
        "doctor": run_kernelcache("doctor", str(gen), "--arch", "sm_90a", **narrow).stdout,
    }  # fmt: skip
    for text in shown.values():
        # A path is printed whole, to be copied; every other line fits the width.
        lines = [line for line in text.splitlines() if str(built["store"]) not in line]
        assert "…" not in text and max(map(len, lines)) <= 60, text
    stamp = load_manifest(gen).stamp["digest"].removeprefix("blake3:")
    assert stamp[:16] in shown["inspect"], "a column that does not fit is shown, not dropped"
    assert key in shown["inspect"] and gen.name[:16] in shown["inspect"]
    assert "sm_90a" in shown["build"] and "up-to-date" in shown["build"]
    assert "toolchain/cute-dsl" in shown["doctor"]


def test_completion_completes_option_choices_and_paths(tmp_path):
    script = run_kernelcache("completion", "bash").stdout
    (tmp_path / "kc.yaml").write_text("")
    (tmp_path / "store").mkdir()

    def complete(*words: str) -> list[str]:
        line = " ".join(f"'{w}'" for w in words)
        shell = (
            f"{script}\nCOMP_WORDS=(kernelcache {line}); COMP_CWORD={len(words)}; "
            '_kernelcache; printf "%s\\n" "${COMPREPLY[@]}"'
        )
        proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True,
                              check=True, cwd=tmp_path)  # fmt: skip
        return proc.stdout.split()

    assert complete("verify", "--policy", "") == ["strict", "permissive"]
    assert complete("build", "-f", "k") == ["kc.yaml"]
    assert complete("gc", "--store", "st") == ["store"]
    assert sorted(complete("explain", "")) == ["kc.yaml", "store"]  # a generation dir or file
    assert complete("warm", "--arch", "") == []  # a value, not an option
    assert complete("gc", "--st") == ["--store"]


# --- the first hour: pipes, typos, no cluster ---------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["completion", "bash"],
        ["inspect", "--store", "{store}", "--json"],
        ["--help"],
        ["inspect", "--store", "{missing}", "--json"],
    ],
    ids=["completion", "inspect-json", "help", "failure-json"],
)
def test_a_reader_that_stops_reading_ends_any_command_quietly_with_141(stores, args):
    """``| head``: the reader is gone before the command writes; no traceback, no
    "internal error", and the exit status of a command the pipe's signal stopped."""
    proc = popen_kernelcache(*(a.format(**stores) for a in args))
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    code = proc.wait(timeout=scaled(120))
    # argparse writes --help itself and drops an OSError of that write: quiet, and 0.
    assert code == (0 if args == ["--help"] else ExitCode.BROKEN_PIPE)
    assert ExitCode.BROKEN_PIPE == 141
    assert "Traceback" not in err and "internal error" not in err and "Exception" not in err
    if args[-1] != "--json" or "{missing}" not in args:
        assert err == ""


def test_a_broken_pipe_that_is_not_the_output_is_still_a_failure(monkeypatch, capsys):
    """Only a closed stdout or stderr is quiet: a child's pipe breaking is a bug to report."""
    from kernelcache.cli import keygen, main

    def breaks(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(keygen, "cmd_keygen", breaks)
    assert main(["keygen", "somewhere"]) == ExitCode.FAILURE
    assert "internal error: BrokenPipeError" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["build", "--stroe", "s", "-f", "x"], "unknown option --stroe (did you mean --store?)"),
        (["build", "--sto", "s", "-f", "x"], "unknown option --sto (did you mean --store?)"),
        (["gc", "--store=s", "--kep", "1"], "unknown option --kep (did you mean --keep?)"),
        (["inspect", "--store", "s", "--jsn"], "unknown option --jsn (did you mean --json?)"),
        (["--verison"], "unknown option --verison (did you mean --version?)"),
        (["biuld", "-f", "x"], "invalid choice: 'biuld' (did you mean build?)"),
        (["verify", "--policy", "strct"], "invalid choice: 'strct' (did you mean strict?)"),
        (["completion", "bsh"], "invalid choice: 'bsh' (did you mean bash?)"),
        (["build", "--zzz"], "unknown option --zzz\n"),
    ],
)
def test_options_are_never_abbreviated_and_a_typo_is_named_with_the_nearest(capsys, args, said):
    from kernelcache.cli import main

    assert main(args) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert said in err and "required" not in err, err  # none near --zzz: no suggestion


def test_an_option_value_or_a_negative_number_is_not_an_unknown_option(capsys):
    from kernelcache.cli import build_parser

    args = build_parser().parse_args(["build", "-fspec.yaml", "--store=s", "--arch", "sm_90a"])
    assert (str(args.file), str(args.store), args.arch) == ("spec.yaml", "s", ["sm_90a"])
    with pytest.raises(Exception, match="-1 is negative"):
        build_parser().parse_args(["gc", "--store", "s", "--keep", "-1"])


def test_the_operator_without_credentials_is_one_line_and_exit_10(tmp_path):
    """Not in a cluster and no kubeconfig: one line naming where it looked, at once, not
    kopf's chained tracebacks retried every minute."""
    pytest.importorskip("kopf")
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "operator"],
        env={**subprocess_env(KUBECONFIG=str(tmp_path / "none")), "KUBERNETES_SERVICE_HOST": ""},
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == ExitCode.IO == 10, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "no Kubernetes credentials" in proc.stderr and str(tmp_path / "none") in proc.stderr


def test_the_operator_against_an_api_server_that_is_down_says_so_once_then_gives_up(tmp_path):
    """A kubeconfig whose API server refuses connections: one line, quiet retries, and at
    the start-up deadline one more line and exit 10; kopf's chained tracebacks never."""
    pytest.importorskip("kopf")
    port = free_port()  # nothing listens there
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    env = subprocess_env(KUBECONFIG=str(kubeconfig), KERNELCACHE_OPERATOR_STARTUP_SECONDS="3")
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "operator"],
        env={**env, "KUBERNETES_SERVICE_HOST": ""},
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == ExitCode.IO, proc.stderr
    lines = proc.stderr.splitlines()
    server = f"API server http://127.0.0.1:{port} unreachable"
    assert len(lines) == 2 and all(server in line for line in lines), proc.stderr
    assert "retrying every 2 s" in lines[0]
    assert "gave up after 3 s (KERNELCACHE_OPERATOR_STARTUP_SECONDS)" in lines[1]
    assert "Traceback" not in proc.stderr


def test_a_silent_warmer_gets_a_heartbeat_with_its_elapsed_time_and_timeout(monkeypatch, capsys):
    """A step that prints nothing for HEARTBEAT_S gets a line saying it still runs, how long
    it has run and its timeout; a progress line in between resets the wait."""
    import time

    from kernelcache import progress

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(progress, "_shown", True)
    with progress.heartbeat("warmer 1/1 command engine-warmup", 3600):
        time.sleep(0.5)
    beats = [line for line in capsys.readouterr().err.splitlines() if "still running" in line]
    assert beats, "no heartbeat in 0.5 s at 0.2 s"
    assert beats[0] == (
        "kernelcache: warmer 1/1 command engine-warmup: still running, 0 s of its 1 h 0 min timeout"
    )
    with progress.heartbeat("warmer 1/1 quiet", 60):
        pass  # stopped at once: no line after the step
    time.sleep(0.3)
    assert "quiet" not in capsys.readouterr().err
    assert [progress.duration(s) for s in (5, 150, 3900)] == ["5 s", "2 min 30 s", "1 h 5 min"]


def test_the_live_build_line_shortens_its_text_with_an_ellipsis_not_the_clock(monkeypatch):
    from kernelcache.output import LIVE_CLOCK, BuildView

    view = BuildView.__new__(BuildView)  # the text alone: no live display started
    view.name, view.arch, view.compiled = "demo", "sm_90a", 12
    view.err = type("Narrow", (), {"width": 40})()
    text = view._describe()
    assert text.endswith("…") and len(text) == 40 - LIVE_CLOCK
    view.err.width = 120
    assert view._describe() == "warming demo for sm_90a: 12 kernel(s) compiled"


def test_build_dry_run_says_what_would_be_compiled_from_which_stamp_and_why(tmp_path):
    """Nothing compiled or written: no generation yet, up to date, a kept generation that
    would be made current again, or the warmers that would run and the factors changed."""

    def spec(text: str):
        cache = "os.path.join(os.environ['TRITON_CACHE_DIR'], 'k')"
        script = f"import os; open({cache}, 'w').write({text!r})"
        warmer = {"type": "command", "command": [sys.executable, "-c", script]}
        return str(write_warmer_spec(tmp_path, warmer))

    store = tmp_path / "store"

    def dry_run(spec_path: str) -> dict[str, Any]:
        proc = run_kernelcache(
            "build", "-f", spec_path, "--store", str(store), "--dry-run", "--json"
        )
        assert proc.returncode == 0, proc.stderr
        (result,) = checked("build", proc.stdout)["results"]
        assert result["compiled"] == 0 and result["files"] == 0
        return result

    first = dry_run(spec("a"))
    assert first["status"] == "would-compile" and first["would_run"] == [
        f"command {sys.executable}"
    ]
    assert first["message"] == "default/kc/sm_90a: no generation published yet"
    assert not store.exists() or not any(store.rglob("CURRENT"))  # nothing written

    assert run_kernelcache("build", "-f", spec("a"), "--store", str(store)).returncode == 0
    up = dry_run(spec("a"))
    assert up["status"] == "up-to-date" and up["stamp"] == first["stamp"] and up["would_run"] == []

    changed = dry_run(spec("b"))
    assert changed["status"] == "would-compile" and changed["stamp"] != first["stamp"]
    assert [c["factor"] for c in changed["changed"]] == ["workload"]
    assert changed["message"].startswith("the stamp differs: workload: ")

    assert run_kernelcache("build", "-f", spec("b"), "--store", str(store)).returncode == 0
    back = dry_run(spec("a"))  # a reverted spec: its generation is still kept
    assert back["status"] == "would-re-point" and back["generation"] == up["generation"]
    assert Store(store).current_manifest("default/kc/sm_90a").stamp["digest"] == changed["stamp"]

    table = run_kernelcache("build", "-f", spec("a"), "--store", str(store), "--dry-run")
    assert "would-re-point" in table.stdout and "checking (dry run) kc" in table.stderr
