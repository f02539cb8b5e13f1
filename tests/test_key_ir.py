"""The CuTe-DSL key is what the kernel compiles to: changes judged against a direct compile.

An application package (``irapp``) builds one kernel per case; a case's value reaches it
through one *trigger* (what changes outside: a variable a C extension reads, a file a
subprocess reads, a ConfigMap-style symlink swap, a SQLite file, ``python -O``, a module that
patches a class, ...) and one *path* (how the value enters the traced kernel: a closure
constant, ``self``, a class attribute, a module global, a default argument, a
``functools.partial``, an explicit argument). Every case kernel is compiled once into a
generation; then each change is applied and a fresh view of the application (a forked child
of one worker per group, or a fresh interpreter where the change is made at start) asks the
disk layer in strict mode for it and also compiles it directly. The direct compile's object
is the truth:

- false hit: strict serving loaded an object other than what the direct compile makes;
- false miss: strict serving refused although the direct compile makes a recorded object.

RELEVANT cases must change the direct compile (checked: the case set is honest) and be
refused; IRRELEVANT ones must not change it and must load.

Besides what reaches the trace, a case may change what the compiler receives after it: the
compile options (a string ``options=``, the bracket form ``cute.compile[cute.OptLevel(1)]``,
``CUTE_DSL_COMPILER_OPT``; spelled out as their defaults, the arch already targeted, options
that only report or dump) and the pipeline itself (a module that wraps the DSL's
``Compiler.compile``). A kernel may be warmed under options of its own (``BASES``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, needs_cute

pytestmark = [pytest.mark.slow, needs_cute]

WORKER = REPO / "tests" / "helpers" / "ir_worker.py"
PATHS = ("closure", "self", "class", "global", "default", "partial", "arg")

KERNELS = '''\
"""Kernels whose scale reaches the trace through each path."""

import functools

import cutlass
import cutlass.cute as cute


@cute.kernel
def _scale(g_a: cute.Tensor, g_b: cute.Tensor, factor: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    g_b[tidx] = g_a[tidx] * factor


def _launch(a, b, factor):
    _scale(a, b, factor).launch(grid=(1, 1, 1), block=(128, 1, 1))


def make_mul(value):
    @cute.jit
    def mul(a: cute.Tensor, b: cute.Tensor):
        _launch(a, b, value)

    return mul


class Scaler:
    def __init__(self, value):
        self.value = value

    @cute.jit
    def run(self, a: cute.Tensor, b: cute.Tensor):
        _launch(a, b, self.value)


class LiteralScaler(Scaler):
    def __init__(self):
        self.value = 2.0


class Tiles:
    factor = 0.0  # set by whoever configures the kernels


@cute.jit
def by_class(a: cute.Tensor, b: cute.Tensor):
    _launch(a, b, Tiles.factor)


FACTOR = 0.0


@cute.jit
def by_global(a: cute.Tensor, b: cute.Tensor):
    _launch(a, b, FACTOR)


def make_default(value):
    @cute.jit
    def by_default(a: cute.Tensor, b: cute.Tensor, factor: cutlass.Constexpr = value):
        _launch(a, b, factor)

    return by_default


@cute.jit
def by_literal_default(a: cute.Tensor, b: cute.Tensor, factor: cutlass.Constexpr = 2.0):
    _launch(a, b, factor)


SCALED = functools.partial(_launch, factor=0.0)


@cute.jit
def by_partial(a: cute.Tensor, b: cute.Tensor):
    SCALED(a, b)


@cute.jit
def by_arg(a: cute.Tensor, b: cute.Tensor, factor: cutlass.Constexpr):
    _launch(a, b, factor)
'''
TRIGGERS = '''\
"""Where each case's value comes from: every one is 2.0 until its change."""

import ctypes
import glob
import importlib.metadata
import os
import sqlite3
import subprocess
from pathlib import Path

CONFIG = Path(os.environ["IR_CONFIG"])
SHM = Path(os.environ["IR_SHM"])


def c_getenv():
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    return float(libc.getenv(b"IR_C_SCALE") or b"2")


def environb():
    return float(os.environb.get(b"IR_B_SCALE", b"2"))


def proc_environ():
    entries = Path("/proc/self/environ").read_bytes().split(b"\\0")
    found = dict(e.split(b"=", 1) for e in entries if b"=" in e)
    return float(found.get(b"IR_P_SCALE", b"2"))


