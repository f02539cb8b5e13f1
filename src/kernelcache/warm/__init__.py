"""Warmers: plugins that drive one toolchain with its caches pointed at a staging dir.

Each warmer declares the kernel sources it depends on (they become stamp factors), runs,
and reports what it produced. A warmer that was declared but produced nothing is a failed
warm, not a success: persistence that fails open fails silently, so we check the files.

The env contract: every toolchain's cache variable points at its own subdirectory of the
generation's ``files/``, so whatever runs under a warmer (an entry point, ``vllm serve``, a
script) fills the generation. The same table tells the serving side where to look.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kernelcache.errors import WarmError
from kernelcache.spec import Warmer as WarmerSpec

# Cache variable -> subdirectory of files/ it is pointed at during a warm.
CACHE_ENV: dict[str, str] = {
    "KERNELCACHE_CUTE_DSL_DIR": "cute-dsl",  # kernelcache's disk layer for cute.compile
    "CUTE_DSL_CACHE_DIR": "cute-dsl-jit",  # the DSL's own file cache (jit-decorated calls)
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "VLLM_CACHE_ROOT": "vllm",
    "SGLANG_CACHE_DIR": "sglang",
}


def cache_env(files_dir: Path) -> dict[str, str]:
    """The cache variables pointed at subdirectories of ``files_dir`` (created here)."""
    env = {}
    for var, sub in CACHE_ENV.items():
        (files_dir / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(files_dir / sub)
    return env


@dataclass
class WarmerReport:
    """What one warmer did: shown in the build table and kept in the manifest."""

    warmer: str
    seconds: float = 0.0
    kernels: list[str] = field(default_factory=list)
    compiled: int = 0
    files: int = 0
    bytes: int = 0
    dirs: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dir_usage(files_dir: Path) -> dict[str, dict[str, int]]:
    """Files and bytes per toolchain subdirectory, for the warm report."""
    usage: dict[str, dict[str, int]] = {}
    for sub in sorted(p for p in files_dir.iterdir() if p.is_dir()):
        files = [p for p in sub.rglob("*") if p.is_file() and not p.is_symlink()]
        if files:
            usage[sub.name] = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    return usage


class Warmer(ABC):
    """One declared warmer of a spec."""

    type: ClassVar[str]

    def __init__(self, config: WarmerSpec, spec_dir: Path | None = None) -> None:
        self.config = config
        self.spec_dir = spec_dir

    @property
    def label(self) -> str:
        return self.type

    def sources(self) -> dict[str, str]:
        """Kernel-source digests this warmer depends on: stamp factors ``source/<name>``."""
        return {}

    @abstractmethod
    def run(self, files_dir: Path, arch: str) -> WarmerReport:
        """Fill ``files_dir`` (the generation's ``files/``) and report what was produced."""


# Warmer type -> "module:Class"; imported only when a spec uses it (torch, triton and
# FlashInfer are heavy, and absent from the init-container image).
WARMERS = {
    "cute-dsl": "kernelcache.warm.cute_dsl:CuteDslWarmer",
    "triton": "kernelcache.warm.triton:TritonWarmer",
    "torch-compile": "kernelcache.warm.torch_compile:TorchCompileWarmer",
    "flashinfer": "kernelcache.warm.flashinfer:FlashInferWarmer",
    "command": "kernelcache.warm.command:CommandWarmer",
}


def warmer_class(kind: str) -> type[Warmer]:
    module_name, _, class_name = WARMERS[kind].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise WarmError(f"{kind} warmer unavailable here: {exc}") from exc
    cls: type[Warmer] = getattr(module, class_name)
    return cls


def make_warmers(configs: list[WarmerSpec], spec_dir: Path | None = None) -> list[Warmer]:
    return [warmer_class(c.type)(c, spec_dir) for c in configs]


def run_warmers(warmers: list[Warmer], files_dir: Path, arch: str) -> dict[str, Any]:
    """Run every warmer in order; the report that goes into the manifest."""
    reports = []
    start = time.perf_counter()
    for index, warmer in enumerate(warmers):
        report = warmer.run(files_dir, arch)
        if report.files == 0:
            raise WarmError(
                f"spec.warmers[{index}] ({warmer.label}) produced nothing for {arch}: "
                "a declared warmer must leave at least one artifact"
            )
        reports.append(report.to_dict())
    return {
        "arch": arch,
        "seconds": round(time.perf_counter() - start, 3),
        "warmers": reports,
        "dirs": dir_usage(files_dir),
    }
