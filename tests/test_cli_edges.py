"""The CLI at its edges, each a class of defect a first hour met: a reader that goes away
mid-build, a kubeconfig the loader cannot parse, a server that is not a registry, a refused
port, typos and a bare command, an empty directory as a store, an image refusal under
``--json``, help that breaks words, toolchains that are not installed, a forced rebuild's
report, sizes as quantities, and failures that count what they leave out."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import yaml

from kernelcache import stamp as stamps
from kernelcache.errors import ExitCode
from kernelcache.stamp_policy import ENGINE_IMAGE_FACTOR
from kernelcache.store import Store
from tests.conftest import (
    REPO,
    checked,
    free_port,
    kernelcache_doc,
    needs_cute,
    one_line_error,
    publish_files,
    run_kernelcache,
    scaled,
    subprocess_env,
)
from tests.helpers.local_http import local_server

KEY = "default/kc/sm_90a"


def command_warmer(script: str) -> dict:
    return {"type": "command", "command": [sys.executable, "-c", script]}


def spec_with(tmp_path: Path, *warmers: dict) -> Path:
    spec = tmp_path / "kc.yaml"
    spec.write_text(yaml.safe_dump(kernelcache_doc("kc", warmers=list(warmers))))
    return spec


def a_store(root: Path, image: str = "ghcr.io/kernelcache/examples:0.1.0") -> Path:
    factors = {"arch": "sm_90a", ENGINE_IMAGE_FACTOR: image}
    stamp = stamps.Stamp(factors).to_dict()
    publish_files(Store(root), KEY, {"triton/k.bin": b"kernel"}, stamp)
    return root


# --------------------------------------------------------------------------- a closed reader


def test_build_whose_reader_goes_away_ends_quietly_with_141(tmp_path):
    """``kernelcache build 2>&1 | head -1``: rich's console ended the build with exit 1 when
    the pipe closed under the warmers' streamed lines."""
    prints = (
        "import os, sys\n"
        "for i in range(20000): print('warm-up line', i, file=sys.stderr)\n"
        "open(os.path.join(os.environ['TRITON_CACHE_DIR'], 'k'), 'w').write('x')\n"
    )
    spec = spec_with(tmp_path, command_warmer(prints))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelcache", "build", "-f", str(spec), "--store", "s"],
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith(b"sm_90a: ")
    proc.stdout.close()  # as head does after its line
    assert proc.wait(timeout=scaled(300)) == ExitCode.BROKEN_PIPE


# --------------------------------------------------------------------------- kubeconfig


@pytest.mark.parametrize(
    "text",
    [
        "apiVersion: v1\nclusters: [\n  - {name: x\n",
        "- a\n- b\n",
        "current-context: x\ncontexts: 5\n",
    ],
    ids=["not-yaml", "a-list", "a-number-for-a-list"],
)
def test_a_malformed_kubeconfig_is_exit_10_in_one_line(tmp_path, text):
    pytest.importorskip("kopf")
    config = tmp_path / "config"
    config.write_text(text)
    env = subprocess_env(KUBECONFIG=str(config))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "operator"],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == ExitCode.IO, proc.stderr
    line = one_line_error(proc)
    assert f"no usable kubeconfig at {config}" in line and "internal error" not in line


# --------------------------------------------------------------------------- not a registry


class WebPage(BaseHTTPRequestHandler):
    """A web server, not a registry: a page for every path."""

    def do_GET(self) -> None:
        body = b"<html><body>hello</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_POST = do_PUT = do_GET

    def log_message(self, *args: object) -> None:
        pass


class NotFound(WebPage):
    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_POST = do_PUT = do_GET


DIGEST = "sha256:" + "0" * 64


@pytest.mark.parametrize("handler", [WebPage, NotFound], ids=["a-page", "404"])
@pytest.mark.parametrize("command", ["pull", "push", "verify"])
def test_plain_http_to_a_server_that_is_not_a_registry_says_so(tmp_path, handler, command):
    store = a_store(tmp_path / "store")
    with local_server(handler) as port:
        host = f"127.0.0.1:{port}"
        args = {
            "pull": ["pull", f"{host}/kc/x@{DIGEST}", "--store", str(tmp_path / "into")],
            "push": ["push", f"{host}/kc/x", "--key", KEY, "--store", str(store)],
            "verify": ["verify", "--key", KEY, "--arch", "sm_90a",
                       "--pull", f"sm_90a={host}/kc/x@{DIGEST}",
                       "--materialize", str(tmp_path / "pod")],
        }[command]  # fmt: skip
        proc = run_kernelcache(*args, "--plain-http")
    assert proc.returncode == ExitCode.IO, proc.stderr
    line = one_line_error(proc)
    assert f"{host}: GET /v2/: answered HTTP" in line and "not an OCI registry" in line, line
    assert "Expecting value" not in line and "not in the registry" not in line


