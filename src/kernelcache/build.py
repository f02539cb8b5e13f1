"""The local pipeline: warm → seal → publish per arch, and the environment check of verify.

``warm_arch`` is what one compile Job runs (``kernelcache warm``): it takes the key's writer
lock, re-checks whether the current generation already has this stamp and would serve every
kernel its warmers declare as a strict pod looks them up (CuTe-DSL kernels are traced and
keyed by their IR: a generation that strict pods would refuse is never up to date; two
builders of one key produce one generation; with a signing key it must also verify in full
and be signed by it, else it is re-signed or, when it cannot be vouched for, compiled anew),
points CURRENT back at a kept generation that passes the same checks (a reverted spec or
image: nothing compiled; with a signing key only one whose signature verifies), else warms
into a staging dir and publishes.
``build`` runs ``kernelcache warm`` once per arch, each in its own process, because
``CUTE_DSL_ARCH`` is read when the DSL is imported.
"""

from __future__ import annotations

import enum
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernelcache import learned, measure, progress
from kernelcache import stamp as stamps
from kernelcache.arch import product_slug
from kernelcache.contract import CacheKey, image_reference
from kernelcache.errors import (
    ExitCode,
    SignatureError,
    StorageError,
    and_more,
    ended_by_interrupt,
    one_line,
)
from kernelcache.spec import KernelCache, LearnedKey
from kernelcache.store import FILES_DIR, Manifest, Store, fingerprint
from kernelcache.toolchains import check_installed, is_tuning_file, make_warmers
from kernelcache.toolchains.base import run_warmers


def cache_key(kc: KernelCache, arch: str) -> str:
    return str(CacheKey(kc.metadata.namespace, kc.metadata.name, arch))


class Status(enum.StrEnum):
    """What a warm did for an arch: every status ``build`` and ``warm`` print (their JSON
    schema enumerates exactly these; tests/test_cli.py derives the set from this type)."""

    PUBLISHED = "published"  # compiled and published
    UP_TO_DATE = "up-to-date"  # the current generation has the stamp (and the signature)
    RE_SIGNED = "re-signed"  # the current one had the stamp and was signed now: no compile
    RE_POINTED = "re-pointed"  # a kept generation with the stamp was made current again
    FAILED = "failed"
    # --dry-run: what a warm would do, nothing compiled or changed (up-to-date as above)
    WOULD_COMPILE = "would-compile"  # no generation has the stamp: the warmers would run
    WOULD_RE_POINT = "would-re-point"  # a kept generation has it: it would be made current


@dataclass
class ArchResult:
    """One arch's outcome, printed in the build table and passed from the warm process."""

    arch: str
    status: Status
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
    # The fingerprint of the key that signed the generation (``store.fingerprint``), or None.
    signed_by: str | None = None
    # --dry-run: the warmers that would run, and the factors that differ from the current
    # generation's stamp ({"factor", "current", "new"}; a value None: absent on that side).
    would_run: list[str] = field(default_factory=list)
    changed: list[dict[str, str | None]] = field(default_factory=list)
    # Kernels the warm still met after ready, as its warmers named them (a few: this travels
    # in a Job's termination message).
    coverage_gaps: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.status = Status(self.status)  # read back from the warm process's JSON

    @classmethod
    def from_manifest(
        cls,
        arch: str,
        status: Status,
        manifest: Manifest,
        seconds: float,
        signed_by: str | None = None,
        report: Mapping[str, Any] | None = None,
    ) -> ArchResult:
        """``report``: this warm's own; a forced rebuild that compiled the same bytes
        publishes the generation already there, whose manifest keeps the first build's."""
        if report is None:
            report = manifest.report
        warmers = report.get("warmers", []) if status is Status.PUBLISHED else []
        return cls(
            arch=arch,
            status=status,
            signed_by=signed_by,
            generation=manifest.generation,
            stamp=manifest.stamp["digest"],
            files=len(manifest.files),
            bytes=manifest.total_bytes,
            compiled=sum(w.get("compiled", 0) for w in warmers),
            seconds=round(seconds, 3),
            toolchains=toolchain_totals(warmers),
            slowest_kernels=[t.to_dict() for t in progress.slowest()] if warmers else [],
            coverage_gaps=named_gaps(warmers),
        )


GAPS_SHOWN = 3  # a termination message holds 4 KiB: the rest are in the generation


