"""Bad warmers through the real CLI: deadlines, exits and odd returns, Ctrl-C, a missing
signing key, escapes in what they print: one plain stderr line, the exit code of its
documented class, and nothing published (the rest of the bad input: tests/test_bad_input.py).

Warmers here are commands and tiny entry points that compile nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kernelcache.errors import ExitCode
from kernelcache.store import Store
from tests.conftest import (
    REPO,
    entry_point_spec,
    one_line_error,
    run_kernelcache,
    scaled,
    subprocess_env,
    wait_until,
    write_warmer_spec,
    writes_one_file,
)

KEY = "default/kc/sm_90a"


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


# --- warmers: deadlines and their own exit codes --------------------------------------------


# The warmer's deadline counts from its start, which imports the DSL and starts observing
# before the entry point runs: it must outlast that start-up on a busy machine, or the entry
# point never runs. The entry points sleep 60 s: a warm that ends with the timeout's line
# and the child gone was cut short by it.
ENTRY_POINT_TIMEOUT = int(scaled(15))


def test_timeout_ends_an_entry_point_and_the_processes_it_started(tmp_path):
    spec = entry_point_spec(
        tmp_path,
        "child = subprocess.Popen(['sleep', '60'])\n"
        "open('child.pid', 'w').write(str(child.pid))\n"
        "try:\n    time.sleep(60)\nexcept Exception:\n    time.sleep(60)",  # cannot swallow it
        timeoutSeconds=ENTRY_POINT_TIMEOUT,
    )
    proc = run_kernelcache("warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch",
                           "sm_90a", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == ExitCode.WARM_FAILED
    assert f"ran past timeoutSeconds={ENTRY_POINT_TIMEOUT}" in one_line_error(proc)
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
        timeoutSeconds=ENTRY_POINT_TIMEOUT,
    )
    proc = run_kernelcache("warm", "-f", str(spec), "--store", str(tmp_path / "s"), "--arch",
                           "sm_90a", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == ExitCode.WARM_FAILED
    assert f"ran past timeoutSeconds={ENTRY_POINT_TIMEOUT}" in one_line_error(proc)
    assert not alive(int((tmp_path / "child.pid").read_text()))
    assert Store(tmp_path / "s").current(KEY) is None


def test_timeout_of_a_command_kills_its_whole_process_group_under_build(tmp_path):
    """A background child holding the build's pipe kept `build` waiting for it: with a child
    that would sleep for a day, a build that waits for it never returns (the deadline here
    raises), and a child that is not killed is still alive after."""
    script = "sleep 86400 & echo $! > bg.pid; sleep 86400"
    spec = write_warmer_spec(
        tmp_path, {"type": "command", "command": ["sh", "-c", script], "timeoutSeconds": 3}
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "build", "-f", str(spec),
         "--store", str(tmp_path / "s")],
        env=subprocess_env(), capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
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


# --- exit codes: every one in the table -------------------------------------------------------


def test_operator_without_kopf_is_not_installed_naming_the_extra(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['kopf'] = None\n"  # as if kopf were not installed
    )
    proc = run_kernelcache("operator", PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO / 'src'}")
    assert proc.returncode == ExitCode.NOT_INSTALLED, proc.stderr
    line = one_line_error(proc)
    assert "kopf is not installed" in line and "kernelcache[operator]" in line


@pytest.mark.parametrize("command", ["warm", "build"])
def test_a_missing_signing_key_is_the_signature_class_before_any_work(tmp_path, command):
    """As the table says (and as verify's missing --public-key is): exit 6, nothing warmed."""
    spec = write_warmer_spec(tmp_path, writes_one_file())
    store, key = tmp_path / "store", tmp_path / "no-such.key"
    args = ["--arch", "sm_90a"] if command == "warm" else []
    proc = run_kernelcache(command, "-f", str(spec), "--store", str(store), *args,
                           "--signing-key", str(key))  # fmt: skip
    assert proc.returncode == ExitCode.SIGNATURE, proc.stderr
    assert f"--signing-key {key}: no such file" in proc.stderr.splitlines()[-1]
    assert not store.exists()


def test_ctrl_c_is_130_and_in_the_table(tmp_path):
    from kernelcache.errors import EXIT_CODE_HELP

    started = tmp_path / "started"
    script = f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(30)"
    spec = write_warmer_spec(
        tmp_path, {"type": "command", "command": [sys.executable, "-c", script]}
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelcache", "warm", "-f", str(spec), "--store",
         str(tmp_path / "s"), "--arch", "sm_90a"],
        env=subprocess_env(), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_until(started.exists, timeout=120, what="the warmer to start")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=scaled(120))
    assert proc.returncode == ExitCode.INTERRUPTED == 130, err
    assert err.strip().splitlines()[-1] == "kernelcache: interrupted"
    assert ExitCode.INTERRUPTED in EXIT_CODE_HELP
    assert not Store(tmp_path / "s").keys()  # nothing half-published


@pytest.mark.parametrize("command", ["warm", "build"])
def test_a_ctrl_c_the_warmers_command_sees_first_is_130_too(tmp_path, command):
    """A Ctrl-C that reaches the command warmer's process group before (or instead of) the
    warm: the command dies of it, and the warm, and a build around it, exit 130 as
    interrupted, never as a failed warm."""
    started = tmp_path / "started"
    script = (
        f"import os, pathlib, time; pathlib.Path({str(started)!r}).write_text(str(os.getpid()))"
        "; time.sleep(60)"
    )
    spec = write_warmer_spec(
        tmp_path, {"type": "command", "command": [sys.executable, "-c", script]}
    )
    args = ["--arch", "sm_90a"] if command == "warm" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelcache", command, "-f", str(spec), "--store",
         str(tmp_path / "s"), *args],
        env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_until(lambda: started.exists() and started.read_text(), timeout=120, what="the warmer")
    os.killpg(int(started.read_text()), signal.SIGINT)  # its own session: the command alone
    _, err = proc.communicate(timeout=scaled(120))
    assert proc.returncode == ExitCode.INTERRUPTED, err
    assert err.strip().splitlines()[-1] == "kernelcache: interrupted"
    assert not Store(tmp_path / "s").keys()
