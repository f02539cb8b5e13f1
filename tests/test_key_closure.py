"""What a kernel's compile read, as the explanation of a refusal: the key is its IR.

One real CPU compile of a kernel package whose constant comes through every way a kernel
module can reach code or data (import mechanisms, data files, shared libraries, installed
distributions, ``.pth`` hooks, the environment). Then each case changes one thing and asks a
strict serving view of the application for the kernel through the disk layer:

- RELEVANT: the change changes the traced kernel; it must be refused (its IR is not in the
  generation), and the refusal must name the file, distribution or variable that moved, from
  the record of what the compile read (``kernelcache.runtime.observe``).
- IRRELEVANT: the change leaves the traced kernel as it was; it must load.

Most cases ask a child forked from one worker that imported the DSL once (the child imports
the package fresh, after the change); the ones whose change takes effect at interpreter start
(a ``.pth`` hook, the module it imports) run a fresh serving process, end to end. Every process
runs in a private virtual environment layered on the installed one, so its ``.pth`` hooks are
this test's alone."""

from __future__ import annotations

import contextlib
import json
import os
import py_compile
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    REPO,
    needs_cute,
    scaled,
    system_tool,
)
from tests.helpers.wheels import build_wheel

pytestmark = [pytest.mark.slow, needs_cute]

