"""The kernel sources of a module: the module and every project-local module it imports.

A kernel's code is decided by its module and by everything that module imports: a constant in
a helper beside it is as much a part of the kernel as the kernel's own lines. So a kernel is
keyed by the source of every module its module imports, transitively, except two kinds that
are keyed otherwise and where the walk stops:

- the standard library (``sys.stdlib_module_names``), decided by the Python build;
- a module whose file the RECORD of an installed distribution lists: its version and RECORD
  digest are its ``dist/`` factor.

Everything else is project-local and digested: the spec's folder, a folder on PYTHONPATH, a
file copied into site-packages without a RECORD, an editable install's sources.

Imports are found by reading sources with ``ast``; nothing is imported or run. Every
``import`` and ``from ... import`` counts wherever it stands (in a function, under ``try`` or
``if TYPE_CHECKING``), package-relative ones included; ``from pkg import name`` counts
``pkg.name`` when that is a submodule; importing ``a.b.c`` counts the packages ``a`` and
``a.b`` (their ``__init__``) too; and so do ``importlib.import_module("name")`` and
``__import__("name")`` with a literal name. A module that is not found is recorded as
``absent``, so that it appearing later moves the key. A project-local module whose source
cannot be read fails the walk, naming it: a key that leaves out a module serves stale kernels.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import site
import sys
import sysconfig
import threading
from collections.abc import Iterator
from functools import cache
from importlib.machinery import ModuleSpec
from pathlib import Path

import blake3

from kernelcache.errors import SpecError

__all__ = [
    "ABSENT",
    "SourceError",
    "find_spec_without_import",
    "import_problem",
    "module_sources",
    "parse",
    "script_sources",
]

ABSENT = "absent"
_DYNAMIC_IMPORTERS = frozenset({"import_module", "__import__"})
# CPython 3.11's parser keeps a recursion counter per interpreter, not per thread: two threads
# parsing at once fail with "AST constructor recursion depth mismatch" (the disk layer keys
# kernels from a serving process's threads).
_PARSE_LOCK = threading.Lock()


def parse(data: bytes, filename: str) -> ast.Module:
    """``ast.parse``, one thread at a time."""
    with _PARSE_LOCK:
        return ast.parse(data, filename=filename)


class SourceError(SpecError):
    """A project-local module cannot be read, so the kernels that import it cannot be keyed."""


def module_sources(*modules: str) -> dict[str, str]:
    """Module name -> ``blake3:<hex>`` of its file (or ``absent``), for ``modules`` and every
    project-local module they import, transitively; installed and standard modules left out."""
    return _walk({}, [(name, True) for name in modules])


def script_sources(path: str) -> dict[str, str]:
    """``module_sources`` of a file run as ``__main__`` (a script), found by its path."""
    spec = importlib.util.spec_from_file_location("__main__", path)
    if spec is None:
        raise SourceError(f"source/__main__: {path} is not a Python source file")
    found: dict[str, str] = {}
    found["__main__"], imports = _read("__main__", spec)
    return _walk(found, imports)


def _walk(found: dict[str, str], pending: list[tuple[str, bool]]) -> dict[str, str]:
    while pending:
        name, required = pending.pop()
        if name in found or name.partition(".")[0] in sys.stdlib_module_names:
            continue
        if _in_installed_package(name):
            continue  # not even its submodules are looked for: they are the distribution's
        try:
            spec = find_spec_without_import(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            if required:
                found[name] = ABSENT  # were it there, it would be imported: a factor
                pending.extend((parent, True) for parent in _parents(name))
            continue
        if spec.origin in ("built-in", "frozen") or _installed(spec.origin):
            continue  # keyed by the Python build, or by its distribution's dist/ factor
        if spec.has_location and spec.origin is not None:  # else a namespace package: no code
            found[name], imports = _read(name, spec)
            pending.extend(imports)
        pending.extend((parent, True) for parent in _parents(name))
    return dict(sorted(found.items()))


def _read(name: str, spec: ModuleSpec) -> tuple[str, list[tuple[str, bool]]]:
    """(digest, what it imports: (name, required)) of a project-local module's file."""
    path = str(spec.origin)
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise SourceError(
            f"source/{name}: cannot read {path} ({exc.strerror or exc}); the kernels "
            "that import it cannot be keyed"
        ) from None
    digest = "blake3:" + blake3.blake3(data).hexdigest()
    if path.endswith(tuple(importlib.machinery.BYTECODE_SUFFIXES)):
        raise SourceError(
            f"source/{name}: {path} is bytecode without its source; the modules it imports "
            "cannot be read"
        )
    if not path.endswith(".py"):
        return digest, []  # an extension module: its bytes, and no imports to read
    try:
        tree = parse(data, path)
    except (SyntaxError, ValueError) as exc:
        raise SourceError(f"source/{name}: {path} does not parse ({exc})") from None
    package = name if spec.submodule_search_locations is not None else name.rpartition(".")[0]
    return digest, list(_imports(tree, package))


def _parents(name: str) -> tuple[str, ...]:
    """Importing ``a.b.c`` runs ``a`` and ``a.b`` first."""
    parts = name.split(".")
    return tuple(".".join(parts[:depth]) for depth in range(1, len(parts)))


