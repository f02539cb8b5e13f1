"""``build`` (every arch of a spec, each in its own process, then a table) and ``warm`` (one
arch: what a compile Job runs, its result the Job's termination message)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kernelcache import contract, learned, output
from kernelcache.cli import common, options
from kernelcache.errors import KernelCacheError, SpecError, one_line
from kernelcache.spec import ARCH
from kernelcache.toolchains import check_installed


def _learned_path(path: Path | None) -> Path | None:
    """A ``--learned`` record, checked here: one line, before any arch's warm starts."""
    if path is not None:
        _learned_keys(path)
    return path


def _learned_keys(path: Path | None) -> list[Any]:
    """The keys of a learned record (``kernelcache.learned``): what serving compiled."""
    if path is None:
        return []
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise SpecError(f"--learned {path}: {exc.strerror}") from None
    return learned.parse(text, f"--learned {path}")[0]


def cmd_build(args: argparse.Namespace) -> int:
    """Warm every arch of a spec in its own process, seal and publish, then print a table.

    What the warmers print streams to stderr as they print it, each kernel compiled with its
    time; the tables (or --json) go to stdout, a failed arch's reason once to stderr. With
    --dry-run each arch says what it would do and why (up to date, a kept generation to make
    current again, or the warmers to run and the stamp factors that changed), compiling and
    writing nothing.
    """
    from kernelcache import build

    kc = common.load_spec(args.file)
    arches = common.arches(kc, args.arch)
    check_installed(kc.spec.warmers, str(args.file), import_them=False)
    common.check_key_file(args.signing_key, "--signing-key")
    view = output.BuildView(kc, dry_run=args.dry_run)
    try:
        results = build.build(
            args.file.resolve(),
            args.store,
            arches,
            signing_key_path=args.signing_key,
            public_key_path=args.public_key,
            force=args.force,
            dry_run=args.dry_run,
            learned_path=_learned_path(args.learned),
            on_start=view.started,
            on_output=view.line,
            on_done=view.done,
        )
    finally:
        view.close()
    code = build.result_exit_code(results)
    if args.json:
        output.print_json(output.build_json(kc, results, code))
    else:
        for table in output.build_tables(kc, results, dry_run=args.dry_run):
            output.console().print(table)
    for r in results:
        if r.status == "failed":
            print(f"kernelcache: error: {r.arch}: {one_line(r.message)}", file=sys.stderr)
    return code


def cmd_warm(args: argparse.Namespace) -> int:
    """Warm one arch into the store (what a compile Job runs); --dry-run: say what it would
    do and why, compiling and writing nothing."""
    from kernelcache import build, progress
    from kernelcache.store import Store

    kc = common.load_spec(args.file)
    (arch,) = common.arches(kc, [args.arch])
    if args.result is not None:
        common.check_output_dir(args.result, "--result")
    if args.dry_run and args.push:
        raise SpecError("--dry-run publishes nothing: there is nothing to --push")
    if args.progress or contract.PROGRESS.read(os.environ):
        progress.show()
    # The compile Job's variable names a file its spec ConfigMap holds only when serving had
    # learned something: absent, nothing was.
    from_job = contract.LEARNED.read(os.environ)
    learned_keys = _learned_keys(
        args.learned or (from_job if from_job and from_job.exists() else None)
    )
    if args.dry_run:
        result = build.plan_arch(
            kc,
            args.file.resolve().parent,
            Store(args.store),
            arch,
            force=args.force,
            learned_keys=learned_keys,
        )
    else:
        result = build.warm_arch(
            kc,
            args.file.resolve().parent,
            Store(args.store),
            arch,
            signing_key=common.signing_key(args.signing_key),
            trusted=common.trusted_keys(args.public_key),
            force=args.force,
            learned_keys=learned_keys,
        )
    if args.push:
        result.artifact = _push(args, kc, arch, result.generation)
    if args.result is not None:
        build.write_result(args.result, result)
    if args.json:
        output.print_json(asdict(result))
    elif args.dry_run:
        print(output.plan_line(result))
    else:
        print(
            f"{result.arch}: {result.status} generation {result.generation} ({result.files} files)"
        )
    return 0


def warm_failed(args: argparse.Namespace, code: int, line: str, seconds: float) -> Any:
    """A failed warm is a result too: written to --result (a compile Job's termination
    message, which the operator reads) and printed under --json, saying why it failed."""
    from kernelcache import build

    if not (isinstance(args.arch, str) and re.fullmatch(ARCH, args.arch)):
        return None  # no arch to report on: the plain failure object
    message = line.removeprefix("kernelcache: ").removeprefix("error: ")
    result = build.ArchResult(
        arch=args.arch,
        status=build.Status.FAILED,
        seconds=round(seconds, 3),
        exit_code=code,
        message=message,
    )
    if args.result is not None:
        with contextlib.suppress(KernelCacheError):  # one line: the failure being reported
            build.write_result(args.result, result)
    return asdict(result)


def _push(args: argparse.Namespace, kc: Any, arch: str, generation: str | None) -> str:
    """Push the generation warm published (or found up to date) to ``--push``; its digest."""
    from kernelcache.distribution import push

    key = contract.CacheKey(kc.metadata.namespace, kc.metadata.name, arch)
    pushed = push(
        args.store,
        key,
        args.push,
        generation=generation,
        **options.registry_access(args),
        signing_key=common.signing_key(args.signing_key),
    )
    return pushed.ref_digest


def register(sub: Any) -> None:
    p = options.add_command(sub, "build", cmd_build, "warm, seal and publish every arch of a spec")
    p.add_argument("-f", "--file", type=options.path, required=True, help="KernelCache YAML")
    options.store_arg(p)
    p.add_argument("--arch", action="append", help="only this arch (repeatable)")
    p.add_argument("--signing-key", type=options.path, help="ed25519 private key to sign manifests")
    options.trusted_arg(p)
    p.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    options.learned_arg(p)
    options.dry_run_arg(p)
    options.json_arg(p, "build.json")

    p = options.add_command(
        sub, "warm", cmd_warm, "warm and publish one arch (the compile Job's command)", warm_failed
    )
    p.add_argument("-f", "--file", type=options.path, required=True, help="KernelCache YAML")
    options.store_arg(p)
    p.add_argument("--arch", required=True, help="SM arch, e.g. sm_90a")
    p.add_argument(
        "--signing-key", type=options.path, help="ed25519 private key to sign the manifest"
    )
    options.trusted_arg(p)
    p.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    options.learned_arg(p)
    options.dry_run_arg(p)
    p.add_argument("--result", type=options.path, help="write the result as JSON here")
    p.add_argument(
        "--push", metavar="REPOSITORY", help="then push the generation there (tag: its id)"
    )
    options.registry_args(p)
    p.add_argument(
        "--progress",
        action="store_true",
        help=f"print each warmer and kernel compiled to stderr (or {contract.PROGRESS.name}=1)",
    )
    options.json_arg(p, "warm.json")