PACKAGE = "kcpkg"
KERNEL = '''\
"""A kernel whose scale comes through every mechanism a kernel module can use."""

import ctypes
import importlib.resources
import importlib.util
import json
import os
import pkgutil
import runpy
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import cutlass
import cutlass.cute as cute
import yaml

import kc_ext
import kcwheel_kc_extra
import kc_loose
import profile as local_profile

HERE = Path(__file__).parent
VALUES = {}
VALUES["relative"] = import_module(".tiles", __package__).VALUE
VALUES["keyword"] = import_module(name="kc_helper").VALUE
NAME = "kc_" + "computed"
VALUES["computed"] = import_module(NAME).VALUE
scope = {}
exec(open(HERE / "exec_me.py").read(), scope)
VALUES["exec"] = scope["VALUE"]
VARIANT = os.environ.get("KC_VARIANT", "variant_a")
VALUES["variant"] = import_module(f"{__package__}.{VARIANT}").VALUE
VALUES["profile"] = getattr(local_profile, "VALUE", 7)
VALUES["dist"] = len(kcwheel_kc_extra.BUILD)
VALUES["loose"] = kc_loose.VALUE
VALUES["extension"] = kc_ext.value()
VALUES["json"] = json.loads((HERE / "tiles.json").read_text())["value"]
VALUES["yaml"] = yaml.safe_load((HERE / "tiles.yaml").read_text())["value"]
VALUES["toml"] = tomllib.loads((HERE / "tiles.toml").read_text())["value"]
VALUES["pth"] = getattr(sys, "kc_patch_value", 0)
spec = importlib.util.spec_from_file_location("kc_by_path", HERE / "loaded_by_path.py")
by_path = importlib.util.module_from_spec(spec)
spec.loader.exec_module(by_path)
VALUES["by_path"] = by_path.VALUE
VALUES["dunder"] = __import__("kc_" + "dunder").VALUE
VALUES["runpy"] = runpy.run_path(str(HERE / "run_me.py"))["VALUE"]
VALUES["sourceless"] = import_module("kc_" + "sourceless").VALUE
sys.path.insert(0, str(HERE / "bundle.zip"))
VALUES["zipped"] = import_module("kc_" + "zipped").VALUE
VALUES["namespace"] = import_module("kc_ns" + ".part").VALUE
VALUES["ctypes"] = ctypes.CDLL(str(HERE / "libkcctypes.so")).kc_value()
VALUES["pkgutil"] = int(pkgutil.get_data(__package__, "data.bin"))
VALUES["resources"] = int(importlib.resources.files(__package__).joinpath("res.txt").read_text())
VALUES["env_get"] = int(os.environ.get("KC_THREADS", "1"))
VALUES["env_in"] = 1 if "KC_FLAG" in os.environ else 0
VALUES["env_file"] = int(Path(os.environ["KC_TILE_FILE"]).read_text())
VALUES["cwd_file"] = json.loads(open("cwd_tiles.json").read())["value"]
try:
    VALUES["optional"] = import_module("kc_" + "optional").VALUE
except ImportError:
    VALUES["optional"] = 0
SCALE = float(sum(VALUES.values()))


def compile_time_bonus():
    """Read while the DSL traces the kernel, not at import."""
    return float((HERE / "trace.txt").read_text())


@cute.kernel
def scale_kernel(g_a: cute.Tensor, g_b: cute.Tensor, factor: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    m, n = g_a.shape
    if i < m * n:
        g_b[i // n, i % n] = g_a[i // n, i % n] * factor


@cute.jit
def scale(m_a: cute.Tensor, m_b: cute.Tensor):
    m, n = m_a.shape
    scale_kernel(m_a, m_b, SCALE + compile_time_bonus()).launch(
        grid=((m * n + 127) // 128, 1, 1), block=(128, 1, 1)
    )
'''
C_DEP = "int kcdep_value(void) { return %d; }\n"
C_CTYPES = "int kc_value(void) { return %d; }\n"
C_EXTENSION = """\
#include <Python.h>
extern int kcdep_value(void);
static PyObject *value(PyObject *self, PyObject *args) { return PyLong_FromLong(kcdep_value()); }
static PyMethodDef methods[] = {{"value", value, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kc_ext", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kc_ext(void) { return PyModule_Create(&module); }
/* build %d */
"""
APP_FILES = {
    f"{PACKAGE}/__init__.py": "",
    f"{PACKAGE}/kernel.py": KERNEL,
    f"{PACKAGE}/tiles.py": "VALUE = 1\n",
    f"{PACKAGE}/exec_me.py": "VALUE = 1\n",
    f"{PACKAGE}/variant_a.py": "VALUE = 1\n",
    f"{PACKAGE}/variant_b.py": "VALUE = 2\n",
    f"{PACKAGE}/loaded_by_path.py": "VALUE = 1\n",
    f"{PACKAGE}/run_me.py": "VALUE = 1\n",
    f"{PACKAGE}/unused_helper.py": "VALUE = 1\n",
    f"{PACKAGE}/tiles.json": '{"value": 1}\n',
    f"{PACKAGE}/tiles.yaml": "value: 1\n",
    f"{PACKAGE}/tiles.toml": "value = 1\n",
    f"{PACKAGE}/unread.json": '{"value": 1}\n',
    f"{PACKAGE}/data.bin": "1\n",
    f"{PACKAGE}/res.txt": "1\n",
    f"{PACKAGE}/trace.txt": "1\n",
    "kc_helper.py": 'import os\n\nVALUE = 1 + (os.getenv("KC_HELPER_MODE") == "fast")\n',
    "kc_computed.py": "VALUE = 1\n",
    "kc_dunder.py": "VALUE = 1\n",
    "kc_ns/part.py": "VALUE = 1\n",
    "profile.py": "VALUE = 1  # shares its name with the standard library's profile\n",
}
PATCH_MODULE = "import sys\n\nsys.kc_patch_value = 1  # a hook that patches the DSL at start\n"
WORKER = r"""
import json, os, sys
from kernelcache.errors import ColdCompileError
from kernelcache.runtime import cute as layer
mode, root = sys.argv[1], sys.argv[2]
layer.install()
import cutlass
from cutlass.cute.runtime import make_fake_compact_tensor

t = make_fake_compact_tensor(cutlass.Float32, (128, 128), stride_order=(1, 0), assumed_align=16)


def attempt():
    from kcpkg import kernel

    cache = layer.CuteDiskCache(root, strict=mode not in ("warm", "permissive"))
    try:
        cache.compile(kernel.scale, t, t)
    except ColdCompileError as exc:
        return {"outcome": "refused", "message": str(exc)}
    return {"outcome": "hit" if cache.stats.hits else "compiled"}


if mode != "check":
    print(json.dumps(attempt()))
    sys.exit(0)
for line in sys.stdin:  # each question in a child: the package imported after the change
    request = json.loads(line)
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reader)
        os.environ.update(request["env"])
        for name in request["unset"]:
            os.environ.pop(name, None)
        if request["cwd"]:
            os.chdir(request["cwd"])
        try:
            answer = attempt()
        except BaseException as exc:
            answer = {"outcome": "error", "message": f"{type(exc).__name__}: {exc}"}
        os.write(writer, json.dumps(answer).encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        print(pipe.read(), flush=True)
    os.waitpid(pid, 0)
"""