def _imports(tree: ast.AST, package: str) -> Iterator[tuple[str, bool]]:
    """(module, required) for every import in ``tree``, relative ones resolved in ``package``.

    ``from pkg import name`` names the submodule ``pkg.name`` when there is one, and an
    attribute of ``pkg`` otherwise: not required.
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, True) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            if base is None:
                continue
            yield base, True
            yield from ((f"{base}.{a.name}", False) for a in node.names if a.name != "*")
        elif isinstance(node, ast.Call) and (name := _dynamic_import_name(node)):
            yield name, True


def _absolute(module: str | None, level: int, package: str) -> str | None:
    """``from ..x import`` in ``package`` -> the absolute name; None when it escapes."""
    if level == 0:
        return module or None
    parts = package.split(".") if package else []
    if not parts or level - 1 >= len(parts):
        return None  # beyond the top-level package: Python refuses it too
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _dynamic_import_name(node: ast.Call) -> str | None:
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called not in _DYNAMIC_IMPORTERS or not node.args:
        return None
    first = node.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value:
        return first.value if not first.value.startswith(".") else None
    return None


def find_spec_without_import(module_name: str) -> ModuleSpec | None:
    """Where ``module_name`` would be loaded from; nothing is imported or run.

    ``importlib.util.find_spec("a.b")`` imports (runs) package ``a``: the parents are walked by
    hand instead."""
    parts = module_name.split(".")
    spec = importlib.util.find_spec(parts[0])
    for depth in range(2, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return None
        name, locations = ".".join(parts[:depth]), list(spec.submodule_search_locations)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, locations)
        except KeyError:  # a namespace package whose parent is not imported: found by hand
            portions = [str(Path(p) / parts[depth - 1]) for p in locations]
            spec = ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [p for p in portions if os.path.isdir(p)]
    return spec


def import_problem(name: str) -> str:
    """Why ``name`` is not found here, as an import would say it, and where it was
    looked for (nothing is imported): the line that names a kernel module missing here."""
    try:
        spec = find_spec_without_import(name)
    except (ImportError, ValueError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    else:
        if spec is not None:
            return f"{name} is found at {spec.origin}"
        problem = f"ModuleNotFoundError: No module named {name!r}"
    return f"{problem} (looked in {', '.join(_searched())} and the installed packages)"


def _searched() -> list[str]:
    """The folders of ``sys.path`` a person puts modules in: not the standard library's,
    not a site directory (those hold what is installed)."""
    system = {sysconfig.get_path(n) for n in ("stdlib", "platstdlib", "purelib", "platlib")}
    installed = [os.path.realpath(p) for p in (*site.getsitepackages(), *system) if p]
    shown: list[str] = []
    for entry in sys.path:
        path = os.path.realpath(entry or ".")
        inside = any(path == d or path.startswith(d + os.sep) for d in installed)
        if not inside and not entry.endswith(".zip") and entry not in shown:
            shown.append(entry or ".")
    return shown


def _in_installed_package(name: str) -> bool:
    """Whether ``name`` is a submodule of an installed package (not of a namespace package,
    whose portions may come from anywhere)."""
    top = name.partition(".")[0]
    if top == name:
        return False
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    return spec is not None and _installed(spec.origin)


def _installed(path: str | None) -> bool:
    """Whether an installed distribution's RECORD lists the file at ``path``."""
    if path is None or not os.path.isabs(path):
        return False
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    while True:
        infos = _distributions_in(directory)
        if infos:
            relative = os.path.relpath(path, directory).replace(os.sep, "/")
            return any(_lists(info, relative) for info in _likely_first(infos, relative))
        parent = os.path.dirname(directory)
        if parent == directory:
            return False
        directory = parent


@cache
def _distributions_in(directory: str) -> tuple[str, ...]:
    """The ``.dist-info`` folders in ``directory``: none unless it is a site directory."""
    try:
        return tuple(sorted(e.path for e in os.scandir(directory) if e.name.endswith(".dist-info")))
    except OSError:
        return ()


def _likely_first(infos: tuple[str, ...], relative: str) -> list[str]:
    """The distributions named like the file's top folder first: a serving image holds a
    hundred RECORDs, and torch's alone lists 15,000 files."""
    top = relative.split("/")[0].removesuffix(".py").lower().replace("-", "_")

    def named_like(info: str) -> bool:
        name = os.path.basename(info).partition("-")[0].lower()
        return bool(name) and (top.startswith(name) or name.startswith(top))

    return sorted(infos, key=lambda info: not named_like(info))


def _lists(info: str, relative: str) -> bool:
    rows = _record_rows(info)
    return f"\n{relative}," in rows or f'\n"{relative}",' in rows


@cache
def _record_rows(info: str) -> str:
    """A distribution's RECORD, each row after a newline; empty when it has none."""
    try:
        with open(os.path.join(info, "RECORD"), encoding="utf-8") as file:
            return "\n" + file.read()
    except OSError:
        return ""  # no RECORD: the distribution lists nothing, so owns nothing
