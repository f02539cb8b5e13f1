"""Container images as virtual environments, built from exactly their Dockerfile's context.

A Dockerfile of this repo is read instruction by instruction (the subset our Dockerfiles
use: ``ARG``, ``FROM``, ``WORKDIR``, ``COPY``, ``RUN pip install <spec> [&& rm -rf DIR]``,
``ENV``, ``USER``, ``EXPOSE``, ``ENTRYPOINT``, ``CMD``; anything else is an error naming the
line). ``COPY`` places files of the build context into the image's tree; ``RUN pip install
".[extras]"`` builds a wheel from the tree's working directory (what was copied there, and
nothing else) and installs it, non-editable, with those extras and their dependencies, into
a fresh virtual environment that stands for the image's interpreter; ``rm -rf`` removes the
copied sources again. The base image is not pulled: its Python is this machine's, its system
directories the host's, and its user database (``BASE_IMAGES``) is the real image's.

An image is built once per content (Dockerfile, copied files, Python): the result is kept
under a directory named by that digest (older builds of the Dockerfile are removed), so a
test session pays one install per image, and a session on unchanged sources none.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# The user database and environment of each base image, as shipped (python:3.12-slim is
# Debian's base-passwd: no entry for 65532, the uid our images run as).
_DEBIAN_PASSWD = """\
root:x:0:0:root:/root:/bin/bash
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
bin:x:2:2:bin:/bin:/usr/sbin/nologin
sys:x:3:3:sys:/dev:/usr/sbin/nologin
sync:x:4:65534:sync:/bin:/bin/sync
games:x:5:60:games:/usr/games:/usr/sbin/nologin
man:x:6:12:man:/var/cache/man:/usr/sbin/nologin
lp:x:7:7:lp:/var/spool/lpd:/usr/sbin/nologin
mail:x:8:8:mail:/var/mail:/usr/sbin/nologin
news:x:9:9:news:/var/spool/news:/usr/sbin/nologin
uucp:x:10:10:uucp:/var/spool/uucp:/usr/sbin/nologin
proxy:x:13:13:proxy:/bin:/usr/sbin/nologin
www-data:x:33:33:www-data:/var/www:/usr/sbin/nologin
backup:x:34:34:backup:/var/backups:/usr/sbin/nologin
list:x:38:38:Mailing List Manager:/var/list:/usr/sbin/nologin
irc:x:39:39:ircd:/run/ircd:/usr/sbin/nologin
_apt:x:42:65534::/nonexistent:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
"""
_DEBIAN_GROUP = "".join(
    f"{name}:x:{gid}:\n"
    for name, gid in [
        ("root", 0),
        ("daemon", 1),
        ("bin", 2),
        ("sys", 3),
        ("adm", 4),
        ("tty", 5),
        ("disk", 6),
        ("lp", 7),
        ("mail", 8),
        ("news", 9),
        ("uucp", 10),
        ("man", 12),
        ("proxy", 13),
        ("kmem", 15),
        ("staff", 50),
        ("users", 100),
        ("nogroup", 65534),
    ]
)


@dataclass(frozen=True)
class BaseImage:
    passwd: str
    group: str
    env: dict[str, str]


BASE_IMAGES = {
    "python:3.12-slim": BaseImage(
        _DEBIAN_PASSWD,
        _DEBIAN_GROUP,
        {"PATH": "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
    ),
}


@dataclass(frozen=True)
class Image:
    """What a container of this image starts from."""

    dockerfile: Path
    venv: Path  # the image's interpreter and site-packages
    tree: Path  # files COPY left in the image, at their paths under this directory
    base: BaseImage
    env: dict[str, str] = field(default_factory=dict)
    user: str = ""  # USER: "uid[:gid]" or a name; empty: root
    workdir: str = "/"
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    @property
    def site_packages(self) -> Path:
        return next((self.venv / "lib").glob("python*/site-packages"))


class DockerfileError(Exception):
    pass


def _instructions(text: str) -> list[tuple[int, str, str]]:
    """(line number, instruction, arguments), continuation lines joined, comments dropped."""
    found, pending, start = [], "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        word, _, rest = (pending + stripped).partition(" ")
        found.append((start, word.upper(), rest.strip()))
        pending = ""
    return found


def _exec_form(text: str) -> tuple[str, ...]:
    value = json.loads(text) if text.startswith("[") else ["/bin/sh", "-c", text]
    return tuple(str(v) for v in value)


def _digest(dockerfile: Path, context: Path, sources: list[str]) -> str:
    h = hashlib.sha256(dockerfile.read_bytes() + sys.version.encode())
    for source in sources:
        root = context / source
        for path in sorted([root, *root.rglob("*")] if root.is_dir() else [root]):
            if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path):
                h.update(str(path.relative_to(context)).encode() + path.read_bytes())
    return h.hexdigest()[:16]


def build_image(dockerfile: Path, context: Path, cache: Path) -> Image:
    """The image of ``dockerfile`` with build context ``context``, built or taken from ``cache``."""
    steps = _instructions(dockerfile.read_text())
    sources = [w for _, op, rest in steps if op == "COPY" for w in shlex.split(rest)[:-1]]
    where = cache.absolute() / f"{dockerfile.parent.name}-{_digest(dockerfile, context, sources)}"
    cache.mkdir(parents=True, exist_ok=True)
    # Test files on other workers build the same images at once: one builds, the rest wait.
    with open(cache.absolute() / f".{dockerfile.parent.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        image = _interpret(dockerfile, context, steps, where, build=not (where / ".built").exists())
        (where / ".built").touch()
        for stale in cache.absolute().glob(f"{dockerfile.parent.name}-*"):  # older builds
            if stale != where:
                shutil.rmtree(stale, ignore_errors=True)
    return image


def _interpret(
    dockerfile: Path, context: Path, steps: list[tuple[int, str, str]], where: Path, build: bool
) -> Image:
    if build and where.exists():
        shutil.rmtree(where)
    venv, tree = where / "venv", where / "tree"
    args: dict[str, str] = {}
    base: BaseImage | None = None
    env: dict[str, str] = {}
    config: dict[str, object] = {"user": "", "workdir": "/", "entrypoint": (), "cmd": ()}

    def inside(path: str) -> Path:
        absolute = path if path.startswith("/") else f"{config['workdir']}/{path}"
        return tree / os.path.normpath(absolute).lstrip("/")

    for number, op, rest in steps:
        here = f"{dockerfile}:{number}"
        if op == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        elif op == "FROM":
            ref = rest.replace("${", "{").format(**args) if "${" in rest else rest
            if ref not in BASE_IMAGES:
                raise DockerfileError(f"{here}: base image {ref} is not played by the harness")
            base, env = BASE_IMAGES[ref], dict(BASE_IMAGES[ref].env)
        elif op == "WORKDIR":
            config["workdir"] = rest
        elif op == "COPY":
            *srcs, dest = shlex.split(rest)
            if build:
                for src in srcs:
                    target = inside(dest)
                    if dest.endswith("/") or len(srcs) > 1:
                        target = target / Path(src).name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if (context / src).is_dir():
                        shutil.copytree(context / src, target, dirs_exist_ok=True)
                    else:
                        shutil.copy2(context / src, target)
        elif op == "RUN":
            _run(here, rest, inside, venv, build)
        elif op == "ENV":
            for word in shlex.split(rest):
                name, _, value = word.partition("=")
                env[name] = value
        elif op == "USER":
            config["user"] = rest
        elif op in ("ENTRYPOINT", "CMD"):
            config[op.lower()] = _exec_form(rest)
        elif op != "EXPOSE":
            raise DockerfileError(f"{here}: {op} is not played by the harness")
    if base is None:
        raise DockerfileError(f"{dockerfile}: no FROM")
    env["PATH"] = f"{venv}/bin:{env.get('PATH', '/usr/bin:/bin')}"
    return Image(
        dockerfile,
        venv,
        tree,
        base,
        env,
        str(config["user"]),
        str(config["workdir"]),
        tuple(config["entrypoint"]),
        tuple(config["cmd"]),  # type: ignore[arg-type]
    )


def _run(here: str, command: str, inside: object, venv: Path, build: bool) -> None:
    """``pip install [options] SPEC [&& rm -rf DIR]``: SPEC ``.[extras]`` is built from the
    working directory's copied files into a wheel, which is installed with those extras."""
    assert callable(inside)
    for part in (p.strip() for p in command.split("&&")):
        words = shlex.split(part)
        if words[:2] == ["pip", "install"]:
            spec = next(w for w in words[2:] if not w.startswith("-"))
            project, _, extras = spec.partition("[")
            if not build:
                continue
            source = inside(project)
            with tempfile.TemporaryDirectory() as wheels:
                _check(
                    here,
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "wheel",
                        "-q",
                        "--no-deps",
                        "--no-build-isolation",
                        "-w",
                        wheels,
                        str(source),
                    ],
                )
                (wheel,) = Path(wheels).glob("*.whl")
                # The image's interpreter gets no pip of its own (ensurepip costs seconds per
                # image): this pip installs into it, as the image's pip would.
                _check(here, [sys.executable, "-m", "venv", "--without-pip", str(venv)])
                requirement = f"{wheel}[{extras}" if extras else str(wheel)
                _check(
                    here,
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "--python",
                        str(venv / "bin" / "python"),
                        "install",
                        "-q",
                        "--disable-pip-version-check",
                        requirement,
                    ],
                )
        elif words[:2] == ["rm", "-rf"]:
            if build:
                for target in words[2:]:
                    shutil.rmtree(inside(target), ignore_errors=True)
        else:
            raise DockerfileError(f"{here}: RUN {part!r} is not played by the harness")


def _check(here: str, argv: list[str]) -> None:
    """Run a build step in a clean environment: nothing of the test's own PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise DockerfileError(f"{here}: {' '.join(argv)} failed: {done.stderr[-3000:]}")