def test_tls_to_a_plain_http_server_names_the_cause_without_urllib3s_words(tmp_path):
    with local_server(WebPage) as port:
        proc = run_kernelcache("pull", f"127.0.0.1:{port}/kc/x@{DIGEST}", "--store", "s")
    line = one_line_error(proc)
    assert "TLS refused" in line and "--plain-http" in line, line
    for repr_word in ("HTTPSConnectionPool", "Max retries", "object at 0x", "Caused by"):
        assert repr_word not in line


def test_a_refused_port_says_refused_and_how_often_not_a_wait_it_did_not_make():
    port = free_port()  # nothing listens on it
    proc = run_kernelcache(
        "pull", f"127.0.0.1:{port}/kc/x@{DIGEST}", "--store", "s", "--plain-http",
        KERNELCACHE_REGISTRY_TRIES="3", KERNELCACHE_REGISTRY_CONNECT_S="30",
    )  # fmt: skip
    line = one_line_error(proc)
    assert proc.returncode == ExitCode.IO
    assert "no connection: [Errno 111] Connection refused, 3 tries in " in line, line
    assert "within 30 s" not in line and "NewConnectionError" not in line


# --------------------------------------------------------------------------- the command line


def test_bare_kernelcache_prints_its_usage_and_the_commands(capsys):
    from kernelcache.cli import main

    assert main([]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: kernelcache")
    assert all(command in err for command in ("build", "verify", "explain", "inspect"))
    assert "exit codes" in err


def subcommands() -> list[str]:
    from kernelcache.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return sorted(sub.choices)


@pytest.mark.parametrize("command", subcommands())
def test_a_command_line_error_names_the_command_once(capsys, command):
    from kernelcache.cli import main

    assert main([command, "--zzz"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err == f"kernelcache: error: {command}: unknown option --zzz\n"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["build", "-json"], "build: unknown option -json (did you mean --json?)"),
        (["gc", "-keep", "1"], "gc: unknown option -keep (did you mean --keep?)"),
        (["inspect", "-store=s"], "inspect: unknown option -store (did you mean --store?)"),
        (["verify", "-arch", "sm_90a"], "verify: unknown option -arch (did you mean --arch?)"),
    ],
)
def test_a_long_option_with_one_dash_gets_the_two_dash_one_suggested(capsys, args, said):
    from kernelcache.cli import main

    assert main(args) == ExitCode.USAGE
    assert capsys.readouterr().err == f"kernelcache: error: {said}\n"


@pytest.mark.parametrize("columns", ["40", "60", "80"])
def test_help_never_breaks_a_word_at_its_hyphen(monkeypatch, columns):
    from kernelcache.cli import build_parser

    monkeypatch.setenv("COLUMNS", columns)
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    for name, command in [("kernelcache", parser), *sub.choices.items()]:
        text = command.format_help()
        broken = [line for line in text.splitlines() if re.search(r"\w-$", line)]
        assert broken == [], f"{name} --help at {columns} columns: {broken}"
        assert "/dev/termination-log" in text or name != "verify"


# --------------------------------------------------------------------------- stores


@pytest.mark.parametrize("command", ["inspect", "gc"])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_an_empty_directory_as_the_store_is_not_a_store(tmp_path, command, as_json):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_kernelcache(command, "--store", str(empty), *(["--json"] if as_json else []))
    assert proc.returncode == ExitCode.IO, proc.stdout
    assert f"{empty}: not a store: no generation published in it" in one_line_error(proc)
    if as_json:
        assert checked(command, proc.stdout)["error"]["path"] == str(empty)
    else:
        assert proc.stdout == ""