def named_gaps(warmer_reports: list[dict[str, Any]]) -> list[str]:
    """The coverage gaps the warmers named, the first few in full and a count of the rest."""
    gaps = [str(g)[:160] for report in warmer_reports for g in report.get("coverage_gaps", [])]
    if len(gaps) > GAPS_SHOWN:
        more = len(gaps) - GAPS_SHOWN
        gaps = [*gaps[:GAPS_SHOWN], f"and {more} more (kernelcache inspect names them)"]
    return gaps


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


def declared_factors(kc: KernelCache, learned_keys: Sequence[LearnedKey] = ()) -> dict[str, str]:
    """What the spec declares about the serving side: a new model or image is a new generation.
    So are the token counts serving learned (``extra/learned_sizes``, only when there are
    any): a build that warms them is not the generation that lacked them."""
    image = image_reference(kc.spec.engine.image, kc.spec.engine.image_digest)
    factors = {"model": kc.spec.model, "engine_image": image}
    if sizes := learned.sizes(learned_keys):
        factors["learned_sizes"] = ",".join(map(str, sizes))
    return factors


def tuning_product(kc: KernelCache, arch: str, detected: str | None) -> str | None:
    """The GPU product a generation's tuning is for (its stamp's ``gpu_product``).

    The GPU the warm ran on, when it is of the arch: tuning is measured there. Else (a
    ``compileOn: cpu`` build, or ``any-gpu`` landing on another arch) the product the arch's
    GPU classes declare (``gpuProduct``), when they declare exactly one; else none, and the
    build publishes no tuning (``drop_unscoped_tuning``).
    """
    declared = {c.gpu_product for c in kc.spec.gpu_classes if c.arch == arch and c.gpu_product}
    slugs = {product_slug(p) for p in declared}
    if detected is not None:
        if slugs and product_slug(detected) not in slugs:
            print(
                f"kernelcache: warning: {arch}: tuning is measured on {detected}, not on the "
                f"declared {' or '.join(sorted(declared))}; pods on those refuse it (strict) "
                "or drop it",
                file=sys.stderr,
            )
        return detected
    return next(iter(declared)) if len(slugs) == 1 else None


def drop_unscoped_tuning(files_dir: Path, arch: str) -> list[str]:
    """Remove the staged tuning files of a build that knows no GPU product: tuning scoped to
    no product is refused by every strict pod, while the compiled kernels serve them all."""
    dropped = sorted(
        rel
        for path in files_dir.rglob("*")
        if path.is_file() and is_tuning_file(rel := path.relative_to(files_dir).as_posix())
    )
    for rel in dropped:
        (files_dir / rel).unlink()
    if dropped:
        print(
            f"kernelcache: warning: {arch}: dropped {len(dropped)} tuning file(s), e.g. "
            f"{dropped[0]}: no GPU of {arch} is visible and its GPU classes declare no "
            "single gpuProduct",
            file=sys.stderr,
        )
    return dropped


def warm_arch(
    kc: KernelCache,
    spec_dir: Path | None,
    store: Store,
    arch: str,
    *,
    signing_key: Any = None,
    trusted: Sequence[Any] | None = None,
    force: bool = False,
    learned_keys: Sequence[LearnedKey] = (),
) -> ArchResult:
    """Warm, seal and publish one arch; a no-op when the current generation has this stamp,
    a re-point of CURRENT when a kept one has it (unless ``force``). ``learned_keys``: what
    serving compiled (``kernelcache.learned``), warmed too.

    ``trusted``: the public keys serving pods verify with (the signing Secret's
    ``kernelcache.pub``). The signing key must be one of them (else pods would refuse what
    it signs: refused before anything is signed); the others are keys being rotated out,
    whose signatures make a generation worth re-signing rather than compiling again.
    """
    start = time.perf_counter()
    signer = fingerprint(signing_key) if signing_key is not None else None
    others = _rotated_out(signing_key, trusted)
    configs, warmers, product, stamp = _arch_stamp(kc, spec_dir, arch, learned_keys)
    key = cache_key(kc, arch)

    def waiting(holder: str) -> None:
        progress.note(f"{key}: waiting for the writer lock ({holder})")

    def done(status: Status, manifest: Manifest, report: Any = None) -> ArchResult:
        return ArchResult.from_manifest(
            arch, status, manifest, time.perf_counter() - start, signed_by=signer, report=report
        )

    def serves(generation: Path) -> bool:
        refusal = would_refuse(warmers, generation, arch)
        if refusal is not None:
            progress.note(f"{key}: {generation.name} would be refused: {refusal}")
        return refusal is None

    keep = kc.spec.retention.generations
    with store.writer(key, on_wait=waiting) as writer:
        current = writer.current_manifest()
        current_dir = store.current(key)
        if (
            current is not None
            and current.stamp.get("digest") == stamp.digest
            and not force
            and current_dir is not None
            and serves(current_dir)
        ):
            if signing_key is None:
                return done(Status.UP_TO_DATE, current)
            signed = writer.sign_current(signing_key, trusted=others)
            if signed is not None:
                return done(Status.RE_SIGNED if signed[1] else Status.UP_TO_DATE, signed[0])
        kept = None
        if not force:
            kept = writer.make_current_again(
                stamp.digest, signing_key=signing_key, keep=keep, trusted=others, accept=serves
            )
        if kept is not None:
            return done(Status.RE_POINTED, kept)
        files_dir = writer.staging()
        earlier = [store.current(key), *(path for path, _ in store.rollback_order(key))]
        for warmer in warmers:  # kernels keyed one by one are taken over where still valid
            warmer.earlier = tuple(
                dict.fromkeys(p / FILES_DIR for p in earlier if p is not None and p.is_dir())
            )
        positions = [kc.spec.warmers.index(c) for c in configs]
        report = run_warmers(warmers, files_dir, arch, positions)
        if product is None:
            drop_unscoped_tuning(files_dir, arch)
        manifest = writer.publish(
            files_dir, stamp.to_dict(), report, signing_key=signing_key, keep=keep
        )
    return done(Status.PUBLISHED, manifest, report)