# --- the world ---------------------------------------------------------------------------


@dataclass
class World:
    root: Path  # the generation's cute-dsl directory
    app: Path  # the application folder on PYTHONPATH
    site: Path  # the private environment's site-packages
    python: Path
    work: Path  # the working directory
    tile_file: Path
    wheels: dict[str, Path]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def package(self) -> Path:
        return self.app / PACKAGE

    def run(self, mode: str, app: Path | None = None, cwd: Path | None = None, **env: str):
        environment = {**self.env, **env}
        if app is not None:
            environment["PYTHONPATH"] = f"{app}{os.pathsep}{REPO / 'src'}"
        proc = subprocess.run(
            self.worker(mode, self.root),
            env=environment,
            cwd=cwd or self.work,
            capture_output=True,
            text=True,
            timeout=scaled(600),
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def worker(self, mode: str, root: Path) -> list[str]:
        return [str(self.python), str(self.work.parent / "bin" / "worker.py"), mode, str(root)]

    def install(self, wheel: str) -> None:
        """One build of kc-extra, as the only one installed."""
        for old in [*self.site.glob("kc_extra-*.dist-info"), self.site / "kcwheel_kc_extra"]:
            shutil.rmtree(old, ignore_errors=True)
        self.pip(self.wheels[wheel])

    def pip(self, *wheels: Path) -> None:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--isolated",
                "--no-index",
                "--no-deps",
                "--disable-pip-version-check",
                "--no-cache-dir",
                "--quiet",
                "--upgrade",
                "--target",
                str(self.site),
                *map(str, wheels),
            ],
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        assert proc.returncode == 0, proc.stderr


def _compile_c(compiler: str, source: str, out: Path, *flags: str) -> None:
    src = out.with_name(out.name + ".c")
    src.write_text(source)
    subprocess.run(
        [compiler, "-x", "c", "-shared", "-fPIC", "-O1", str(src), "-o", str(out), *flags],
        check=True,
        capture_output=True,
        timeout=scaled(120),
    )
    src.unlink()