@pytest.mark.parametrize("kept", [0, 1, 2])
def test_an_image_refusal_under_json_names_its_factor_and_counts_in_words(tmp_path, kept):
    root = tmp_path / "store"
    for n in range(kept):
        a_store(root, image=f"ghcr.io/kernelcache/older:{n}")
    a_store(root)
    proc = run_kernelcache(
        "verify", "--store", str(root), "--key", KEY, "--arch", "sm_90a",
        "--expect-image", "ghcr.io/kernelcache/other:2", "--json",
    )  # fmt: skip
    assert proc.returncode == ExitCode.STAMP_MISMATCH, proc.stderr
    error = checked("verify", proc.stdout)["error"]
    assert error["factor"] == ENGINE_IMAGE_FACTOR
    said = {
        0: "no other generation is kept",
        1: "the one generation kept besides it was not built for it either",
        2: "none of the 2 generations kept besides it was built for it either",
    }[kept]
    assert said in error["message"] and "none of the 0" not in error["message"]


# --------------------------------------------------------------------------- explain


@needs_cute
def test_explain_against_an_environment_where_the_kernel_module_is_absent_is_no_hit(demo_build):
    """The demo's kernels are keyed by their IR, not a source factor: the stamp matches, and
    without their module on the path no process here could trace them."""
    bare = {"PYTHONPATH": str(REPO / "src")}  # no examples/, no spec folder
    args = ("explain", demo_build.key, "env", "--store", str(demo_build.store))
    proc = run_kernelcache(*args, **bare)
    assert proc.returncode == ExitCode.STAMP_MISMATCH, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any("module demo_kernels is absent here" in line for line in lines[:-1])
    assert not lines[-1].endswith("a hit") and "no hit here" in lines[-1], lines[-1]
    payload = checked("explain", run_kernelcache(*args, "--json", **bare).stdout)
    assert payload["hit"] is False and payload["differences"] == []
    assert {k["function"].split(":")[0] for k in payload["kernels"]} == {"demo_kernels"}


# --------------------------------------------------------------------------- toolchains


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
@pytest.mark.parametrize(
    "args",
    [["build"], ["build", "--dry-run"], ["warm", "--arch", "sm_90a"],
     ["warm", "--arch", "sm_90a", "--dry-run"]],
    ids=["build", "build-dry-run", "warm", "warm-dry-run"],
)  # fmt: skip
def test_a_warmer_whose_toolchain_is_not_installed_is_exit_13_before_any_warmer_runs(
    tmp_path, args
):
    ran = tmp_path / "first-warmer-ran"
    first = command_warmer(
        f"import os, pathlib; pathlib.Path({str(ran)!r}).touch(); "
        "open(os.path.join(os.environ['TRITON_CACHE_DIR'], 'k'), 'w').write('x')"
    )
    vllm = yaml.safe_load((REPO / "examples" / "vllm-qwen3-moe.yaml").read_text())["spec"]
    spec = spec_with(tmp_path, first, vllm["warmers"][0])
    proc = run_kernelcache(*args, "-f", str(spec), "--store", str(tmp_path / "s"))
    assert proc.returncode == ExitCode.NOT_INSTALLED, proc.stderr
    line = one_line_error(proc)
    assert "spec.warmers[1] (vllm): vllm is not installed" in line, line
    assert not ran.exists()
    assert not (tmp_path / "s").exists() or Store(tmp_path / "s").keys() == []


def test_a_dry_run_imports_each_toolchain_and_names_a_broken_install(tmp_path):
    """Installed but failing at import: only a dry run, which runs no warmer, would not
    meet it; it names the package and the import's words, exit 13."""
    broken = tmp_path / "site" / "triton"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libtriton.so: cannot open it')\n")
    spec = spec_with(tmp_path, {"type": "triton", "entryPoints": ["triton_kernels:warm"]})
    env = {"PYTHONPATH": f"{tmp_path / 'site'}:{subprocess_env()['PYTHONPATH']}"}
    for args in (["warm", "--arch", "sm_90a"], ["build"]):
        proc = run_kernelcache(*args, "--dry-run", "-f", str(spec), "--store", "s", **env)
        assert proc.returncode == ExitCode.NOT_INSTALLED, proc.stderr
        line = proc.stderr.strip().splitlines()[-1]  # build's progress lines come first
        assert line.startswith("kernelcache: error: ") and "Traceback" not in proc.stderr
        assert "spec.warmers[0] (triton): triton is installed but import triton fails" in line
        assert "libtriton.so: cannot open it" in line


