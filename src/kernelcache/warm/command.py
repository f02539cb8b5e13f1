"""The command warmer: run any command (an engine's own warm-up) with every cache env set.

The command sees each variable of ``CACHE_ENV`` pointed at its staging subdirectory, plus
``KERNELCACHE_ARCH``, ``KERNELCACHE_FILES`` (the generation's ``files/``) and
``KERNELCACHE_WORKLOAD`` (the spec's workload as JSON). Output streams through, so a long
warm-up shows its own progress.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from kernelcache.errors import WarmError
from kernelcache.warm import Warmer, WarmerReport, cache_env, dir_usage


class CommandWarmer(Warmer):
    type = "command"

    @property
    def label(self) -> str:
        return f"command {self.config.command[0]}"

    def run(self, files_dir: Path, arch: str) -> WarmerReport:
        before = dir_usage(files_dir)
        env = {
            **os.environ,
            **self.config.env,
            **cache_env(files_dir),
            "CUTE_DSL_ARCH": arch,
            "KERNELCACHE_ARCH": arch,
            "KERNELCACHE_FILES": str(files_dir),
            "KERNELCACHE_WORKLOAD": json.dumps(self.config.workload, sort_keys=True),
        }
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                self.config.command,
                env=env,
                cwd=self.spec_dir,
                timeout=self.config.timeout_seconds,
                check=False,
            )
        except FileNotFoundError as exc:
            raise WarmError(f"command warmer: {self.config.command[0]}: not found") from exc
        except subprocess.TimeoutExpired as exc:
            raise WarmError(
                f"command warmer: {self.config.command[0]} ran past "
                f"timeoutSeconds={self.config.timeout_seconds}"
            ) from exc
        if proc.returncode != 0:
            raise WarmError(
                f"command warmer: {self.config.command[0]} exited with {proc.returncode} for {arch}"
            )
        after = dir_usage(files_dir)
        grown = {
            sub: {
                "files": use["files"] - before.get(sub, {}).get("files", 0),
                "bytes": use["bytes"] - before.get(sub, {}).get("bytes", 0),
            }
            for sub, use in after.items()
            if use != before.get(sub)
        }
        return WarmerReport(
            warmer=self.label,
            seconds=round(time.perf_counter() - start, 3),
            files=sum(g["files"] for g in grown.values()),
            bytes=sum(g["bytes"] for g in grown.values()),
            dirs=grown,
        )