def _shared_site() -> str:
    return sysconfig.get_paths()["purelib"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    """The package warmed once: the compile's record is in the generation's directory."""
    compiler = system_tool("g++")
    base = tmp_path_factory.mktemp("closure")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_dir = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # The installed environment as a plain path (its .pth hooks are other tests' business),
    # and the DSL's own hook, as the DSL's .pth writes it.
    (site_dir / "_installed.pth").write_text(
        f"{_shared_site()}\nimport os, sys, nvidia_cutlass_dsl; sys.path.insert(0, "
        "os.path.join(nvidia_cutlass_dsl.__path__[0], 'dsl_packages'))\n"
    )
    (site_dir / "kc_patch.pth").write_text("import kc_dslpatch\n")
    (site_dir / "kc_dslpatch.py").write_text(PATCH_MODULE)
    (site_dir / "kc_loose.py").write_text("VALUE = 1  # copied in, no RECORD lists it\n")
    wheels = {
        "1.0": build_wheel(base / "wheels-1.0", "kc-extra", "1.0"),
        "2.0": build_wheel(base / "wheels-2.0", "kc-extra", "2.0"),
        "1.0-rebuilt": build_wheel(base / "wheels-rebuilt", "kc-extra", "1.0", build="22"),
        "unrelated": build_wheel(base / "wheels-other", "kc-unrelated", "1.0"),
    }
    app = base / "app"
    for relative, text in APP_FILES.items():
        (app / relative).parent.mkdir(parents=True, exist_ok=True)
        (app / relative).write_text(text)
    (base / "scratch").mkdir()
    sourceless = base / "scratch" / "kc_sourceless.py"
    sourceless.write_text("VALUE = 1\n")
    py_compile.compile(str(sourceless), cfile=str(app / "kc_sourceless.pyc"), doraise=True)
    with zipfile.ZipFile(app / PACKAGE / "bundle.zip", "w") as bundle:
        bundle.writestr("kc_zipped.py", "VALUE = 1\n")
    (app / "lib").mkdir()
    _compile_c(compiler, C_DEP % 1, app / "lib" / "libkcdep.so")
    _compile_c(compiler, C_CTYPES % 1, app / PACKAGE / "libkcctypes.so")
    _compile_c(
        compiler,
        C_EXTENSION % 1,
        app / f"kc_ext{sysconfig.get_config_var('EXT_SUFFIX')}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-L{app / 'lib'}",
        "-lkcdep",
        "-Wl,-rpath,$ORIGIN/lib",
    )
    work = base / "work"
    work.mkdir()
    (work / "cwd_tiles.json").write_text('{"value": 1}\n')
    tile_file = base / "config" / "tile.txt"
    tile_file.parent.mkdir()
    tile_file.write_text("1\n")
    (base / "bin").mkdir()
    (base / "bin" / "worker.py").write_text(WORKER)  # its folder comes first on sys.path
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERNELCACHE_", "CUTE_DSL_"))}
    env.update(
        PYTHONPATH=f"{app}{os.pathsep}{REPO / 'src'}",
        CUTE_DSL_ARCH="sm_90a",
        KC_TILE_FILE=str(tile_file),
        PYTHONDONTWRITEBYTECODE="1",
    )
    found = World(base / "generation" / "cute-dsl", app, site_dir, python, work, tile_file, wheels)
    found.env = env
    found.install("1.0")
    warmed = found.run("warm")
    assert warmed["outcome"] == "compiled", warmed
    assert found.run("serve")["outcome"] == "hit"  # the baseline: a strict process loads it
    return found


@pytest.fixture(scope="module")
def checker(world: World) -> Iterator[Callable[..., dict[str, Any]]]:
    """A strict serving worker; each call is answered by a child forked from it."""
    proc = subprocess.Popen(
        world.worker("check", world.root),
        env=world.env,
        cwd=world.work,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def ask(env: dict[str, str], unset: tuple[str, ...] = (), cwd: Path | None = None) -> Any:
        request = {"env": env, "unset": list(unset), "cwd": str(cwd) if cwd else None}
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else "the checker exited"
        return json.loads(line)

    yield ask
    proc.stdin.close()
    proc.wait(timeout=scaled(60))


# --- changes -----------------------------------------------------------------------------


@contextlib.contextmanager
def replaced(path: Path, data: bytes | str) -> Iterator[None]:
    """``path`` holds ``data`` (a new file, renamed in), then its old bytes and times again."""
    old = path.read_bytes()
    st = path.stat()
    _write(path, data.encode() if isinstance(data, str) else data)
    try:
        yield
    finally:
        _write(path, old)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def added(path: Path, data: str) -> Iterator[None]:
    path.write_text(data)
    try:
        yield
    finally:
        path.unlink()


@contextlib.contextmanager
def removed(path: Path) -> Iterator[None]:
    aside = path.with_name(f".{path.name}.aside")
    path.rename(aside)
    try:
        yield
    finally:
        aside.rename(path)


@contextlib.contextmanager
def touched(path: Path) -> Iterator[None]:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 7_000_000_000))
    try:
        yield
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@contextlib.contextmanager
def rewritten(path: Path) -> Iterator[None]:
    """The same bytes as a new file (another inode, another time)."""
    with replaced(path, path.read_bytes()):
        yield


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


@contextlib.contextmanager
def installed(w: World, wheel: str) -> Iterator[None]:
    w.install(wheel)
    try:
        yield
    finally:
        w.install("1.0")


@contextlib.contextmanager
def installed_beside(w: World, wheel: str) -> Iterator[None]:
    w.pip(w.wheels[wheel])
    try:
        yield
    finally:
        for path in w.site.glob("kc_unrelated*"):
            shutil.rmtree(path)
        shutil.rmtree(w.site / "kcwheel_kc_unrelated")


