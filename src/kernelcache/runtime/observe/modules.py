"""The modules a compile loaded (``sys.modules``, the imports nothing could satisfy) and the
``.pth`` files of the site directories."""

from __future__ import annotations

import os
import site
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from kernelcache.runtime.observe.hooks import seen_so_far
from kernelcache.runtime.observe.identity import file_digest, identity_of, realpath

_NOT_FILES = ("/proc/", "/sys/", "/dev/")


_OWN_PACKAGE = "kernelcache"


_OWN_HOOK = "zz_kernelcache_runtime.pth"


# Always looked for: site imports them at start, before anything can observe it.
_SITE_HOOKS = ("sitecustomize", "usercustomize")


def modules_read(roots: tuple[str, ...]) -> tuple[dict[str, tuple[str | None, str]], list[str]]:
    """(module -> (its file, identity), the files of the installed modules loaded before
    observation began).

    Every module the import system loaded, and ``absent`` for every project-level import
    that failed (an optional helper that may appear later). One loaded before observation
    began that belongs to the Python installation or a distribution (the warm's own
    machinery: the build, the stamp, a toolchain it asked) is keyed by its distribution, not
    file by file; a project's (one a ``.pth`` hook or ``sitecustomize`` imported) by its file.
    """
    loaded: dict[str, tuple[str | None, str]] = {}
    found: dict[str, tuple[str | None, str]] = {}
    installed: list[str] = []
    for name, module in list(sys.modules.items()):
        # The program (``__main__``, also ``__mp_main__`` under multiprocessing) started the
        # process; it is not the kernel's (a kernel defined in it is keyed by its source).
        if module is None or module is sys.modules.get("__main__") or _own(name):
            continue
        if getattr(module, "__spec__", None) is None:
            continue  # made by another module's code (an extension's submodules): its file's
        seen = _module_entries.get(name)
        if seen is None or seen[0] is not module:  # a module's file is read once, at import
            path, kind = module_file(module)
            identity = kind or (identity_of(path) if path and os.path.isfile(path) else "absent")
            seen = _module_entries[name] = (module, path, identity)
        _, path, identity = seen
        if path is not None and left_out(path, roots):
            continue
        loaded[name] = (path, identity)
        if name in seen_so_far.modules_at_start and identity.startswith(
            ("dist ", "python ", "builtin")
        ):
            if path is not None:
                installed.append(path)
            continue
        found[name] = (path, identity)
    for name in [*seen_so_far.absent, *_SITE_HOOKS]:
        top = name.partition(".")[0]
        if name in loaded or _own(name) or top in sys.stdlib_module_names:
            continue
        if top not in loaded or not loaded[top][1].startswith(("dist ", "python ")):
            found[top if top not in loaded else name] = (None, "absent")
    return found, installed


_module_entries: dict[str, tuple[ModuleType, str | None, str]] = {}


def _own(name: str) -> bool:
    return name == _OWN_PACKAGE or name.startswith(_OWN_PACKAGE + ".")


def module_file(module: ModuleType) -> tuple[str | None, str]:
    """(the file a module was loaded from, else None with ``builtin`` or ``namespace``); for
    a module in a zip archive, the archive."""
    spec = getattr(module, "__spec__", None)
    if getattr(spec, "origin", None) in ("built-in", "frozen"):
        return None, "builtin"  # part of the interpreter, even with a __file__ for show
    archive = getattr(getattr(spec, "loader", None), "archive", None)
    if isinstance(archive, str):
        return realpath(archive), ""
    origin = spec.origin if spec is not None and spec.has_location else None
    origin = origin or getattr(module, "__file__", None)
    if isinstance(origin, str) and origin:
        return realpath(origin), ""
    if spec is not None and spec.submodule_search_locations is not None:
        return None, "namespace"
    return None, "builtin"


def left_out(path: str, roots: tuple[str, ...]) -> bool:
    return path.startswith(_NOT_FILES) or any(
        path == root or path.startswith(root + os.sep) for root in roots
    )


@cache
def is_cached_bytecode(path: str) -> bool:
    """A ``__pycache__`` file beside its source: the source is what is recorded."""
    directory, name = os.path.split(path)
    if os.path.basename(directory) != "__pycache__" or not name.endswith(".pyc"):
        return False
    source = os.path.join(os.path.dirname(directory), name.partition(".")[0] + ".py")
    return os.path.isfile(source)


def site_pth_files() -> list[str]:
    """The ``.pth`` files of the site directories (site runs each at interpreter start), less
    copies of kernelcache's own start-up hook: it only installs kernelcache's runtime."""
    directories = [*site.getsitepackages(), site.getusersitepackages()]
    found = []
    for directory in dict.fromkeys(os.path.realpath(d) for d in directories):
        try:
            found += [e.path for e in os.scandir(directory) if e.name.endswith(".pth")]
        except OSError:
            continue
    return sorted(path for path in found if file_digest(path) != _own_hook())


@cache
def _own_hook() -> str | None:
    """The digest of ``zz_kernelcache_runtime.pth``, beside the package in a source tree and
    in site-packages alike."""
    hook = Path(__file__).resolve().parents[3] / _OWN_HOOK
    return file_digest(str(hook)) if hook.is_file() else None