def environ_copy():
    return float(dict(os.environ).get("IR_D_SCALE", "2"))


def wheel_env():
    import irwheel

    return irwheel.scale()


def cat():
    out = subprocess.run(["cat", str(CONFIG / "cat.txt")], capture_output=True, check=True)
    return float(out.stdout)


def sqlite():
    with sqlite3.connect(CONFIG / "tiles.db") as db:
        return float(db.execute("select value from tiles").fetchone()[0])


def read_write():
    with open(CONFIG / "rw.txt", "r+") as file:
        return float(file.read())


def appears_later():
    path = CONFIG / "override.txt"
    return float(path.read_text()) if path.exists() else 2.0


def shm():
    return float(SHM.read_text())


def configmap():
    return float((CONFIG / "configmap" / "scale").read_text())


def plugins():
    return 2.0 + len(glob.glob(str(CONFIG / "plugins" / "*.py")))


def distribution():
    try:
        importlib.metadata.version("ir-feature")
    except importlib.metadata.PackageNotFoundError:
        return 2.0
    return 3.0


def constant():
    from irapp import constants

    return constants.FACTOR


def site_env():
    return float(os.environ.get("IR_SITE_SCALE", "2"))


def optimized():
    return 2.0 if __debug__ else 3.0
'''
APP = '''\
"""The application: one kernel (function, arguments) per case, ``trigger:path``."""

import functools

import cutlass
from cutlass.cute.runtime import make_fake_compact_tensor

from irapp import kernels, triggers


def build(case):
    import os

    if os.environ.get("IR_TUNING"):
        import irtuning  # noqa: F401 - it wraps the DSL's Compiler.compile
    trigger, _, path = case.partition(":")
    t = make_fake_compact_tensor(cutlass.Float32, (128,), assumed_align=16)
    if trigger == "literal_default":
        return kernels.by_literal_default, (t, t)
    if trigger == "literal_self":
        return kernels.LiteralScaler().run, (t, t)
    if trigger == "patched_class":
        import irpatch  # noqa: F401 - it sets kernels.Tiles.factor

        return kernels.by_class, (t, t)
    value = getattr(triggers, trigger)()
    if path == "closure":
        return kernels.make_mul(value), (t, t)
    if path == "self":
        return kernels.Scaler(value).run, (t, t)
    if path == "class":
        kernels.Tiles.factor = value
        return kernels.by_class, (t, t)
    if path == "global":
        kernels.FACTOR = value
        return kernels.by_global, (t, t)
    if path == "default":
        return kernels.make_default(value), (t, t)
    if path == "partial":
        kernels.SCALED = functools.partial(kernels._launch, factor=value)
        return kernels.by_partial, (t, t)
    return kernels.by_arg, (t, t, value)
'''
PATCH = "from irapp import kernels\n\nkernels.Tiles.factor = 2.0\n"
TUNING = '''\
"""A tuning module: every compile of the DSL at opt-level 1, by wrapping its compiler."""

from cutlass.base_dsl import compiler

_compile = compiler.Compiler.compile


def compile(self, module, pipeline, *args, **kwargs):
    return _compile(self, module, pipeline.replace("opt-level=3", "opt-level=1"), *args, **kwargs)


