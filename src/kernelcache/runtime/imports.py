"""Run a function right after a module is imported, without importing it ourselves.

The runtime is installed at interpreter start (the ``.pth`` hook), where importing torch,
Triton or the CuTe DSL would cost seconds in every process, including those that never use
them. So each toolchain is hooked when the application imports it: a meta-path finder
notices the import, lets the real finder locate the module, and runs the callbacks once the
module's code has run, before the importer gets the module back. That is early enough to
load caches before the first compile and to patch ``cutlass.cute.compile`` before any other
module binds it.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

Callback = Callable[[ModuleType], None]


class _NotifyingLoader(importlib.abc.Loader):
    """Wraps a module's real loader for one import; the module only ever sees the real one."""

    def __init__(self, loader: Any, name: str, watcher: _Watcher) -> None:
        self._loader = loader
        self._name = name
        self._watcher = watcher

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        for callback in self._watcher.take(self._name):
            _run(callback, self._name, module)


class _Watcher(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``; answers only for watched names until they are imported.

    A name's callbacks are taken when its module runs, not when its spec is found: a probe
    such as ``importlib.util.find_spec("triton")`` (torch asks that before importing Triton)
    finds a spec and imports nothing, and the import that follows must still notify.
    """

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}
        self.lock = threading.Lock()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        with self.lock:
            if fullname not in self.callbacks:
                return None
        spec = _find_elsewhere(self, fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _NotifyingLoader(spec.loader, fullname, self)
        return spec

    def take(self, name: str) -> list[Callback]:
        """The callbacks of ``name``, once: its module has run."""
        with self.lock:
            return self.callbacks.pop(name, [])


def _find_elsewhere(
    skip: object, fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> ModuleSpec | None:
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if finder is skip or find_spec is None:
            continue
        spec: ModuleSpec | None = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _run(callback: Callback, name: str, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as exc:  # a hook must never break the application's import
        log.warning("kernelcache: hook on %s failed: %s: %s", name, type(exc).__name__, exc)


_watcher = _Watcher()


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported; at once if it already is."""
    module = sys.modules.get(name)
    if module is not None:
        _run(callback, name, module)
        return
    with _watcher.lock:
        _watcher.callbacks.setdefault(name, []).append(callback)
    if _watcher not in sys.meta_path:
        sys.meta_path.insert(0, _watcher)