def _rebuilt_c(w: World, source: str, path: Path) -> bytes:
    out = w.work.parent / "scratch" / f"rebuilt-{path.name}"
    _compile_c(system_tool("g++"), source, out, *_extension_flags(w, path))
    return out.read_bytes()


def _extension_flags(w: World, path: Path) -> tuple[str, ...]:
    if not path.name.startswith("kc_ext"):
        return ()
    lib = w.app / "lib"
    return (
        f"-I{sysconfig.get_paths()['include']}",
        f"-L{lib}",
        "-lkcdep",
        "-Wl,-rpath,$ORIGIN/lib",
    )


def _sourceless(w: World, text: str) -> bytes:
    source = w.work.parent / "scratch" / "kc_sourceless.py"
    source.write_text(text)
    out = source.with_suffix(".pyc")
    py_compile.compile(str(source), cfile=str(out), doraise=True)
    return out.read_bytes()


def _zip(text: str) -> bytes:
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        bundle.writestr("kc_zipped.py", text)
    return buffer.getvalue()


def _extra_module(w: World) -> Path:
    return w.site / "kcwheel_kc_extra" / "__init__.py"


@dataclass(frozen=True)
class Case:
    name: str
    change: Callable[[World], contextlib.AbstractContextManager[None]] = lambda w: nothing()
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    cwd: Callable[[World], Path] | None = None
    names: str = ""  # what a refusal must name


def p(w: World, relative: str) -> Path:
    return w.app / relative


RELEVANT = [
    # import mechanisms
    Case("import_module('.tiles', __package__)",
         lambda w: replaced(p(w, "kcpkg/tiles.py"), "VALUE = 2\n"), names="kcpkg/tiles.py"),
    Case("import_module(name='kc_helper')",
         lambda w: replaced(p(w, "kc_helper.py"), "VALUE = 2\n"), names="kc_helper.py"),
    Case("import_module(NAME), the name computed",
         lambda w: replaced(p(w, "kc_computed.py"), "VALUE = 2\n"), names="kc_computed.py"),
    Case("__import__ of a computed name",
         lambda w: replaced(p(w, "kc_dunder.py"), "VALUE = 2\n"), names="kc_dunder.py"),
    Case("exec(open(...).read())",
         lambda w: replaced(p(w, "kcpkg/exec_me.py"), "VALUE = 2\n"), names="exec_me.py"),
    Case("importlib.util.spec_from_file_location",
         lambda w: replaced(p(w, "kcpkg/loaded_by_path.py"), "VALUE = 2\n"),
         names="loaded_by_path.py"),
    Case("runpy.run_path",
         lambda w: replaced(p(w, "kcpkg/run_me.py"), "VALUE = 2\n"), names="run_me.py"),
    Case("a helper chosen by an application variable", env={"KC_VARIANT": "variant_b"},
         names="KC_VARIANT"),
    Case("a local profile.py (a standard-library name)",
         lambda w: replaced(p(w, "profile.py"), "VALUE = 2\n"), names="profile.py"),
    Case("a .pyc-only module",
         lambda w: replaced(p(w, "kc_sourceless.pyc"), _sourceless(w, "VALUE = 2\n")),
         names="kc_sourceless.pyc"),
    Case("a module in a zip archive on sys.path",
         lambda w: replaced(p(w, "kcpkg/bundle.zip"), _zip("VALUE = 2\n")),
         names="bundle.zip"),
    Case("a module of a namespace package",
         lambda w: replaced(p(w, "kc_ns/part.py"), "VALUE = 2\n"), names="kc_ns/part.py"),
    Case("an optional module, absent at warm, appears",
         lambda w: added(p(w, "kc_optional.py"), "VALUE = 5\n"), names="kc_optional"),
    # data files read by kernel modules
    Case("a tile-config JSON read at import",
         lambda w: replaced(p(w, "kcpkg/tiles.json"), '{"value": 2}\n'), names="tiles.json"),
    Case("a tile-config YAML read at import",
         lambda w: replaced(p(w, "kcpkg/tiles.yaml"), "value: 2\n"), names="tiles.yaml"),
    Case("a TOML read at import",
         lambda w: replaced(p(w, "kcpkg/tiles.toml"), "value = 2\n"), names="tiles.toml"),
    Case("pkgutil.get_data",
         lambda w: replaced(p(w, "kcpkg/data.bin"), "2\n"), names="data.bin"),
    Case("importlib.resources",
         lambda w: replaced(p(w, "kcpkg/res.txt"), "2\n"), names="res.txt"),
    Case("a file read relative to the working directory",
         lambda w: replaced(w.work / "cwd_tiles.json", '{"value": 2}\n'),
         names="cwd_tiles.json"),
    Case("a file read while the DSL traces the kernel",
         lambda w: replaced(p(w, "kcpkg/trace.txt"), "2\n"), names="trace.txt"),
    Case("the file a path-valued variable names, edited",
         lambda w: replaced(w.tile_file, "2\n"), names="KC_TILE_FILE"),
    # shared libraries
    Case("a shared library an extension links",
         lambda w: replaced(p(w, "lib/libkcdep.so"),
                            _rebuilt_c(w, C_DEP % 2, p(w, "lib/libkcdep.so"))),
         names="libkcdep.so"),
    Case("a library loaded with ctypes.CDLL",
         lambda w: replaced(p(w, "kcpkg/libkcctypes.so"),
                            _rebuilt_c(w, C_CTYPES % 2, p(w, "kcpkg/libkcctypes.so"))),
         names="libkcctypes.so"),
    # installed distributions
    Case("the same version rebuilt", lambda w: installed(w, "1.0-rebuilt"), names="kc-extra"),
    Case("a distribution's file edited in place, its RECORD untouched",
         lambda w: replaced(_extra_module(w), 'BUILD = "patched"\n'),
         names="kcwheel_kc_extra/__init__.py"),
    Case("a module copied into site-packages without a RECORD",
         lambda w: replaced(w.site / "kc_loose.py", "VALUE = 2\n"), names="kc_loose.py"),
    # environment
    Case("a variable read with os.environ.get in the kernel module", env={"KC_THREADS": "2"},
         names="KC_THREADS"),
    Case("a variable read with os.getenv in a helper", env={"KC_HELPER_MODE": "fast"},
         names="KC_HELPER_MODE"),
    Case("a variable tested with `in`, unset at warm, set", env={"KC_FLAG": "1"},
         names="KC_FLAG"),
    Case("a path-valued variable pointed at another file", env={"KC_TILE_FILE": "OTHER"},
         names="KC_TILE_FILE"),
]  # fmt: skip

