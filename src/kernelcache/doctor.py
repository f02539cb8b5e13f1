"""``kernelcache doctor``: this environment checked against a generation or a spec.

Before anything runs (a warm, a serving pod) it says what the tools will see: the GPU and its
arch, which toolchains import and at which version, where each cache variable points and
whether it can be written, whether the start-up hook is installed, and, against a
generation, exactly the stamp factors that would make it miss. Every check is a row with a
status, every one reported whatever the others found: ``warn`` is something to act on,
``info`` what is worth knowing; a failed row carries the exit code of its class, and the
first one is the command's.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import site
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernelcache import contract, measure
from kernelcache import stamp as stamps
from kernelcache.errors import ExitCode, KernelCacheError, NoGpuInfoError, and_more
from kernelcache.toolchains import cache_env, toolchains
from kernelcache.toolchains.base import Toolchain

HOOK_FILE = "zz_kernelcache_runtime.pth"
IMPORT_TIMEOUT_S = 300

# Imports each module in one child (a broken toolchain can crash or hang its importer).
_IMPORT_PROBE = """
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        out[name] = None
    except BaseException as exc:
        out[name] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
print(json.dumps(out))
"""


@dataclass
class Check:
    """One row: ``status`` is ok, info (worth knowing, nothing to do), warn (something to
    act on) or fail; a failed row carries its exit code."""

    check: str
    status: str
    detail: str
    exit_code: int = 0


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    differences: list[dict[str, str | None]] = field(default_factory=list)

    def add(self, check: str, status: str, detail: str, code: ExitCode = ExitCode.OK) -> None:
        self.checks.append(Check(check, status, detail, int(code)))

    @property
    def exit_code(self) -> int:
        return next((c.exit_code for c in self.checks if c.status == "fail"), 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.exit_code == 0,
            "exit_code": self.exit_code,
            "checks": [asdict(c) for c in self.checks],
            "differences": self.differences,
        }


# The generation to compare with, given the arch seen here (None: none seen); it raises a
# KernelCacheError when it cannot be found or read, which is that row's failure.
GenerationOf = Callable[[str | None], Any]


def diagnose(
    *,
    generation: GenerationOf | None = None,
    warmer_types: list[str] | None = None,
    arch: str | None = None,
    arches: list[str] | None = None,
) -> Report:
    """Every check, each reported whatever the others found: ``generation`` adds the
    stamp comparison (an arch is then needed), ``warmer_types`` (a spec's) names the
    toolchains that must import; ``arches`` (a spec's) are named where no arch is seen."""
    report = Report()
    hint = f"name this node's arch with --arch ({' or '.join(arches or ['e.g. sm_90a'])})"
    seen_arch = _check_gpu(report, arch, generation is not None or arch is not None, hint)
    manifest = None
    if generation is not None:
        try:
            manifest = generation(seen_arch)
        except KernelCacheError as exc:
            report.add("generation", "fail", exc.message, exc.code)
    needed = _needed_toolchains(warmer_types or [], manifest)
    everyone: dict[str, tuple[str, str] | None] = {
        t.label: t.requires for t in toolchains() if t.requires is not None
    }
    _check_toolchains(report, needed or everyone, bool(needed))
    _check_ranges(report, needed or everyone, bool(needed))
    _check_cache_env(report, manifest is not None)
    _check_hook(report)
    if manifest is not None:
        _check_stamp(report, manifest, seen_arch)
    return report


def _check_gpu(report: Report, arch: str | None, need_arch: bool, hint: str) -> str | None:
    try:
        seen = measure.detect_arch(arch, hint)
    except NoGpuInfoError as exc:
        if need_arch:
            report.add("gpu", "fail", exc.message, ExitCode.NO_GPU_INFO)
        else:  # building needs no GPU: CuTe-DSL compiles for any arch given CUTE_DSL_ARCH
            why = exc.message.partition("; ")[0].removeprefix("cannot determine the target arch: ")
            detail = f"no arch seen here ({why}): none is needed to build for a spec's arches"
            report.add("gpu", "info", detail)
        return None
    product = measure.detect_gpu_product(seen)
    source = "given" if arch else ("CUTE_DSL_ARCH" if os.environ.get("CUTE_DSL_ARCH") else "GPU")
    report.add("gpu", "ok", f"arch {seen} ({source}), product {product or 'none seen'}")
    return seen


def _needed_toolchains(warmer_types: list[str], manifest: Any) -> dict[str, tuple[str, str] | None]:
    """What the spec's warmers and the generation's files/ subdirectories need to import,
    by the name the check is shown under (a warmer type; a toolchain without one: its name)."""
    needed = {kind: _owner(kind).requires for kind in warmer_types}
    subdirs = {f.path.split("/", 1)[0] for f in manifest.files} if manifest is not None else set()
    for sub in sorted(subdirs):
        owner = next((t for t in toolchains() if sub in t.cache_env.values()), None)
        owner = owner or next((t for t in toolchains() if sub in t.fills()), None)
        if owner is not None and owner.requires is not None:
            needed.setdefault(owner.label, owner.requires)
    return needed


def _owner(kind: str) -> Toolchain:
    return next(t for t in toolchains() if any(w.type == kind for w in t.warmers))


def _check_toolchains(
    report: Report, needed: dict[str, tuple[str, str] | None], required: bool
) -> None:
    failures = _import(sorted({r[1] for r in needed.values() if r is not None}))
    for toolchain, requires in needed.items():
        if requires is None:
            report.add(f"toolchain/{toolchain}", "ok", "no toolchain to import for this warmer")
            continue
        dist, module = requires
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = None
        error = failures.get(module)
        if error is None and version is not None:
            report.add(f"toolchain/{toolchain}", "ok", f"{dist}=={version}, import {module} ok")
            continue
        if version is None and not required:  # only a spec or generation that uses it needs it
            report.add(f"toolchain/{toolchain}", "info", f"{dist} is not installed")
            continue
        detail = f"{dist} is not installed" if version is None else f"import {module}: {error}"
        status = "fail" if required else "warn"
        report.add(f"toolchain/{toolchain}", status, detail, ExitCode.NOT_INSTALLED)


def _check_ranges(
    report: Report, needed: dict[str, tuple[str, str] | None], required: bool
) -> None:
    """The installed release of each toolchain that declares a supported range (vLLM)
    against it: outside, the warm and serving would refuse it (``Toolchain.version_problem``)."""
    for toolchain in toolchains():
        requires = needed.get(toolchain.label)
        if requires is None:
            continue
        try:
            version = importlib.metadata.version(requires[0])
        except importlib.metadata.PackageNotFoundError:
            continue  # the toolchain row says so
        problem = toolchain.version_problem(version)
        if problem is None:
            if toolchain.supported_range:
                supported = toolchain.supported_range
                detail = f"{requires[0]}=={version} is in the supported range ({supported})"
                report.add(f"range/{toolchain.label}", "ok", detail)
            continue
        status = "fail" if required else "warn"
        report.add(f"range/{toolchain.label}", status, problem, ExitCode.NOT_INSTALLED)


def _import(modules: list[str]) -> dict[str, str | None]:
    if not modules:
        return {}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _IMPORT_PROBE, *modules],
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
            check=False,
        )
        result: dict[str, str | None] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return {m: f"the import probe did not finish within {IMPORT_TIMEOUT_S} s" for m in modules}


