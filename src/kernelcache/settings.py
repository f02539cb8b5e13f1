"""Toolchain settings that change the code a toolchain compiles: stamp factors ``setting/<VAR>``.

``CUTE_DSL_LINEINFO=1`` compiles every CuTe-DSL kernel differently, so a build run with it
must not find the generation built without it up to date, and a serving process must not
take one for the other. Which variables change compiled code is each toolchain's own
knowledge, so the lists are read from the installed toolchains rather than kept here, and
read as source with ``ast``: a stamp is checked at interpreter start, where importing a
toolchain would cost seconds, and in an init-container that may have none of them.

- CuTe-DSL declares every ``CUTE_DSL_*`` setting with ``env_var(..., affects_compile=...)``
  (``cutlass/base_dsl/env_manager.py``, ``cutlass/cutlass_dsl/cutlass.py``) and keys its own
  JIT cache on those marked True. ``CUTE_DSL_ARCH`` is the ``arch`` factor.
- Inductor keys its FX graph cache on its config (``torch/_inductor/config.py``) less the keys
  under ``_cache_config_ignore_prefix`` and private ones; a setting is every variable an
  entry of that config is read from.
- Triton declares its variables in ``triton/knobs.py``, grouped by what they configure; the
  groups that reach the compiler (``compilation``, ``language``, ``nvidia``, ``amd`` and the
  ``runtime`` knobs) are settings, the cache, build, autotuning and profiler groups are not.
  Triton's C++ core reads a few more (``DISABLE_MMA_V3``, ``MLIR_ENABLE_DUMP``, ...) and lists
  them only to a running Triton (``get_cache_invalidating_env_vars``): a build asks it, and
  every recorded setting is measured again wherever a stamp is checked.
- FlashInfer and its b12x kernels mark nothing: every ``FLASHINFER_*`` and ``B12X_*``
  variable is a setting except those that only say where to write, what to log or time,
  whether to cache, and what kernelcache itself sets from the arch (``_FLASHINFER_NOT_CODE``).

A host- or path-valued setting is never a factor (``DESIGN``: it differs between the pod that
builds and the pods that serve, so it would never match): a name that says it holds a
location, or a value that is an absolute path, is left out. A value is read by its meaning,
the way its toolchain parses it: a CuTe-DSL setting the DSL declares as ``bool``, ``int`` or
``str`` is an option however it starts (``CUTE_DSL_COMPILER_OPT=/opt-level=0``).
"""

from __future__ import annotations

import ast
import itertools
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from pathlib import Path

from kernelcache.sources import find_spec_without_import, parse

__all__ = ["SETTING_PREFIX", "compile_settings"]

SETTING_PREFIX = "setting/"
_CUTE_DSL_PREFIX = "CUTE_DSL_"
_CUTE_DSL_FILES = ("base_dsl/env_manager.py", "cutlass_dsl/cutlass.py")
_CUTE_DSL_OWN_FACTORS = frozenset({"CUTE_DSL_ARCH"})  # the arch factor
_EVERY_CUTE_DSL_SETTING = frozenset({_CUTE_DSL_PREFIX + "*"})  # a DSL whose list is not found
_TRITON_CODE_GROUPS = frozenset(
    {"compilation_knobs", "language_knobs", "nvidia_knobs", "amd_knobs", "runtime_knobs"}
)
# Words in a variable's name that say it holds a location: never a factor.
_LOCATION_WORDS = frozenset({"DIR", "PATH", "HOME", "FILE", "ROOT", "BASE", "WORKSPACE"})
# FlashInfer/b12x variables that do not change compiled code, by the words in their names.
_FLASHINFER_NOT_CODE = frozenset(
    {
        "LOG", "LOGLEVEL", "LOGGING", "LOGDEST", "VERBOSE", "PRINT", "TIMING", "DUMP", "TRACE",
        "CACHE", "MEMO", "PROGRESS", "STARTED", "NVCC", "JOBS", "THREADS",
        "DISABLE_JIT", "VERSION_CHECK", "ARCH_LIST",
    }
)  # fmt: skip
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
_ENV_READERS = frozenset({"get", "getenv", "get_env", "getenv_bool"})
_ENV_KEYWORDS = frozenset({"env_name_default", "env_name_force"})