def would_refuse(warmers: Sequence[Any], generation: Path, arch: str) -> str | None:
    """Why strict pods would refuse a kernel of ``generation``, whose stamp matches (None:
    they would load every one): the stamp holds what a build knows before it runs anything;
    a kernel keyed by its IR must be traced."""
    for warmer in warmers:
        refusal = warmer.would_refuse(generation / FILES_DIR, arch)
        if refusal is not None:
            return str(refusal)
    return None


def _arch_stamp(
    kc: KernelCache,
    spec_dir: Path | None,
    arch: str,
    learned_keys: Sequence[LearnedKey] = (),
    *,
    import_toolchains: bool = False,
) -> tuple[list[Any], list[Any], str | None, stamps.Stamp]:
    """The arch's warmer configs, its warmers, the GPU product its tuning is for, and the
    stamp a warm would publish under (the key: computed before anything compiles).

    Each warmer's package is checked first: found (a warm, whose warmers import it at once:
    an engine's import is seconds the warm would pay twice), or with ``import_toolchains``
    imported (a dry run, which runs no warmer to find a broken install)."""
    os.environ["CUTE_DSL_ARCH"] = arch  # before any warmer imports the DSL
    configs = kc.spec.warmers_for(arch)
    positions = [kc.spec.warmers.index(c) for c in configs]
    check_installed(
        configs, cache_key(kc, arch), import_them=import_toolchains, positions=positions
    )
    warmers = make_warmers(configs, spec_dir, kc.spec.gpu_classes, learned_keys)
    sources = {name: digest for w in warmers for name, digest in w.sources().items()}
    product = tuning_product(kc, arch, measure.detect_gpu_product(arch))
    stamp = stamps.collect(
        arch=arch,
        gpu_product=product,
        sources=sources,
        workload=workload_of(kc, arch),
        extra=declared_factors(kc, learned_keys),
        measured=sorted({name for w in warmers for name in w.measured_factors()}),
        sm_counts=[count for w in warmers for count in w.sm_counts(arch)],
        paths={name: path for w in warmers for name, path in w.path_factors().items()},
        ask_triton=True,
    )
    return configs, warmers, product, stamp