compiler.Compiler.compile = compile
'''
# Options a kernel is warmed under (its name: ``case+base``), besides the defaults.
BASES = {"lineinfo": {"options": "--generate-line-info"}}
WHEEL = 'import os\n\n\ndef scale():\n    return float(os.environ.get("IR_WHEEL_SCALE", "2"))\n'
SITECUSTOMIZE = 'import os\n\nos.environ.setdefault("IR_SITE_SCALE", "2")\n'


@dataclass
class World:
    base: Path
    app: Path  # on sys.path: irapp/, irpatch.py
    config: Path
    shm: Path
    site: Path  # a site directory (its .pth files run) holding irwheel and sitecustomize
    root: Path  # the generation's cute-dsl directory
    env: dict[str, str]
    kernels: dict[str, dict[str, str]] = field(default_factory=dict)

    def fresh(self, request: dict[str, Any], *flags: str, **env: str) -> dict[str, Any]:
        """A fresh interpreter serving one request: a change made at start."""
        serve = [*flags, str(WORKER), "serve", str(self.root)]
        return self.python(*serve, stdin=json.dumps(request) + "\n", **env)

    def python(self, *argv: str, stdin: str | None = None, **env: str) -> Any:
        """What a fresh interpreter of the application printed last, as JSON."""
        proc = subprocess.run(
            [sys.executable, *argv],
            input=stdin,
            env={**self.env, **env},
            cwd=self.base,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])


def _swap_link(link: Path, target: str) -> None:
    tmp = link.with_name(f".{link.name}.{uuid.uuid4().hex[:6]}")
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _write_db(path: Path, value: str) -> None:
    path.unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("create table tiles (value text)")
        db.execute("insert into tiles values (?)", (value,))


def _make_world(base: Path) -> World:
    app, config, site = base / "app", base / "config", base / "site"
    files = {
        app / "irapp" / "__init__.py": APP,
        app / "irapp" / "kernels.py": KERNELS,
        app / "irapp" / "triggers.py": TRIGGERS,
        app / "irapp" / "constants.py": "FACTOR = 2.0\n",
        app / "irpatch.py": PATCH,
        app / "irtuning.py": TUNING,
        site / "irwheel" / "__init__.py": WHEEL,
        site / "sitecustomize.py": SITECUSTOMIZE,
        config / "cat.txt": "2\n",
        config / "rw.txt": "2\n",
        config / "configmap" / "..2026_01" / "scale": "2\n",
        config / "configmap" / "..2026_02" / "scale": "3\n",
        config / "configmap" / "..2026_03" / "scale": "2\n",
        config / "plugins" / "README": "plugins are *.py files\n",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    info = site / "irwheel-1.0.dist-info"  # installed: its RECORD lists its files
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: irwheel\nVersion: 1.0\n")
    (info / "RECORD").write_text("irwheel/__init__.py,,\nirwheel-1.0.dist-info/RECORD,,\n")
    _write_db(config / "tiles.db", "2")
    (config / "configmap" / "..data").symlink_to("..2026_01")
    (config / "configmap" / "scale").symlink_to("..data/scale")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else base
    shm = shm / f"kc-ir-{uuid.uuid4().hex[:8]}.txt"
    shm.write_text("2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERNELCACHE_", "CUTE_DSL_"))}
    env = {k: v for k, v in env.items() if not k.startswith("IR_")}
    env.update(
        # the site directory on the path too: its sitecustomize runs at interpreter start
        PYTHONPATH=os.pathsep.join([str(app), str(site), str(REPO), str(REPO / "src")]),
        CUTE_DSL_ARCH="sm_90a",
        IR_CONFIG=str(config),
        IR_SHM=str(shm),
        IR_SITEDIR=str(site),
        PYTHONDONTWRITEBYTECODE="1",
    )
    return World(base, app, config, shm, site, base / "generation" / "cute-dsl", env)


# --- the cases ------------------------------------------------------------------------------

Change = Callable[[World], contextlib.AbstractContextManager[None]]


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


@contextlib.contextmanager
def replaced(path: Path, text: str) -> Iterator[None]:
    old = path.read_bytes()
    path.write_text(text)
    try:
        yield
    finally:
        path.write_bytes(old)


@contextlib.contextmanager
def edited(path: Path, old: str, new: str) -> Iterator[None]:
    text = path.read_text()
    assert old in text, (path, old)
    with replaced(path, text.replace(old, new)):
        yield


@contextlib.contextmanager
def added(path: Path, text: str = "") -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    try:
        yield
    finally:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


@contextlib.contextmanager
def swapped(link: Path, target: str) -> Iterator[None]:
    old = os.readlink(link)
    _swap_link(link, target)
    try:
        yield
    finally:
        _swap_link(link, old)


@contextlib.contextmanager
def database(path: Path, value: str) -> Iterator[None]:
    _write_db(path, value)
    try:
        yield
    finally:
        _write_db(path, "2")


@contextlib.contextmanager
def distribution(site: Path, name: str) -> Iterator[None]:
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    try:
        yield
    finally:
        shutil.rmtree(info)


@contextlib.contextmanager
def moved_app(w: World) -> Iterator[None]:
    other = w.base / "elsewhere" / "deeper"
    shutil.copytree(w.app, other)
    try:
        yield
    finally:
        shutil.rmtree(other.parent)


@dataclass(frozen=True)
class Case:
    id: str
    case: str  # the kernel: ``trigger:path``
    change: Change = lambda w: nothing()
    env: dict[str, str] = field(default_factory=dict)
    cwd: Callable[[World], Path] | None = None
    path: Callable[[World], Path] | None = None  # first on sys.path
    flags: tuple[str, ...] = ()  # a fresh interpreter with these flags, env set at start
    options: str = ""  # the compile's options= string
    bracket: str = ""  # the bracket form's options, as an expression: cute.OptLevel(1)
    through: str = ""  # "patched": cute.compile as install() routes it
    base: str = ""  # the options the kernel was warmed under (BASES)
    refusal: str = "no kernel compiled from this IR"  # what a refusal says

    @property
    def fresh(self) -> bool:
        return bool(self.flags) or self.id.startswith("fresh:")

    @property
    def kernel(self) -> str:
        """The warmed kernel this case is judged against."""
        return f"{self.case}+{self.base}" if self.base else self.case

    def request(self) -> dict[str, Any]:
        return {"case": self.case, "options": self.options, "bracket": self.bracket,
                "through": self.through}  # fmt: skip


def _kernel(trigger: str, number: int) -> str:
    return f"{trigger}:{PATHS[number % len(PATHS)]}"


# trigger -> (the change that moves it from 2.0, fresh interpreter)
MOVERS: dict[str, tuple[Change, dict[str, str]]] = {
    "c_getenv": (lambda w: nothing(), {"IR_C_SCALE": "3"}),
    "environb": (lambda w: nothing(), {"IR_B_SCALE": "3"}),
    "environ_copy": (lambda w: nothing(), {"IR_D_SCALE": "3"}),
    "wheel_env": (lambda w: nothing(), {"IR_WHEEL_SCALE": "3"}),
    "cat": (lambda w: replaced(w.config / "cat.txt", "3\n"), {}),
    "sqlite": (lambda w: database(w.config / "tiles.db", "3"), {}),
    "read_write": (lambda w: replaced(w.config / "rw.txt", "3\n"), {}),
    "appears_later": (lambda w: added(w.config / "override.txt", "3\n"), {}),
    "shm": (lambda w: replaced(w.shm, "3\n"), {}),
    "configmap": (lambda w: swapped(w.config / "configmap" / "..data", "..2026_02"), {}),
    "plugins": (lambda w: added(w.config / "plugins" / "extra.py", "\n"), {}),
    "distribution": (lambda w: distribution(w.site, "ir-feature"), {}),
    "constant": (
        lambda w: edited(w.app / "irapp" / "constants.py", "2.0", "3.0"),
        {},
    ),
}
RELEVANT = [
    *(
        Case(f"{trigger} via {kernel.partition(':')[2]}", kernel, change, env)
        for n, (trigger, (change, env)) in enumerate(MOVERS.items())
        for kernel in [_kernel(trigger, n)]
    ),
    # the same outside change through every other path
    *(
        Case(f"{trigger} via {path}", f"{trigger}:{path}", *MOVERS[trigger])
        for trigger in ("c_getenv", "cat")
        for path in PATHS
        if _kernel(trigger, list(MOVERS).index(trigger)) != f"{trigger}:{path}"
    ),
    Case(
        "a default argument's literal",
        "literal_default:",
        lambda w: edited(w.app / "irapp" / "kernels.py", "Constexpr = 2.0", "Constexpr = 3.0"),
    ),
    Case(
        "self's attribute set in __init__",
        "literal_self:",
        lambda w: edited(w.app / "irapp" / "kernels.py", "self.value = 2.0", "self.value = 3.0"),
    ),
    Case(
        "a class attribute another module sets",
        "patched_class:",
        lambda w: edited(w.app / "irpatch.py", "2.0", "3.0"),
    ),
    Case("fresh: /proc/self/environ", "proc_environ:closure", env={"IR_P_SCALE": "3"}),
    # what the compiler receives after the trace
    Case("options= at opt-level 1", "cat:closure", options="--opt-level 1"),
    Case("the bracket form: OptLevel(1)", "cat:self", bracket="cute.OptLevel(1)"),
    Case("the bracket form: GenerateLineInfo", "cat:class", bracket="cute.GenerateLineInfo"),
    Case("the bracket form: PtxasOptions", "cat:global", bracket='cute.PtxasOptions("-O1")'),
    Case(
        "the bracket form through the installed cute.compile",
        "cat:default",
        bracket="cute.OptLevel(1)",
        through="patched",
    ),
    Case(
        "flatten-locs with line info",
        "cat:closure",
        base="lineinfo",
        options="--generate-line-info --flatten-locs-output-json-path locs.json",
    ),
    Case(
        "a module that wraps the DSL's Compiler.compile",
        "cat:arg",
        env={"IR_TUNING": "1"},
        refusal="Compiler.compile is irtuning:compile",
    ),
    Case("fresh: python -O", "optimized:self", flags=("-O",)),
    Case(
        "fresh: what sitecustomize set",
        "site_env:global",
        lambda w: edited(w.site / "sitecustomize.py", '"2"', '"3"'),
    ),
]
IRRELEVANT = [
    Case("an unrelated variable", "c_getenv:closure", env={"IR_UNRELATED": "9"}),
    Case("HOME", "cat:self", env={"HOME": "/nonexistent"}),
    Case("TMPDIR", "cat:global", env={"TMPDIR": "/var/tmp"}),
    Case("LANG and TZ", "sqlite:class", env={"LANG": "C", "TZ": "Asia/Tokyo"}),
    Case("another working directory", "cat:closure", cwd=lambda w: w.config),
    Case(
        "an unrelated file beside the data",
        "cat:arg",
        lambda w: added(w.config / "notes.txt", "9\n"),
    ),
    Case(
        "a file in the ConfigMap nobody reads",
        "configmap:default",
        lambda w: added(w.config / "configmap" / "..2026_01" / "other", "9\n"),
    ),
    Case(
        "the ConfigMap swapped to the same content",
        "configmap:default",
        lambda w: swapped(w.config / "configmap" / "..data", "..2026_03"),
    ),
    Case("the data file rewritten, same value", "cat:partial",
         lambda w: replaced(w.config / "cat.txt", "2\n")),
    Case("a new module nobody imports", "constant:self",
         lambda w: added(w.app / "irapp" / "unused.py", "FACTOR = 9\n")),
    Case(
        "a comment and blank lines in the kernels' source",
        "c_getenv:default",
        lambda w: edited(w.app / "irapp" / "kernels.py", "import functools\n",
                         "import functools\n\n# moves every line below\n\n\n"),
    ),
    Case(
        "a docstring in the kernels' source",
        "c_getenv:global",
        lambda w: edited(w.app / "irapp" / "kernels.py", "through each path", "through paths"),
    ),
    Case(
        "a local variable renamed in the kernel",
        "c_getenv:arg",
        lambda w: edited(w.app / "irapp" / "kernels.py", "tidx, _, _ = cute.arch.thread_idx()\n"
                         "    g_b[tidx] = g_a[tidx]", "i, _, _ = cute.arch.thread_idx()\n"
                         "    g_b[i] = g_a[i]"),
    ),
    Case("the application moved to another path", "constant:closure",
         lambda w: moved_app(w), path=lambda w: w.base / "elsewhere" / "deeper"),
    Case("an unrelated distribution installed", "distribution:self",
         lambda w: distribution(w.site, "ir-unrelated")),
    Case("a plugin folder's non-plugin file", "plugins:class",
         lambda w: added(w.config / "plugins" / "NOTES.md", "x\n")),
    Case(
        "fresh: an unrelated editable install's .pth",
        "c_getenv:self",
        lambda w: added(w.site / "__editable__.unrelated.pth",
                        f"{w.base / 'unrelated'}\nimport os\n"),
    ),
    Case("fresh: PYTHONHASHSEED", "cat:closure", env={"PYTHONHASHSEED": "123"}),
    Case("fresh: a DSL setting that changes no code", "cat:self",
         env={"CUTE_DSL_LOG_LEVEL": "10"}),
    # options spelled otherwise, that only report, or that the DSL repeats: one pipeline
    Case("options= spelling out the default opt-level", "cat:closure", options="--opt-level 3"),
    Case("options= naming the arch already targeted", "cat:self", options="--gpu-arch sm_90a"),
    Case("fresh: CUTE_DSL_COMPILER_OPT spelling out the default", "cat:class",
         env={"CUTE_DSL_COMPILER_OPT": "opt-level=3"}),
    Case("fresh: diagnostics only (warnings{nvvm})", "cat:global",
         env={"CUTE_DSL_COMPILER_OPT": "warnings{nvvm}"}),
    Case("fresh: a raw compiler token the pipeline already has", "cat:default",
         env={"CUTE_DSL_COMPILER_OPT": "check-inline-asm=false"}),
    Case("fresh: PTX and cubin kept beside the compile", "cat:partial",
         env={"CUTE_DSL_KEEP_PTX": "1", "CUTE_DSL_KEEP_CUBIN": "1", "CUTE_DSL_DUMP_DIR": "dump"}),
    Case("the installed cute.compile without a bracket", "cat:arg", through="patched"),
]  # fmt: skip
ALL = [*RELEVANT, *IRRELEVANT]


# --- the harness ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """Every case's kernel compiled once into the generation, with its object's digest."""
    w = _make_world(tmp_path_factory.mktemp("irkey"))
    kernels = {c.kernel: {"name": c.kernel, "case": c.case, **BASES.get(c.base, {})} for c in ALL}
    proc = subprocess.run(
        [sys.executable, str(WORKER), "warm", str(w.root)],
        input=json.dumps(sorted(kernels.values(), key=lambda k: k["name"])),
        env=w.env,
        cwd=w.base,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    warmed = json.loads(proc.stdout.strip().splitlines()[-1])
    w.kernels = warmed["kernels"]
    try:
        yield w
    finally:
        w.shm.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def ask(world: World) -> Iterator[Callable[[Case], dict[str, Any]]]:
    """One worker for the group: each question is answered by a child forked from it."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "serve", str(world.root)],
        env=world.env,
        cwd=world.base,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def answer(case: Case) -> dict[str, Any]:
        with case.change(world):
            if case.fresh:
                return world.fresh(case.request(), *case.flags, **case.env)
            request = {
                **case.request(),
                "env": case.env,
                "cwd": str(case.cwd(world)) if case.cwd else None,
                "path": str(case.path(world)) if case.path else None,
            }
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            assert line, "the worker exited"
            return json.loads(line)

    yield answer
    proc.stdin.close()
    proc.wait(timeout=60)


def judged(world: World, case: Case, answer: dict[str, Any]) -> str:
    """``hit``, ``refused``, ``false hit`` or ``false miss``, against the direct compile."""
    assert answer["outcome"] in ("hit", "refused"), answer
    recorded = {k["key"]: k["oracle"] for k in world.kernels.values()}
    if answer["outcome"] == "hit":
        return "hit" if recorded[answer["loaded"]] == answer["direct"] else "false hit"
    return "false miss" if answer["direct"] in recorded.values() else "refused"


VERDICTS: dict[str, str] = {}


@pytest.mark.parametrize("case", RELEVANT, ids=lambda c: c.id)
def test_a_change_that_alters_the_kernel_is_refused(world, ask, case):
    answer = ask(case)
    assert answer["direct"] != world.kernels[case.kernel]["oracle"], "the change alters nothing"
    VERDICTS[case.id] = verdict = judged(world, case, answer)
    assert verdict == "refused", (verdict, answer)
    assert case.refusal in answer["message"]


@pytest.mark.parametrize("case", IRRELEVANT, ids=lambda c: c.id)
def test_a_change_that_leaves_the_kernel_loads(world, ask, case):
    answer = ask(case)
    assert answer["direct"] == world.kernels[case.kernel]["oracle"], "the change alters the kernel"
    VERDICTS[case.id] = verdict = judged(world, case, answer)
    assert verdict == "hit", (verdict, answer)


def test_no_false_hit_and_no_false_miss(world, ask):
    """What docs/keys.md records: every case judged, none wrong (run after the cases)."""
    assert len(RELEVANT) >= 30 and len(IRRELEVANT) >= 15
    for case in ALL:
        if case.id not in VERDICTS:
            VERDICTS[case.id] = judged(world, case, ask(case))
    wrong = {k: v for k, v in VERDICTS.items() if v.startswith("false")}
    assert wrong == {}, wrong


def test_one_build_compiles_each_closure_and_self_apart(world):
    """In one process: ``make_mul(2.0)``/``make_mul(3.0)`` and ``Scaler(2.0).run``/
    ``Scaler(3.0).run`` are four kernels; the same closure again is the first one."""
    script = (
        "import json, sys\n"
        "import cutlass\n"
        "from cutlass.cute.runtime import make_fake_compact_tensor\n"
        "from kernelcache.runtime import cute as layer\n"
        "from irapp import kernels\n"
        "t = make_fake_compact_tensor(cutlass.Float32, (128,), assumed_align=16)\n"
        "cache = layer.CuteDiskCache(sys.argv[1])\n"
        "fns = [kernels.make_mul(2.0), kernels.make_mul(3.0), kernels.Scaler(2.0).run,\n"
        "       kernels.Scaler(3.0).run, kernels.make_mul(2.0)]\n"
        "got = [cache.compile(fn, t, t) for fn in fns]\n"
        "print(json.dumps([len({id(g) for g in got}), got[0] is got[4], cache.stats.misses]))\n"
    )
    assert world.python("-c", script, str(world.base / "one-build")) == [4, True, 4]


def test_the_bracket_form_compiles_what_it_asks(world):
    """``cute.compile[cute.OptLevel(1)]`` through the installed layer compiles the opt-level 1
    object (the DSL's own bracket compile's), not the default one, keeps it under a key of its
    own (not the default's), and a strict lookup asking the same loads it."""
    script = (
        "import json, os, sys\n"
        "import blake3, cutlass, cutlass.cute as cute\n"
        "from cutlass.cute.runtime import make_fake_compact_tensor\n"
        "from kernelcache.runtime import cute as layer\n"
        "from irapp import kernels\n"
        "def oracle(c): return blake3.blake3(c.dump_to_object('kc_oracle')).hexdigest()\n"
        "t = make_fake_compact_tensor(cutlass.Float32, (128,), assumed_align=16)\n"
        "fn = kernels.make_mul(2.0)\n"
        "os.environ[layer.CACHE_DIR_ENV] = sys.argv[1]\n"
        "layer.install()\n"
        "built = oracle(cute.compile[cute.OptLevel(1)](fn, t, t))\n"
        "misses = layer.default_cache().stats.misses\n"
        "wanted = oracle(layer._original_compile[cute.OptLevel(1)](fn, t, t))\n"
        "default = oracle(layer._original_compile(fn, t, t))\n"
        "strict = layer.CuteDiskCache(sys.argv[1], strict=True)\n"
        "strict.compile_with(cute.OptLevel(1), fn, (t, t), {})\n"
        "keys = [layer.trace_with(s, fn, (t, t), {}).key for s in (cute.OptLevel(1), None)]\n"
        "kept = sorted(p.stem for p in layer.Path(sys.argv[1]).glob('*.o'))\n"
        "print(json.dumps([built == wanted, built != default, misses, strict.stats.hits,\n"
        "                  kept == keys[:1], keys[0] != keys[1]]))\n"
    )
    found = world.python("-c", script, str(world.base / "bracket"))
    assert found == [True, True, 1, 1, True, True]


def test_the_key_does_not_depend_on_what_compiled_before(world):
    """With raw ``CUTE_DSL_COMPILER_OPT`` tokens (which the DSL appends to its shared options
    on every call), kernels looked up strictly in any order, again and between direct
    compiles, all load, under the keys they were built under, and the direct compiles (the
    token n times by then) make the recorded objects."""
    cases = ["cat:closure", "cat:self", "cat:closure", "c_getenv:arg", "cat:self"]
    script = (
        "import json, sys\n"
        "import blake3, cutlass.cute as cute\n"
        "from kernelcache.runtime import cute as layer\n"
        "import irapp\n"
        "def oracle(c): return blake3.blake3(c.dump_to_object('kc_oracle')).hexdigest()\n"
        "cache = layer.CuteDiskCache(sys.argv[1], strict=True)\n"
        "found = []\n"
        "for case in json.loads(sys.argv[2]):\n"
        "    fn, args = irapp.build(case)\n"
        "    direct = oracle(cute.compile(fn, *args))\n"
        "    cache._memory.clear()\n"
        "    cache.compile(fn, *args)\n"
        "    found.append([layer.trace(fn, *args).key, direct])\n"
        "print(json.dumps([found, cache.stats.hits]))\n"
    )
    opt = "warnings{nvvm} check-inline-asm=false"
    found, hits = world.python(
        "-c", script, str(world.root), json.dumps(cases), CUTE_DSL_COMPILER_OPT=opt
    )
    recorded = [world.kernels[case] for case in cases]
    assert [[k["key"], k["oracle"]] for k in recorded] == found
    assert hits == len(cases)