def compile_settings(
    environ: Mapping[str, str] | None = None,
    *,
    also: Iterable[str] = (),
    ask_triton: bool = False,
) -> dict[str, str]:
    """``setting/<VAR>`` -> value for each set variable a toolchain compiles differently under.

    ``also`` names variables to measure whatever the lists say (those a stamp recorded);
    ``ask_triton`` adds the variables Triton's C++ core lists (it imports Triton).
    """
    environ = os.environ if environ is None else environ
    named = {
        name
        for name in environ
        if name not in _CUTE_DSL_OWN_FACTORS and not _LOCATION_WORDS & set(name.split("_"))
    }
    options = _cute_dsl_options(named)  # declared as text, flags or numbers: never a path
    candidates = {n for n in named if n in options or not environ[n].startswith(("/", "~"))}
    names = (
        set(also)
        | {name for name in candidates if _is_flashinfer_setting(name)}
        | _cute_dsl_settings(candidates)
        | _inductor_settings(candidates)
        | _triton_settings(candidates)
    )
    if ask_triton:
        names |= _triton_core_settings()
    return {SETTING_PREFIX + name: environ[name] for name in sorted(names & candidates)}


def _is_flashinfer_setting(name: str) -> bool:
    if not name.startswith(("FLASHINFER_", "B12X_")):
        return False
    words = name.split("_")[1:]
    pairs = {f"{a}_{b}" for a, b in itertools.pairwise(words)}
    return not (_FLASHINFER_NOT_CODE & (set(words) | pairs))


# ------------------------------------------------------------------ read from the toolchains


def _package_file(package: str, relative: str) -> Path | None:
    """A file of an installed package, found without importing it."""
    try:
        spec = find_spec_without_import(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.is_file() else None


def _mentioned(path: Path | None, literals: Mapping[str, str]) -> set[str]:
    """The names whose literal (``"NAME"``, quoted) the file holds: parsing a toolchain's
    config costs tens of milliseconds, a byte search of it for the few variables set none."""
    if path is None or not literals:
        return set()
    data = _read(*_version(path))
    return {name for name, text in literals.items() if f'"{text}"'.encode() in data}


@cache
def _read(path: str, _mtime_ns: int) -> bytes:
    return Path(path).read_bytes()


@cache
def _parse(path: str, _mtime_ns: int) -> ast.Module:
    return parse(_read(path, _mtime_ns), path)


def _version(path: Path) -> tuple[str, int]:
    """A file as cache key: a toolchain upgraded in place is read again."""
    return str(path), path.stat().st_mtime_ns


def _cute_dsl_settings(candidates: Iterable[str]) -> set[str]:
    """The candidates the DSL declares with ``env_var("X", affects_compile=True)``.

    A DSL whose files are not where 4.x keeps them keys on every ``CUTE_DSL_*`` variable that
    is not a location: more misses, never a stale kernel.
    """
    suffixes = {
        name: name.removeprefix(_CUTE_DSL_PREFIX)
        for name in candidates
        if name.startswith(_CUTE_DSL_PREFIX)
    }
    if not suffixes or find_spec_without_import("cutlass") is None:
        return set()
    paths = [p for p in (_package_file("cutlass", f) for f in _CUTE_DSL_FILES) if p is not None]
    if not paths:
        return set(suffixes)
    declared = set().union(*(_cute_dsl_declared(*_version(path)) for path in paths))
    if not declared:
        return set(suffixes)
    return {name for name, suffix in suffixes.items() if suffix in declared}


def _cute_dsl_options(names: Iterable[str]) -> set[str]:
    """The names the DSL declares with the type it parses them as ``bool``, ``int`` or ``str``:
    ``CUTE_DSL_COMPILER_OPT=/opt-level=0`` is an option string, whatever its first byte."""
    suffixes = {
        n: n.removeprefix(_CUTE_DSL_PREFIX) for n in names if n.startswith(_CUTE_DSL_PREFIX)
    }
    if not suffixes or find_spec_without_import("cutlass") is None:
        return set()
    paths = [p for p in (_package_file("cutlass", f) for f in _CUTE_DSL_FILES) if p is not None]
    typed = set().union(set(), *(_cute_dsl_typed(*_version(path)) for path in paths))
    return {name for name, suffix in suffixes.items() if suffix in typed}


@cache
def _cute_dsl_declared(path: str, mtime_ns: int) -> frozenset[str]:
    return frozenset(name for name, _ in _affects_compile_declarations(_parse(path, mtime_ns)))


@cache
def _cute_dsl_typed(path: str, mtime_ns: int) -> frozenset[str]:
    declared = _affects_compile_declarations(_parse(path, mtime_ns))
    return frozenset(name for name, kind in declared if kind in _OPTION_TYPES)


_OPTION_TYPES = frozenset({"bool", "int", "float", "str"})


def _affects_compile_declarations(tree: ast.Module) -> Iterator[tuple[str, str | None]]:
    """(name, the type it is declared as, when one is) of each compile-affecting setting."""
    annotations = {
        id(node.value): node.annotation
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and node.value is not None
    }
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "env_var"):
            continue
        marked = {k.arg: k.value for k in node.keywords}.get("affects_compile")
        source = node.args[0] if node.args else None
        if (
            isinstance(marked, ast.Constant)
            and marked.value is True
            and isinstance(source, ast.Constant)
            and isinstance(source.value, str)
        ):
            annotation = annotations.get(id(node))
            yield source.value, annotation.id if isinstance(annotation, ast.Name) else None


