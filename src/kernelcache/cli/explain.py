"""Why a generation would miss: ``explain`` (the factors that differ between two stamps, or
a stamp and this environment) and ``doctor`` (this environment checked before anything runs)."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

from kernelcache import output
from kernelcache.cli import common, options
from kernelcache.errors import ExitCode, MissingGenerationError, NoGpuInfoError, SpecError


def cmd_explain(args: argparse.Namespace) -> int:
    """Name the factors that differ between two stamps (exit 4 when any differ, or against
    env when a CuTe-DSL kernel read what is absent or changed here).

    Each side is a generation (a MANIFEST.json, a generation dir, or with --store a key or
    a generation id) or ``env``: this environment's stamp, recomputed against the other side.
    """
    from kernelcache import stamp as stamps

    if args.left == "env" and args.right == "env":
        raise SpecError("explain: at most one side can be 'env'")
    generations = {
        ref: (stamps.Stamp.from_dict(m.stamp), stamps.generation_side(m.generation))
        for ref in (args.left, args.right)
        if ref != "env"
        for m in [common.manifest_of(ref, args.store)]
    }
    if "env" in (args.left, args.right):  # recomputed against the factors the other recorded
        (recorded, _), *_ = generations.values()
        generations["env"] = (stamps.environment_stamp(recorded), stamps.ENVIRONMENT_SIDE)
    (left, left_side), (right, right_side) = generations[args.left], generations[args.right]
    diffs = stamps.explain(left, right)
    # Against this environment the stamp is not all: a CuTe-DSL kernel is keyed by its IR, and
    # its module may not import here at all. A stamp hit with such kernels is no hit.
    env_ref = (args.right if args.left == "env" else args.left) if "env" in generations else None
    kernels = _explain_cute(env_ref, args.store) if env_ref is not None else {}
    # What a stamp cannot judge here (IR-keyed kernels not traced): no verdict, not a hit.
    untold = _unchecked(env_ref, args.store) if env_ref is not None else []
    hit = not diffs and not kernels
    code = 0 if hit else int(ExitCode.STAMP_MISMATCH)
    if args.json:
        output.print_json(
            {
                "hit": (None if untold else True) if hit else False,
                "unchecked": untold,
                "left": left.digest,
                "right": right.digest,
                "differences": [
                    {"factor": d.name, "left": d.left, "right": d.right} for d in diffs
                ],
                "kernels": [
                    {"toolchain": "cute-dsl", "function": f, "problem": p}
                    for f, p in kernels.items()
                ],
            }
        )
        return code
    if env_ref is None:
        _explain_vllm(args.left, args.right, args.store)
    for function, problem in kernels.items():
        print(f"cute-dsl {function}: since its compile: {problem}")
    for diff in diffs:
        print(diff.describe((left_side, right_side)))
    if hit and untold:
        print(f"same stamp {left.digest}, no verdict on the rest: {'; '.join(untold)}")
    elif hit:
        print(f"same stamp {left.digest}: a hit")
    elif not diffs:
        print(
            f"same stamp {left.digest}, but no hit here: {len(kernels)} CuTe-DSL kernel(s) "
            "read what is absent or changed here (above); each loads only if it traces to "
            "the IR it was compiled from"
        )
    return code


def _unchecked(ref: str, store_root: Path | None) -> list[str]:
    """What each toolchain says a stamp cannot judge of the generation ``ref``."""
    from kernelcache.toolchains import toolchains

    manifest = common.manifest_of(ref, store_root)
    return [note for t in toolchains() if (note := t.unchecked(manifest))]


def _explain_cute(ref: str, store_root: Path | None) -> dict[str, str]:
    """Which input each CuTe-DSL kernel's compile read has moved in this environment, where a
    generation's records can tell: why a kernel's IR may differ here (it is keyed by its IR),
    or why it cannot be traced here at all (its module is absent)."""
    from kernelcache.store import FILES_DIR
    from kernelcache.toolchains.cute_dsl import SUBDIR

    path = Path(ref)
    if store_root is not None and not path.exists() and ref.count("/") == 2:
        found = common.existing_store(store_root).current(ref)
        path = found if found is not None else path
    generation = path if path.is_dir() else path.parent
    root = generation / FILES_DIR / SUBDIR
    if not root.is_dir():
        return {}
    try:  # resolve the DSL's modules as a serving process does
        import cutlass.cute  # noqa: F401
    except ImportError:
        return {}  # no DSL here: the stamp's own DSL factor says so
    from kernelcache.runtime.cute import moved_since

    return moved_since(root)


def _explain_vllm(left: str, right: str, store_root: Path | None) -> None:
    """vLLM's own cache key factors of two generations, where their warm reports hold them."""
    from kernelcache.toolchains import vllm

    reports = [common.manifest_of(ref, store_root).report for ref in (left, right)]
    for line in vllm.factor_diffs(*reports):
        print(f"vllm cache_key_factors: {line}")
    for line in vllm.coverage_diffs(*reports):
        print(f"vllm coverage: {line}")


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check this environment before anything runs: GPU and arch, toolchains, cache variables,
    the start-up hook, and against a generation the stamp factors that would make it miss.
    Every check is reported, whatever the others found.

    The generation is a generation dir or MANIFEST.json, with --store a key or generation id,
    or the current one of -f SPEC in --store for this arch; -f alone checks the toolchains
    the spec's warmers need.
    """
    from kernelcache import doctor

    kc = common.load_spec(args.file) if args.file is not None else None
    generation = None
    if args.generation is not None or (kc is not None and args.store is not None):
        generation = functools.partial(_doctor_generation, args, kc)
    report = doctor.diagnose(
        generation=generation,
        warmer_types=[w.type for w in kc.spec.warmers] if kc is not None else None,
        arch=args.arch,
        arches=kc.spec.arches() if kc is not None else None,
    )
    if args.json:
        output.print_json(report.to_dict())
    else:
        output.console().print(output.doctor_table(report))
    return report.exit_code


def _doctor_generation(args: argparse.Namespace, kc: Any, arch: str | None) -> Any:
    """The generation doctor compares with: the one named, else the spec's current one in
    the store for ``arch`` (the one seen here)."""
    from kernelcache import build

    if args.generation is not None:
        return common.manifest_of(args.generation, args.store)
    if arch is None:
        raise NoGpuInfoError(
            f"no arch here to pick the spec's generation by: --arch {' or '.join(kc.spec.arches())}"
        )
    key = build.cache_key(kc, arch)
    manifest = common.existing_store(args.store).current_manifest(key)
    if manifest is None:
        raise MissingGenerationError(f"{key}: no published generation in {args.store}")
    return manifest


def register(sub: Any) -> None:
    p = options.add_command(
        sub, "explain", cmd_explain, "name the factors that differ between two stamps"
    )
    sides = "MANIFEST.json, generation dir, KEY or generation id (with --store), or 'env'"
    p.add_argument("left", help=sides)
    p.add_argument("right", help=sides)
    p.add_argument("--store", type=options.path, help="store root to find a key or generation in")
    options.json_arg(p, "explain.json")

    p = options.add_command(
        sub, "doctor", cmd_doctor, "check this environment against a generation or a spec"
    )
    p.add_argument(
        "generation",
        nargs="?",
        help="generation dir or MANIFEST.json, or KEY or generation id (with --store)",
    )
    p.add_argument(
        "-f", "--file", type=options.path, help="KernelCache YAML: its warmers' toolchains"
    )
    p.add_argument(
        "--store",
        type=options.path,
        help="store root: of a KEY or generation id, or with -f of its key",
    )
    p.add_argument("--arch", help="this node's SM arch (else CUTE_DSL_ARCH, else the GPU)")
    options.json_arg(p, "doctor.json")
