"""The variables a compile read: the kernel's own code's and every toolchain compile setting,
each by its meaning (a location by the file it names, never the path)."""

from __future__ import annotations

import os
from typing import Any

from kernelcache.runtime.observe.hooks import seen_so_far
from kernelcache.runtime.observe.identity import identity_of, in_python, installed_row, realpath

# Variables that say where, who or which host: never factors (docs/keys.md).
_HOST_VARIABLES = frozenset(
    {
        "HOME", "PATH", "PWD", "OLDPWD", "TMPDIR", "TMP", "TEMP", "USER", "LOGNAME", "SHELL",
        "HOSTNAME", "LANG", "LANGUAGE", "TZ", "TERM", "COLUMNS", "LINES", "PYTHONPATH",
        "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "CUTE_DSL_ARCH", "PYTHONHASHSEED",
    }
)  # fmt: skip


_HOST_PREFIXES = ("LC_", "KERNELCACHE_", "XDG_", "SSH_")


_LOCATION_WORDS = frozenset({"DIR", "PATH", "HOME", "FILE", "ROOT", "BASE", "WORKSPACE"})


def variables_read() -> dict[str, Any]:
    """The variables read by code outside the Python installation and the distributions (the
    kernel's own code), and every toolchain compile setting read by anyone."""
    from kernelcache.settings import SETTING_PREFIX, compile_settings

    read = {
        name
        for name, readers in seen_so_far.env.items()
        if not _host_variable(name) and any(_project_file(f) for f in readers)
    }
    settings = compile_settings({n: os.environ[n] for n in seen_so_far.env if n in os.environ})
    read |= {name.removeprefix(SETTING_PREFIX) for name in settings}
    return {name: env_value(name) for name in sorted(read)}


def _host_variable(name: str) -> bool:
    return name in _HOST_VARIABLES or name.startswith(_HOST_PREFIXES)


def env_value(name: str) -> Any:
    """A variable by its meaning: a location is the file it names (its identity), never the
    path; any other value as set (``/opt-level=0`` is an option, not a path)."""
    value = os.environ.get(name)
    if value is None or not _is_location(name, value):
        return value
    path = os.path.realpath(os.path.expanduser(value))
    return {"file": identity_of(path)} if os.path.isfile(path) else {"location": None}


def _is_location(name: str, value: str) -> bool:
    if _LOCATION_WORDS & set(name.split("_")):
        return True
    if not value.startswith(("/", "~")):
        return False
    first = os.path.expanduser(value).lstrip("/").split("/")[0]
    return bool(first) and os.path.exists("/" + first)  # /opt/x names a place; /opt-level=0 not


def _project_file(path: str) -> bool:
    if path.startswith("<") or not os.path.isabs(path):
        return False
    path = realpath(path)
    return not (installed_row(path) or in_python(path) or _own_file(path))


def _own_file(path: str) -> bool:
    kernelcache = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    return path.startswith(kernelcache + os.sep)
