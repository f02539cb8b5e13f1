"""The README's test command installs the system programs its tests drive, or says so.

``scripts/install-system-tools.sh`` runs in a world whose PATH holds only the basic tools it
uses (and, for the install case, a stand-in apt-get that "installs" a package by putting its
programs on that PATH); ``system_tool`` is the tests' side: skip elsewhere, fail under CI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import conftest
from tests.conftest import REPO, scaled

SCRIPT = REPO / "scripts" / "install-system-tools.sh"
BASICS = ("bash", "id", "sort", "tr", "sed", "chmod")
PROGRAMS = {
    "prometheus": ["promtool", "prometheus"],
    "g++": ["g++"],
    "util-linux": ["unshare"],
    "docker-registry": ["docker-registry"],
    "skopeo": ["skopeo"],
    "apache2-utils": ["htpasswd"],
}
FAKE_APT = """#!{bash}
echo "$@" >> {log}
[ "$1" = install ] || exit 0
for arg in "$@"; do
    case "$arg" in
        prometheus) programs="promtool prometheus" ;;
        g++) programs="g++" ;;
        util-linux) programs="unshare" ;;
        docker-registry) programs="docker-registry" ;;
        skopeo) programs="skopeo" ;;
        apache2-utils) programs="htpasswd" ;;
        *) continue ;;
    esac
    for program in $programs; do
        printf '#!/bin/sh\\n' > "{bin}/$program" && chmod +x "{bin}/$program"
    done
done
"""


def world(tmp_path: Path, apt: bool = False) -> Path:
    """A PATH directory with the basic tools only (and a stand-in apt-get)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in BASICS:
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    if apt:
        fake = bin_dir / "apt-get"
        fake.write_text(
            FAKE_APT.format(bash=shutil.which("bash"), log=tmp_path / "apt.log", bin=bin_dir)
        )
        fake.chmod(0o755)
    return bin_dir


def run(bin_dir: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(bin_dir / "bash"), str(SCRIPT)],
        env={"PATH": str(bin_dir), **env},
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )


def test_under_ci_a_missing_program_fails_naming_it_and_its_package(tmp_path: Path) -> None:
    done = run(world(tmp_path), CI="true")
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "promtool (Debian package prometheus)" in line
    assert "g++ (Debian package g++)" in line
    assert "docker-registry (Debian package docker-registry)" in line
    assert (
        "skopeo (Debian package skopeo)" in line
        and "htpasswd (Debian package apache2-utils)" in line
    )


def test_elsewhere_a_missing_program_is_named_with_the_tests_that_will_skip(tmp_path: Path) -> None:
    done = run(world(tmp_path))
    assert done.returncode == 0
    (line,) = done.stderr.strip().splitlines()
    assert "promtool (Debian package prometheus)" in line and "will skip" in line
    assert "apt-get install apache2-utils docker-registry g++ prometheus skopeo util-linux" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="the install path runs as root")
def test_as_root_missing_programs_are_installed_with_apt_get(tmp_path: Path) -> None:
    bin_dir = world(tmp_path, apt=True)
    done = run(bin_dir, CI="true")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "apt.log").read_text().splitlines() == [
        "update -qq",
        "install -y -qq --no-install-recommends apache2-utils docker-registry g++ prometheus skopeo"
        " util-linux",
    ]
    for programs in PROGRAMS.values():
        assert all((bin_dir / p).exists() for p in programs)
    again = run(bin_dir, CI="true")  # everything there: nothing to do
    assert again.returncode == 0 and again.stderr == ""
    assert len((tmp_path / "apt.log").read_text().splitlines()) == 2


def test_the_readme_test_command_runs_the_script_before_pytest() -> None:
    dry = subprocess.run(
        ["make", "-n", "-W", ".venv/.installed-test", "test"],
        cwd=REPO, capture_output=True, text=True, timeout=scaled(60),
    )  # fmt: skip
    lines = dry.stdout.splitlines()
    script = next(i for i, line in enumerate(lines) if "install-system-tools.sh" in line)
    tests = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert script < tests, dry.stdout


def test_a_test_needing_a_missing_program_fails_under_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="promtool is not installed"):
        conftest.system_tool("promtool")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="promtool is not installed"):
        conftest.system_tool("promtool")
