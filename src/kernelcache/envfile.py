"""The env file: what the init-container hands the serving container, both sides of it.

``kernelcache verify --materialize DIR`` writes ``DIR/kernelcache.env`` last, atomically, once
the generation is checked and copied: its presence says the copy is ready. It holds exactly
the settings the runtime reads from it (``contract.Settings``: the generation directory, the
name label and this node's arch; strictness is the container's own setting) as
shell-quoted ``NAME=value`` lines, so ``set -a; . FILE`` reads it too. The report beside it
(``kernelcache-verify.json``) says everything else: the generation and stamp, where the
node's arch and product came from, the policy, what was dropped. The webhook names the file
to the serving container (``KERNELCACHE_ENV_FILE``); ``runtime.install()`` takes its lines
as defaults (``apply``).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from kernelcache import contract
from kernelcache.errors import StorageError, one_line

log = logging.getLogger(__name__)

# The hidden files ``write`` renames into place: a run killed midway leaves them.
TEMPORARY = tuple(f".{name}." for name in (contract.REPORT_FILE, contract.ENV_FILE))


def write(
    target: Path, values: Mapping[contract.Variable[Any], str], report: Mapping[str, Any]
) -> None:
    """The report, then the env file: the env file is what says the target is ready. Each is
    replaced in one rename, durable before this returns."""
    from kernelcache.store.fs import replace_synced  # the writing side only

    lines = [f"{variable.name}={shlex.quote(value)}" for variable, value in values.items()]
    for name, data in (
        (contract.REPORT_FILE, json.dumps(report, indent=1) + "\n"),
        (contract.ENV_FILE, "\n".join(lines) + "\n"),
    ):
        replace_synced(target / name, data.encode(), f".{name}.")  # in TEMPORARY


def remove(target: Path) -> None:
    """Forget an earlier run's env file first: if this run fails, nothing says "ready"."""
    for name in (contract.ENV_FILE, contract.REPORT_FILE):
        try:
            (target / name).unlink()
        except FileNotFoundError:
            continue
        except NotADirectoryError as exc:
            raise StorageError(f"{target}: not a directory", path=str(target)) from exc
        except OSError as exc:
            raise StorageError(
                f"{target / name}: cannot remove: {one_line(exc.strerror)}",
                path=str(target / name),
            ) from exc


def apply(environ: MutableMapping[str, str] | None = None) -> None:
    """Take the env file named by ``KERNELCACHE_ENV_FILE`` as defaults of ``environ``.

    Variables set on the container itself win. A named file that is missing means the
    init-container did not run: served without a generation, and refused in strict mode.
    """
    env = os.environ if environ is None else environ
    settings = contract.Settings.from_env(env)
    if settings.env_file is None:
        return
    try:
        text = settings.env_file.read_text()
    except OSError as exc:
        message = f"{contract.ENV_FILE_PATH.name}={settings.env_file}: cannot read: {exc.strerror}"
        if settings.strict:
            raise StorageError(message, path=str(settings.env_file)) from None
        log.warning("kernelcache: %s; serving without a generation", message)
        return
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 1 and "=" in words[0]:
            name, _, value = words[0].partition("=")
            env.setdefault(name, value)