IRRELEVANT = [
    Case("the extension rebuilt, what it returns the same",
         lambda w: replaced(next(w.app.glob("kc_ext*.so")),
                            _rebuilt_c(w, C_EXTENSION % 2, next(w.app.glob("kc_ext*.so"))))),
    Case("a sitecustomize appears", lambda w: added(p(w, "sitecustomize.py"), "import sys\n")),
    Case("a distribution upgraded, its module the same", lambda w: installed(w, "2.0")),
    Case("the .pth hook rewritten to do the same",
         lambda w: replaced(w.site / "kc_patch.pth", "import kc_dslpatch; import sys\n")),
    Case("a new .pth hook", lambda w: added(w.site / "kc_more.pth", "import sys\n")),
    Case("a helper module touched", lambda w: touched(p(w, "kcpkg/tiles.py"))),
    Case("a helper module rewritten with the same bytes",
         lambda w: rewritten(p(w, "kcpkg/tiles.py"))),
    Case("the JSON touched", lambda w: touched(p(w, "kcpkg/tiles.json"))),
    Case("the YAML rewritten with the same bytes", lambda w: rewritten(p(w, "kcpkg/tiles.yaml"))),
    Case("the shared library touched", lambda w: touched(p(w, "lib/libkcdep.so"))),
    Case("the shared library rewritten with the same bytes",
         lambda w: rewritten(p(w, "lib/libkcdep.so"))),
    Case("the local profile.py touched", lambda w: touched(p(w, "profile.py"))),
    Case("the zip archive rewritten with the same bytes",
         lambda w: rewritten(p(w, "kcpkg/bundle.zip"))),
    Case("the .pth hook touched", lambda w: touched(w.site / "kc_patch.pth")),
    Case("a distribution's file touched", lambda w: touched(_extra_module(w))),
    Case("the same wheel installed again", lambda w: installed(w, "1.0")),
    Case("an unrelated distribution installed", lambda w: installed_beside(w, "unrelated")),
    Case("a new file beside the kernel", lambda w: added(p(w, "kcpkg/NOTES.txt"), "notes\n")),
    Case("a new module nobody imports", lambda w: added(p(w, "kc_unused.py"), "VALUE = 9\n")),
    Case("a module nobody imports, edited",
         lambda w: replaced(p(w, "kcpkg/unused_helper.py"), "VALUE = 9\n")),
    Case("a data file nobody reads, edited",
         lambda w: replaced(p(w, "kcpkg/unread.json"), '{"value": 9}\n')),
    Case("a file added to the generation", lambda w: added(w.root / "extra.txt", "x\n")),
    Case("a path-valued variable pointed at a copy with the same bytes",
         env={"KC_TILE_FILE": "COPY"}),
    Case("another working directory holding the same file", cwd=lambda w: _other_work(w)),
    Case("HOME", env={"HOME": "/nonexistent/home"}),
    Case("TMPDIR", env={"TMPDIR": "/var/tmp"}),
    Case("PATH", env={"PATH": "/usr/bin"}),
    Case("LANG and LC_ALL", env={"LANG": "C", "LC_ALL": "C"}),
    Case("TZ", env={"TZ": "Asia/Tokyo"}),
    Case("HOSTNAME and USER", env={"HOSTNAME": "elsewhere", "USER": "nobody"}),
    Case("CUDA_VISIBLE_DEVICES", env={"CUDA_VISIBLE_DEVICES": "3"}),
    Case("an unrelated variable", env={"SOME_APP_SETTING": "1"}),
    Case("a location setting of the DSL", env={"CUTE_DSL_CACHE_DIR": "/elsewhere"}),
    Case("a DSL setting that does not change code", env={"CUTE_DSL_LOG_LEVEL": "10"}),
    Case("a kernelcache variable", env={"KERNELCACHE_METRICS_PORT": "9999"}),
]  # fmt: skip


