"""The local pipeline: warm → seal → publish per arch, and the environment check of verify.

``warm_arch`` is what one compile Job runs (``kernelcache warm``): it takes the key's writer
lock, re-checks whether the current generation already has this stamp (two builders of one
key produce one generation), points CURRENT back at a kept generation that has it (a
reverted spec or image: nothing compiled), else warms into a staging dir and publishes.
``build`` runs ``kernelcache warm`` once per arch, each in its own process, because
``CUTE_DSL_ARCH`` is read when the DSL is imported.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernelcache import progress
from kernelcache import stamp as stamps
from kernelcache.contract import CacheKey, image_reference
from kernelcache.errors import ExitCode, StorageError, one_line
from kernelcache.spec import KernelCache
from kernelcache.store import Manifest, Store
from kernelcache.toolchains import make_warmers
from kernelcache.toolchains.base import run_warmers


def cache_key(kc: KernelCache, arch: str) -> str:
    return str(CacheKey(kc.metadata.namespace, kc.metadata.name, arch))


@dataclass
class ArchResult:
    """One arch's outcome, printed in the build table and passed from the warm process."""

    arch: str
    status: str  # published | up-to-date | re-pointed (a kept generation made current) | failed
    generation: str | None = None
    stamp: str | None = None
    files: int = 0
    bytes: int = 0
    compiled: int = 0
    seconds: float = 0.0
    exit_code: int = 0
    message: str = ""
    # Per warmer type of this warm: compiled, seconds, files, bytes (empty when up-to-date).
    toolchains: list[dict[str, Any]] = field(default_factory=list)
    # The slowest kernels compiled, with their seconds (``progress.KernelTiming``).
    slowest_kernels: list[dict[str, Any]] = field(default_factory=list)
    # repo@sha256:... when the generation was also pushed to a registry (``warm --push``).
    artifact: str | None = None

    @classmethod
    def from_manifest(
        cls, arch: str, status: str, manifest: Manifest, seconds: float
    ) -> ArchResult:
        warmers = manifest.report.get("warmers", []) if status == "published" else []
        return cls(
            arch=arch,
            status=status,
            generation=manifest.generation,
            stamp=manifest.stamp["digest"],
            files=len(manifest.files),
            bytes=manifest.total_bytes,
            compiled=sum(w.get("compiled", 0) for w in warmers),
            seconds=round(seconds, 3),
            toolchains=toolchain_totals(warmers),
            slowest_kernels=[t.to_dict() for t in progress.slowest()] if warmers else [],
        )