def writable(path: Path) -> bool:
    """Whether ``path`` can be written, or created (its nearest existing parent writable)."""
    if path.exists():
        return os.access(path, os.W_OK | os.X_OK if path.is_dir() else os.W_OK)
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)


def _check_cache_env(report: Report, with_generation: bool) -> None:
    for var, sub in cache_env().items():
        value = os.environ.get(var)
        if not value and with_generation:
            report.add(f"cache/{var}", "ok", f"unset: kernelcache.runtime points it at files/{sub}")
        elif not value:
            report.add(f"cache/{var}", "ok", "unset: the toolchain's default")
        elif writable(Path(value)):
            report.add(f"cache/{var}", "ok", f"{value} (writable)")
        else:
            report.add(f"cache/{var}", "warn", f"{value} (not writable: new kernels are not kept)")


def _check_hook(report: Report) -> None:
    """A warning only where the runtime is asked for (``KERNELCACHE_RUNTIME=1``, as the
    webhook sets it in serving pods) and nothing would start it."""
    # site runs only the .pth files directly in a site directory, not those on PYTHONPATH.
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    found = next((Path(d) / HOOK_FILE for d in dirs if (Path(d) / HOOK_FILE).is_file()), None)
    enabled = contract.RUNTIME.read(os.environ)
    if found is not None and enabled:
        report.add("startup-hook", "ok", f"{found}, enabled ({contract.RUNTIME.name}=1)")
    elif found is not None:
        detail = f"{found}, off ({contract.RUNTIME.name}=1 turns it on, as serving pods get it)"
        report.add("startup-hook", "info", detail)
    elif enabled:
        detail = (
            f"{contract.RUNTIME.name}=1 but {HOOK_FILE} is in no site directory: nothing "
            "starts the runtime; install kernelcache into the environment or call "
            "kernelcache.runtime.install()"
        )
        report.add("startup-hook", "warn", detail)
    else:
        detail = f"{HOOK_FILE} is in no site directory: serving code calls runtime.install()"
        report.add("startup-hook", "info", detail)


def _check_stamp(report: Report, manifest: Any, arch: str | None) -> None:
    try:
        diffs = stamps.check_environment(manifest.stamp, manifest.generation, arch).diffs
    except KernelCacheError as exc:
        report.add("stamp", "fail", exc.message, exc.code)
        return
    report.differences = [{"factor": d.name, "generation": d.left, "here": d.right} for d in diffs]
    if not diffs and arch is None:  # the arch was not compared: no hit can be promised
        detail = (
            f"generation {manifest.generation}: the arch here is unknown (the gpu row), so it "
            "cannot be a hit; every other factor matches"
        )
        report.add("stamp", "fail", detail, ExitCode.NO_GPU_INFO)
        return
    untold = [note for t in toolchains() if (note := t.unchecked(manifest))]
    if not diffs and untold:  # kernels keyed by what they trace to: no stamp judges them
        detail = f"generation {manifest.generation}: every factor matches; {'; '.join(untold)}"
        report.add("stamp", "info", detail)
        return
    if not diffs:
        report.add("stamp", "ok", f"generation {manifest.generation}: every factor matches (a hit)")
        return
    named = "; ".join(d.describe() for d in diffs[:3]) + and_more([d.name for d in diffs[3:]])
    report.add(
        "stamp",
        "fail",
        f"generation {manifest.generation} would miss: {named}",
        ExitCode.STAMP_MISMATCH,
    )