def _other_work(w: World) -> Path:
    other = w.work.parent / "other-work"
    if not other.exists():
        other.mkdir()
        shutil.copy(w.work / "cwd_tiles.json", other / "cwd_tiles.json")
    return other


def _case_env(w: World, case: Case) -> dict[str, str]:
    if case.env.get("KC_TILE_FILE") in ("COPY", "OTHER"):
        copy = w.work.parent / case.env["KC_TILE_FILE"].lower() / "tile.txt"
        copy.parent.mkdir(exist_ok=True)
        shutil.copy(w.tile_file, copy)
        if case.env["KC_TILE_FILE"] == "OTHER":
            copy.write_text("2\n")
        return {"KC_TILE_FILE": str(copy)}
    return case.env


def _ask(world: World, checker: Callable[..., Any], case: Case) -> dict[str, Any]:
    with case.change(world):
        cwd = case.cwd(world) if case.cwd else None
        return checker(_case_env(world, case), case.unset, cwd)


@pytest.mark.parametrize("case", RELEVANT, ids=lambda c: c.name)
def test_a_relevant_change_is_refused_naming_it(world, checker, case):
    answer = _ask(world, checker, case)
    assert answer["outcome"] == "refused", f"{case.name}: served stale ({answer})"
    assert "no kernel compiled from this IR" in answer["message"], answer["message"]
    assert case.names in answer["message"].partition("since its compile:")[2], answer["message"]


@pytest.mark.parametrize("case", IRRELEVANT, ids=lambda c: c.name)
def test_an_irrelevant_change_still_loads(world, checker, case):
    answer = _ask(world, checker, case)
    assert answer["outcome"] == "hit", f"{case.name}: {answer}"