def plan_arch(
    kc: KernelCache,
    spec_dir: Path | None,
    store: Store,
    arch: str,
    *,
    force: bool = False,
    learned_keys: Sequence[LearnedKey] = (),
) -> ArchResult:
    """What ``warm_arch`` would do for one arch, and why, with nothing compiled, locked or
    written: up to date (the current generation has the stamp), re-point a kept generation
    that has it (once it verifies in full), or compile: then the warmers that would run and
    the factors that differ from the current generation's stamp. A signature is checked by
    the warm itself, not here."""
    start = time.perf_counter()
    _, warmers, _, stamp = _arch_stamp(kc, spec_dir, arch, learned_keys, import_toolchains=True)
    key = cache_key(kc, arch)
    current = store.current_manifest(key)
    result = ArchResult(arch=arch, status=Status.WOULD_COMPILE, stamp=stamp.digest)
    refusal = None
    if current is not None and not force:
        current_dir = store.current(key)
        if current.stamp.get("digest") == stamp.digest and current_dir is not None:
            # traced as the build traces them: no "up to date" that the build would rebuild
            refusal = would_refuse(warmers, current_dir, arch)
            if refusal is None:
                result.status, result.generation = Status.UP_TO_DATE, current.generation
                result.message = "the current generation has this stamp"
        else:
            kept = next(
                (m for path, m in store.rollback_order(key)
                 if m is not None and m.stamp.get("digest") == stamp.digest
                 and would_refuse(warmers, path, arch) is None),
                None,
            )  # fmt: skip
            if kept is not None:
                result.status, result.generation = Status.WOULD_RE_POINT, kept.generation
                result.message = (
                    f"kept generation {kept.generation[:16]} has this stamp: made current "
                    "again once it verifies in full"
                )
    if result.status is Status.WOULD_COMPILE:
        result.would_run = [w.label for w in warmers]
        if force:
            result.message = "--force: compiled whatever the store holds"
        elif current is None:
            result.message = f"{key}: no generation published yet"
        elif refusal is not None:
            result.message = (
                f"the current generation has this stamp, but strict pods would refuse it: "
                f"{refusal}; only the kernels whose keys moved are compiled"
            )
        else:
            diffs = stamps.explain(stamps.Stamp.from_dict(current.stamp), stamp)
            result.changed = [{"factor": d.name, "current": d.left, "new": d.right} for d in diffs]
            sides = (stamps.generation_side(current.generation), "this build")
            shown = "; ".join(d.describe(sides) for d in diffs[:3])
            more = and_more([d.name for d in diffs[3:]])
            result.message = f"the stamp differs: {shown}{more}"
    result.seconds = round(time.perf_counter() - start, 3)
    return result


def _rotated_out(signing_key: Any, trusted: Sequence[Any] | None) -> list[Any]:
    """The trusted keys other than the signing key's own; refuses a signing key that the
    trusted keys do not include (pods would refuse every generation it signs)."""
    if signing_key is None or trusted is None:
        return []
    own = fingerprint(signing_key)
    prints = [fingerprint(k) for k in trusted]
    if own not in prints:
        raise SignatureError(
            f"signing key {own} is not among the trusted public keys ({', '.join(prints)}): "
            "pods verifying with those would refuse what it signs"
        )
    return [k for k, p in zip(trusted, prints, strict=True) if p != own]


def build(
    spec_path: Path,
    store_root: Path,
    arches: list[str],
    *,
    signing_key_path: Path | None = None,
    public_key_path: Path | None = None,
    force: bool = False,
    dry_run: bool = False,
    learned_path: Path | None = None,
    on_start: Callable[[str], None] = lambda arch: None,
    on_output: Callable[[str, str], None] = lambda arch, line: None,
    on_done: Callable[[ArchResult], None] = lambda result: None,
) -> list[ArchResult]:
    """Run ``kernelcache warm`` for each arch in its own process, one after another.

    ``on_output`` gets every line the warm process prints (its warmers' too), as it prints
    it, except its final error line: that becomes the failed result's message. ``dry_run``:
    each says what it would do and why (``plan_arch``), compiling nothing. ``learned_path``:
    a learned record (``kernelcache.learned``) each warm adds to its workload.
    """
    results = []
    for arch in arches:
        on_start(arch)
        result = _warm_in_subprocess(
            spec_path,
            store_root,
            arch,
            (signing_key_path, public_key_path),
            [
                *(["--force"] if force else []),
                *(["--dry-run"] if dry_run else []),
                *(["--learned", str(learned_path)] if learned_path is not None else []),
            ],
            functools.partial(on_output, arch),
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
    keys: tuple[Path | None, Path | None],
    flags: list[str],
    on_output: Callable[[str], None],
) -> ArchResult:
    with tempfile.TemporaryDirectory(prefix="kernelcache-warm-") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "kernelcache", "warm",
            "-f", str(spec_path), "--store", str(store_root), "--arch", arch,
            "--result", str(result_path), "--progress",
        ]  # fmt: skip
        for option, key_path in zip(("--signing-key", "--public-key"), keys, strict=True):
            if key_path is not None:
                cmd += [option, str(key_path)]
        cmd += flags
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
        if ended_by_interrupt(proc.returncode):
            raise KeyboardInterrupt  # the warm saw the Ctrl-C first: so is this build
        if result_path.exists():
            return ArchResult(**json.loads(result_path.read_text()))
        return ArchResult(
            arch=arch,
            status=Status.FAILED,
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
    failed = [r for r in results if r.status is Status.FAILED]
    return failed[0].exit_code if failed else int(ExitCode.OK)