def toolchain_totals(warmer_reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The warm report's warmers summed per type (a warmer's label starts with its type)."""
    totals: dict[str, dict[str, Any]] = {}
    for report in warmer_reports:
        kind = str(report.get("warmer", "?")).split(" ", 1)[0]
        total = totals.setdefault(
            kind, {"toolchain": kind, "compiled": 0, "seconds": 0.0, "files": 0, "bytes": 0}
        )
        for name in ("compiled", "files", "bytes"):
            total[name] += int(report.get(name, 0))
        total["seconds"] = round(total["seconds"] + float(report.get("seconds", 0.0)), 3)
    return list(totals.values())


def workload_of(kc: KernelCache, arch: str) -> list[dict[str, Any]]:
    """The declared warm-up of an arch: its warmers, entry points, commands and workloads (a
    factor; a warmer for other GPU classes only does not change this arch's generation)."""
    return [
        w.model_dump(by_alias=True, exclude={"timeout_seconds", "gpu_classes"})
        for w in kc.spec.warmers_for(arch)
    ]


def declared_factors(kc: KernelCache) -> dict[str, str]:
    """What the spec declares about the serving side: a new model or image is a new generation."""
    image = image_reference(kc.spec.engine.image, kc.spec.engine.image_digest)
    return {"model": kc.spec.model, "engine_image": image}


def warm_arch(
    kc: KernelCache,
    spec_dir: Path | None,
    store: Store,
    arch: str,
    *,
    signing_key: Any = None,
    force: bool = False,
) -> ArchResult:
    """Warm, seal and publish one arch; a no-op when the current generation has this stamp,
    a re-point of CURRENT when a kept one has it (unless ``force``)."""
    start = time.perf_counter()
    os.environ["CUTE_DSL_ARCH"] = arch  # before any warmer imports the DSL
    configs = kc.spec.warmers_for(arch)
    warmers = make_warmers(configs, spec_dir, kc.spec.gpu_classes)
    sources = {name: digest for w in warmers for name, digest in w.sources().items()}
    stamp = stamps.collect(
        arch=arch,
        sources=sources,
        workload=workload_of(kc, arch),
        extra=declared_factors(kc),
        measured=sorted({name for w in warmers for name in w.measured_factors()}),
        sm_counts=[count for w in warmers for count in w.sm_counts(arch)],
        paths={name: path for w in warmers for name, path in w.path_factors().items()},
        ask_triton=True,
    )
    key = cache_key(kc, arch)

    def waiting(holder: str) -> None:
        progress.note(f"{key}: waiting for the writer lock ({holder})")

    with store.writer(key, on_wait=waiting) as writer:
        current = writer.current_manifest()
        if current is not None and current.stamp.get("digest") == stamp.digest and not force:
            return ArchResult.from_manifest(
                arch, "up-to-date", current, time.perf_counter() - start
            )
        kept = None
        if not force:
            kept = writer.make_current_again(
                stamp.digest, signing_key=signing_key, keep=kc.spec.retention.generations
            )
        if kept is not None:
            return ArchResult.from_manifest(arch, "re-pointed", kept, time.perf_counter() - start)
        files_dir = writer.staging()
        positions = [kc.spec.warmers.index(c) for c in configs]
        report = run_warmers(warmers, files_dir, arch, positions)
        manifest = writer.publish(
            files_dir,
            stamp.to_dict(),
            report,
            signing_key=signing_key,
            keep=kc.spec.retention.generations,
        )
    return ArchResult.from_manifest(arch, "published", manifest, time.perf_counter() - start)


def build(
    spec_path: Path,
    store_root: Path,
    arches: list[str],
    *,
    signing_key_path: Path | None = None,
    force: bool = False,
    on_start: Callable[[str], None] = lambda arch: None,
    on_output: Callable[[str, str], None] = lambda arch, line: None,
    on_done: Callable[[ArchResult], None] = lambda result: None,
) -> list[ArchResult]:
    """Run ``kernelcache warm`` for each arch in its own process, one after another.

    ``on_output`` gets every line the warm process prints (its warmers' too), as it prints
    it, except its final error line: that becomes the failed result's message.
    """
    results = []
    for arch in arches:
        on_start(arch)
        result = _warm_in_subprocess(
            spec_path, store_root, arch, signing_key_path, force, functools.partial(on_output, arch)
        )
        on_done(result)
        results.append(result)
    return results


# The warm process's failure line (cli.main): kept as the message, printed once by build.
ERROR_PREFIX = "kernelcache: error: "
INTERNAL_ERROR_PREFIX = "kernelcache: internal error: "


def _warm_in_subprocess(
    spec_path: Path,
    store_root: Path,
    arch: str,
    signing_key_path: Path | None,
    force: bool,
    on_output: Callable[[str], None],
) -> ArchResult:
    with tempfile.TemporaryDirectory(prefix="kernelcache-warm-") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "kernelcache", "warm",
            "-f", str(spec_path), "--store", str(store_root), "--arch", arch,
            "--result", str(result_path), "--progress",
        ]  # fmt: skip
        if signing_key_path is not None:
            cmd += ["--signing-key", str(signing_key_path)]
        if force:
            cmd.append("--force")
        start = time.perf_counter()
        errors: list[str] = []
        ours = False  # the last failure line is kernelcache's own "error:" line
        # One pipe for both streams keeps the warmers' lines in the order they printed them;
        # unbuffered, so a line arrives when it is printed, not when the child exits.
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # A warm-up that prints bytes of another encoding must not end the build.
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env=env,
        ) as proc:  # fmt: skip
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.startswith(ERROR_PREFIX):
                    errors.append(one_line(line.removeprefix(ERROR_PREFIX)))
                    ours = True
                elif line.startswith(INTERNAL_ERROR_PREFIX):
                    errors.append(one_line(line.removeprefix("kernelcache: ")))
                    ours = False
                elif line.strip():
                    on_output(line)
        if result_path.exists():
            return ArchResult(**json.loads(result_path.read_text()))
        return ArchResult(
            arch=arch,
            status="failed",
            seconds=round(time.perf_counter() - start, 3),
            exit_code=_failure_class(proc.returncode, ours),
            message=errors[-1] if errors else f"warm process exited with {proc.returncode}",
        )


def _failure_class(returncode: int, ours: bool) -> int:
    """The warm process's exit code when kernelcache itself reported the failure; anything
    else (a warmer that ended the process, a signal) is a failed warm, never another class."""
    documented = returncode in set(ExitCode) - {ExitCode.OK}
    return returncode if ours and documented else int(ExitCode.WARM_FAILED)


def write_result(path: Path, result: ArchResult) -> None:
    try:
        path.write_text(json.dumps(asdict(result)))
    except OSError as exc:
        message = f"{path}: cannot write the result: {exc.strerror}"
        raise StorageError(message, path=str(path)) from exc


def result_exit_code(results: list[ArchResult]) -> int:
    failed = [r for r in results if r.status == "failed"]
    return failed[0].exit_code if failed else int(ExitCode.OK)