def test_the_case_counts(world, checker):
    """What docs/RELIABILITY.md records: 0 false hits and 0 false misses in these cases."""
    assert len(RELEVANT) >= 30 and len(IRRELEVANT) >= 30
    assert checker({}, (), None)["outcome"] == "hit"  # every case above restored its change


# --- end to end: fresh strict serving processes --------------------------------------------


@pytest.mark.parametrize(
    ("change", "env", "names"),
    [
        pytest.param(lambda w: removed(p(w, "profile.py")), {}, "profile", id="profile-removed"),
        pytest.param(
            lambda w: replaced(p(w, "kcpkg/tiles.json"), '{"value": 2}\n'),
            {},
            "tiles.json",
            id="tile-json",
        ),
        pytest.param(lambda w: nothing(), {"KC_VARIANT": "variant_b"}, "KC_VARIANT", id="variant"),
        pytest.param(
            lambda w: removed(w.site / "kc_patch.pth"), {}, "kc_patch.pth", id="pth-removed"
        ),
        pytest.param(
            lambda w: replaced(w.site / "kc_dslpatch.py", PATCH_MODULE.replace("= 1", "= 2")),
            {},
            "kc_dslpatch.py",
            id="pth-imported-module",
        ),
    ],
)
def test_strict_serving_refuses_a_stale_kernel_naming_the_file(world, change, env, names):
    with change(world):
        answer = world.run("serve", **env)
    assert answer["outcome"] == "refused", answer
    assert names in answer["message"].partition("since its compile:")[2], answer


def test_permissive_serving_compiles_a_changed_kernel(world, tmp_path):
    generation = tmp_path / "cute-dsl"
    shutil.copytree(world.root, generation)
    with replaced(world.package / "tiles.json", '{"value": 2}\n'):
        proc = subprocess.run(
            world.worker("permissive", generation),
            env=world.env,
            cwd=world.work,
            capture_output=True,
            text=True,
            timeout=scaled(600),
        )
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["outcome"] == "compiled", answer
    assert len(list(generation.glob("*.o"))) == 2  # kept beside the one it was compiled from


def test_an_option_that_looks_like_a_path_is_a_setting(world):
    """``CUTE_DSL_COMPILER_OPT=/opt-level=0`` is an option: a stamp factor, and another key."""
    from kernelcache.settings import compile_settings

    assert compile_settings({"CUTE_DSL_COMPILER_OPT": "/opt-level=0"}) == {
        "setting/CUTE_DSL_COMPILER_OPT": "/opt-level=0"
    }
    answer = world.run("serve", CUTE_DSL_COMPILER_OPT="/opt-level=0")
    assert (
        answer["outcome"] == "refused" and "no kernel compiled from this IR" in answer["message"]
    ), answer


def test_the_package_served_from_another_path_and_directory_loads(world):
    """Nothing recorded names a host path: another folder, working directory and HOME hit."""
    moved = world.app.parent / "elsewhere" / "app"
    shutil.copytree(world.app, moved, symlinks=True)
    other = _other_work(world)
    try:
        answer = world.run("serve", app=moved, cwd=other, HOME=str(other))
    finally:
        shutil.rmtree(moved.parent)
    assert answer["outcome"] == "hit", answer


def test_a_library_lookup_by_ctypes_is_not_named_unobserved():
    """``ctypes.util.find_library`` runs ``ldconfig -p`` (or gcc, ld) for a file name; the
    library then loaded is mapped and recorded: no note. Another subprocess is still named."""
    from tests.conftest import subprocess_env

    script = (
        "import ctypes.util, json, subprocess, sys\n"
        "from kernelcache.runtime import observe\n"
        "observe.start()\n"
        "ctypes.util.find_library('c'); ctypes.util.find_library('kc-no-such-library')\n"
        "found = sorted(observe.hooks.seen_so_far.unobserved)\n"
        "subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
        "print(json.dumps([found, sorted(observe.hooks.seen_so_far.unobserved)]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=subprocess_env(), capture_output=True, text=True,
        timeout=scaled(120),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    after_lookup, after_spawn = json.loads(proc.stdout)
    assert after_lookup == []
    assert after_spawn == [f"a subprocess ({sys.executable}): the files it read"]