def test_a_forced_rebuild_reports_its_own_seconds_not_the_first_builds(tmp_path):
    """The forced warm compiles the same bytes: the generation is the one already there,
    whose manifest holds the first build's report (a 5 s warm-up); the second took none."""
    slow = tmp_path / "slow"
    slow.touch()
    warmer = command_warmer(
        f"import os, pathlib, time; time.sleep(5 if pathlib.Path({str(slow)!r}).exists() else 0); "
        "open(os.path.join(os.environ['TRITON_CACHE_DIR'], 'k'), 'w').write('x')"
    )
    spec = spec_with(tmp_path, warmer)
    store = str(tmp_path / "s")
    first = checked("build", run_kernelcache("build", "-f", str(spec), "--store", store,
                                             "--json").stdout)["results"][0]  # fmt: skip
    slow.unlink()
    proc = run_kernelcache("build", "-f", str(spec), "--store", store, "--force", "--json")
    forced = checked("build", proc.stdout)["results"][0]
    assert forced["generation"] == first["generation"]  # the same bytes, published again
    assert first["toolchains"][0]["seconds"] >= 5
    # A part of this warm cannot have taken longer than the whole of it.
    assert forced["toolchains"][0]["seconds"] <= forced["seconds"] < 5


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "size"),
    [("10Gi", 10 * 2**30), ("500M", 500 * 10**6), ("1.5Ki", 1536), ("1e9", 10**9), ("42", 42)],
)
def test_prefetch_limit_takes_a_quantity_as_the_chart_writes_it(text, size):
    from kernelcache.cli import build_parser

    args = ["prefetch", "--root", "r", "--key", KEY, "--want", "g", "--limit", text]
    assert build_parser().parse_args(args).limit == size


@pytest.mark.parametrize("text", ["10GB", "10m", "ten", "-5"])
def test_prefetch_limit_that_is_no_size_is_one_usage_line(capsys, text):
    from kernelcache.cli import main

    assert main(["prefetch", "--root", "r", "--key", KEY, "--want", "g", f"--limit={text}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "such as 10Gi" in err and "prefetch: argument --limit" in err


def test_prefetch_with_a_quantity_limit_keeps_the_generation(tmp_path):
    store = a_store(tmp_path / "store")
    (generation,) = [m.generation for m in Store(store).generations(KEY)]
    proc = run_kernelcache(
        "prefetch", "--root", str(tmp_path / "node"), "--key", KEY, "--want", generation,
        "--store", str(store), "--limit", "1Gi",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- "(and N more)"


def test_a_failure_names_what_its_and_more_leaves_out_and_json_lists_every_one(tmp_path):
    doc = kernelcache_doc("kc")
    spec = doc["spec"]
    spec["modle"] = spec.pop("model")
    spec["gpuClasses"][0]["arch"] = "sm_91z"
    spec["warmers"] = [{"type": "command"}]
    path = tmp_path / "kc.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = run_kernelcache("build", "-f", str(path), "--store", "s", "--json")
    assert proc.returncode == ExitCode.USAGE
    error = checked("build", proc.stdout)["error"]
    line = one_line_error(proc)
    assert "(and 3 more: spec.model, spec.gpuClasses[0].arch, spec.warmers[0].command)" in line
    assert len(error["details"]) == 4 and error["details"][0] in line
    assert all(d.startswith(f"{path}: spec.") for d in error["details"])


def test_a_generation_with_several_problems_names_each_file(tmp_path):
    root = tmp_path / "store"
    factors = {"arch": "sm_90a"}
    files = {"triton/a.bin": b"a" * 10, "triton/b.bin": b"b" * 10, "triton/c.bin": b"c" * 10}
    publish_files(Store(root), KEY, files, stamps.Stamp(factors).to_dict())
    current = Store(root).current(KEY)
    assert current is not None
    for name in ("a.bin", "b.bin"):
        (current / "files" / "triton" / name).write_bytes(b"z" * 10)
    proc = run_kernelcache("verify", "--store", str(root), "--key", KEY, "--arch", "sm_90a",
                           "--json")  # fmt: skip
    assert proc.returncode == ExitCode.INTEGRITY, proc.stderr
    error = checked("verify", proc.stdout)["error"]
    line = one_line_error(proc)
    assert re.search(r"\(and 1 more: \S*b\.bin\)", line), line
    assert [("a.bin" in d, "b.bin" in d) for d in error["details"]] == [(True, False),
                                                                       (False, True)]  # fmt: skip
    assert json.dumps(error).count("c.bin") == 0
