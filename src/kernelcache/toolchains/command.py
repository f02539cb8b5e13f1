"""The command warmer: run any command (an engine's own warm-up) with every cache env set.

The command sees each toolchain's cache variable (``kernelcache.toolchains.cache_env()``)
pointed at its staging subdirectory, plus
``KERNELCACHE_ARCH``, ``KERNELCACHE_FILES`` (the generation's ``files/``) and
``KERNELCACHE_WORKLOAD`` (the spec's workload as JSON). Output streams through, so a long
warm-up shows its own progress (without terminal escapes when it goes to a pipe or a log).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, TextIO

from kernelcache.deadline import kill_group
from kernelcache.errors import WarmError, ended_by_interrupt, plain
from kernelcache.toolchains.base import (
    FULL_WORDS,
    Toolchain,
    Warmer,
    WarmerReport,
    make_cache_dirs,
)


class CommandWarmer(Warmer):
    type = "command"

    @property
    def label(self) -> str:
        return f"command {self.config.command[0]}"

    def env(self, files_dir: Path, arch: str) -> dict[str, str]:
        from kernelcache.toolchains import cache_env

        return {
            **make_cache_dirs(files_dir, cache_env()),
            "CUTE_DSL_ARCH": arch,
            "KERNELCACHE_ARCH": arch,
            "KERNELCACHE_FILES": str(files_dir),
            "KERNELCACHE_WORKLOAD": json.dumps(self.config.workload, sort_keys=True),
        }

    def counted_dirs(self, files_dir: Path) -> list[str]:
        """Every subdirectory of files/: a command may fill one no toolchain declares."""
        return sorted(p.name for p in files_dir.iterdir() if p.is_dir())

    def produce(self, files_dir: Path, arch: str, report: WarmerReport) -> None:
        returncode = self._run(dict(os.environ), arch)
        if ended_by_interrupt(returncode):
            raise KeyboardInterrupt  # the command saw the Ctrl-C first: so is this warm
        if returncode != 0:
            raise WarmError(
                f"command warmer: {self.config.command[0]} exited with {returncode} for {arch}"
            )

    def _run(self, env: dict[str, str], arch: str) -> int:
        """Run the command in its own process group, and kill the group when it is done: a
        background child left behind must neither outlive the deadline nor write into the
        generation after it is sealed. Piped output loses its terminal escapes."""
        try:
            proc = subprocess.Popen(
                self.config.command,
                env=env,
                cwd=self.spec_dir,
                start_new_session=True,
                stdout=None if sys.stdout.isatty() else subprocess.PIPE,
                stderr=None if sys.stderr.isatty() else subprocess.PIPE,
            )
        except FileNotFoundError as exc:
            raise WarmError(f"command warmer: {self.config.command[0]}: not found") from exc
        except PermissionError as exc:
            raise WarmError(f"command warmer: {self.config.command[0]}: not executable") from exc
        relays = [
            threading.Thread(target=self._relay, args=(source, sink), daemon=True)
            for source, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
            if source is not None
        ]
        for relay in relays:
            relay.start()
        try:
            return proc.wait(timeout=self.config.timeout_seconds)
        except subprocess.TimeoutExpired:
            raise WarmError(
                f"command warmer: {self.config.command[0]} ran past "
                f"timeoutSeconds={self.config.timeout_seconds} for {arch}"
            ) from None
        finally:
            kill_group(proc.pid)
            proc.wait()
            for relay in relays:
                relay.join(timeout=5)

    def _relay(self, source: IO[bytes], sink: TextIO) -> None:
        """Copy a child's output line by line, without terminal escapes; note the last line
        that says the disk is full (what "exited with 1" was)."""
        with source:
            for raw in source:
                line = plain(raw.decode(errors="replace").rstrip("\n"))
                if any(words in line for words in FULL_WORDS):
                    self.said_full = line
                sink.write(line + "\n")
                sink.flush()


# Any command: it uses the other toolchains' caches and has none of its own.
TOOLCHAIN = Toolchain(name="command", warmers=(CommandWarmer,))