def _inductor_settings(candidates: Iterable[str]) -> set[str]:
    """The candidates inductor's cache-keyed config entries are read from."""
    path = _package_file("torch", "_inductor/config.py")
    mentioned = _mentioned(path, {name: name for name in candidates})
    return mentioned & _inductor_declared(*_version(path)) if path and mentioned else set()


@cache
def _inductor_declared(path: str, mtime_ns: int) -> frozenset[str]:
    tree = _parse(path, mtime_ns)
    ignored = ("_", *_string_list(tree, "_cache_config_ignore_prefix"))
    helpers = {
        node.name: set(_env_reads(node)) for node in tree.body if isinstance(node, ast.FunctionDef)
    }
    names: set[str] = set()
    for key, value in _config_entries(tree.body, ""):
        if key.startswith(ignored):
            continue
        names.update(_env_reads(value))
        for call in ast.walk(value):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                names.update(helpers.get(call.func.id, ()))
    return frozenset(names)


def _config_entries(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.expr]]:
    """(dotted key, value) of each assignment in a config module, classes as namespaces."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield from _config_entries(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    yield prefix + target.id, node.value


def _env_reads(node: ast.AST) -> Iterator[str]:
    """Variable names ``node`` reads: ``os.environ.get("X")``, ``os.getenv("X")``,
    ``os.environ["X"]``, ``"X" in os.environ`` and ``Config(env_name_force="X")``."""
    for child in ast.walk(node):
        if isinstance(child, ast.Call):
            func = child.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in _ENV_READERS and child.args:
                yield from _env_names(child.args[0])
            for keyword in child.keywords:
                if keyword.arg in _ENV_KEYWORDS:
                    yield from _env_names(keyword.value)
        elif isinstance(child, ast.Subscript) and _is_environ(child.value):
            yield from _env_names(child.slice)
        elif isinstance(child, ast.Compare) and any(_is_environ(c) for c in child.comparators):
            yield from _env_names(child.left)


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _env_names(node: ast.AST) -> Iterator[str]:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and _ENV_NAME.match(node.value)
    ):
        yield node.value


def _string_list(tree: ast.Module, name: str) -> list[str]:
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        value = getattr(node, "value", None)
        if any(getattr(t, "id", None) == name for t in targets) and isinstance(value, ast.List):
            return [
                e.value
                for e in value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            ]
    return []


def _triton_settings(candidates: Iterable[str]) -> set[str]:
    """The candidates of the knob groups in ``triton/knobs.py`` that reach the compiler."""
    path = _package_file("triton", "knobs.py")
    mentioned = _mentioned(path, {name: name for name in candidates})
    return mentioned & _triton_declared(*_version(path)) if path and mentioned else set()


@cache
def _triton_declared(path: str, mtime_ns: int) -> frozenset[str]:
    names: set[str] = set()
    for node in _parse(path, mtime_ns).body:
        if isinstance(node, ast.ClassDef) and node.name in _TRITON_CODE_GROUPS:
            for _, value in _config_entries(node.body, ""):
                for call in ast.walk(value):
                    func = getattr(call, "func", None)
                    if (
                        isinstance(call, ast.Call)
                        and getattr(func, "id", "").startswith("env_")
                        and call.args
                    ):
                        names.update(_env_names(call.args[0]))
    return frozenset(names)


def _triton_core_settings() -> frozenset[str]:
    """The variables Triton's C++ core keys its cache on and that are set here, from Triton."""
    if find_spec_without_import("triton") is None:
        return frozenset()
    if "triton" not in sys.modules:
        import triton  # noqa: F401 - its C extension must be imported through the package
    from triton._C.libtriton import get_cache_invalidating_env_vars

    return frozenset(get_cache_invalidating_env_vars())
