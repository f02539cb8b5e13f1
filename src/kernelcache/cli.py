"""The ``kernelcache`` command: build, warm, verify, explain, inspect, gc, push, pull, doctor,
keygen.

Each subcommand makes one library call. Every failure prints one line naming the file,
factor or field at fault and exits with the code of its class (listed in ``--help``); an
unexpected error is reported the same way, never as a traceback. How results are printed
(tables, ``--json``, build progress) lives in ``kernelcache.output``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kernelcache import __version__, contract, learned, nodemap, output
from kernelcache.errors import (
    EXIT_CODE_HELP,
    ExitCode,
    KernelCacheError,
    MissingGenerationError,
    NoGpuInfoError,
    NotInstalledError,
    SignatureError,
    SpecError,
    error_line,
    error_object,
    exit_code_of,
    one_line,
)
from kernelcache.output import console as _console
from kernelcache.spec import ARCH, PUBLIC_KEY_FILE, SIGNING_KEY_FILE

# gc takes each key's writer lock; a build holds it while it warms (minutes).
GC_LOCK_TIMEOUT_S = 60.0


def _exit_codes_epilog() -> str:
    rows = "\n".join(f"  {int(code):>3}  {text}" for code, text in EXIT_CODE_HELP.items())
    return f"exit codes (every command):\n{rows}"


def _load_spec(path: Path) -> Any:
    from kernelcache.spec import load_kernelcache
    from kernelcache.toolchains import check_warmer_env

    kc = load_kernelcache(path)
    check_warmer_env(kc.spec.warmers, str(path))
    return kc


def _arches(kc: Any, requested: list[str] | None) -> list[str]:
    declared = kc.spec.arches()
    if not requested:
        return declared
    unknown = [a for a in requested if a not in declared]
    if unknown:
        raise SpecError(
            f"--arch {unknown[0]}: not an arch of spec.gpuClasses (declared: {', '.join(declared)})"
        )
    return list(dict.fromkeys(requested))  # an arch given twice is warmed once


def _check_key_file(path: Path | None, flag: str) -> None:
    """A key that is not there is the signature class (as ``verify --public-key``'s is),
    found before any work: ``build`` would otherwise warm each arch to fail at publish."""
    if path is not None and not path.is_file():
        what = "is not a file" if path.exists() else "no such file"
        raise SignatureError(f"{flag} {path}: {what}", path=str(path))


def _signing_key(path: Path | None) -> Any:
    if path is None:
        return None
    from kernelcache.store import load_private_key

    _check_key_file(path, "--signing-key")
    return load_private_key(path)


def _trusted_keys(path: Path | None) -> Any:
    if path is None:
        return None
    from kernelcache.store import load_public_keys

    return load_public_keys(path)


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

    kc = _load_spec(args.file)
    arches = _arches(kc, args.arch)
    _check_key_file(args.signing_key, "--signing-key")
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
            _console().print(table)
    for r in results:
        if r.status == "failed":
            print(f"kernelcache: error: {r.arch}: {one_line(r.message)}", file=sys.stderr)
    return code


def cmd_warm(args: argparse.Namespace) -> int:
    """Warm one arch into the store (what a compile Job runs); --dry-run: say what it would
    do and why, compiling and writing nothing."""
    from kernelcache import build, progress
    from kernelcache.store import Store

    kc = _load_spec(args.file)
    (arch,) = _arches(kc, [args.arch])
    if args.result is not None:
        _check_output_dir(args.result, "--result")
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
            signing_key=_signing_key(args.signing_key),
            trusted=_trusted_keys(args.public_key),
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


def _warm_failed(args: argparse.Namespace, code: int, line: str, seconds: float) -> Any:
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
        auth=args.authfile,
        ca_file=args.ca_file,
        plain_http=args.plain_http,
        signing_key=_signing_key(args.signing_key),
    )
    return pushed.ref_digest


def _arch_values(pairs: list[str], option: str) -> dict[str, str]:
    """``ARCH=VALUE`` options, one per arch."""
    found: dict[str, str] = {}
    for pair in pairs:
        arch, sep, value = pair.partition("=")
        if not sep or not arch or not value or arch in found:
            raise SpecError(f"{option} {pair!r}: expected ARCH=VALUE, once per arch")
        found[arch] = value
    return found


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify this node's generation as the init-container does; optionally copy it out.

    The arch is this node's (--arch, KERNELCACHE_ARCH, the node's GPU labels, nvidia-smi).
    A failure is also written to the termination log, where `kubectl describe pod` shows it.
    """
    from kernelcache import initcontainer
    from kernelcache.stamp_policy import parse_expect_factor

    log = args.termination_log or initcontainer.default_termination_log()
    try:
        namespace, name = args.namespace, args.name
        if args.file is not None:
            kc = _load_spec(args.file)
            namespace, name = kc.metadata.namespace, kc.metadata.name
        options = initcontainer.Options(
            store=args.store,
            key=args.key,
            namespace=namespace,
            name=name,
            arch=args.arch,
            gpu_product=args.gpu_product,
            node_name=args.node_name,
            node_map=args.node_map,
            expect_image=args.expect_image,
            expect_factors=dict(map(parse_expect_factor, args.expect_factor)),
            check_env=args.check_env,
            policy=args.policy,
            public_key=args.public_key,
            require_signature=args.require_signature,
            materialize=args.materialize,
            pull=_arch_values(args.pull, "--pull"),
            artifacts={a: Path(d) for a, d in _arch_values(args.artifact, "--artifact").items()},
            registry_auth=args.authfile,
            registry_ca=args.ca_file,
            plain_http=args.plain_http,
            local=args.local,
            want=_arch_values(args.want, "--want"),
            local_wait_seconds=args.local_wait,
            local_only=args.local_only,
        )
        outcome = initcontainer.run(options)
    except Exception as exc:  # main prints the very same line
        initcontainer.write_termination_log(log, error_line(exc))
        raise
    for warning in outcome.warnings:
        print(f"kernelcache: warning: {warning}", file=sys.stderr)
    if outcome.local_damaged is not None:  # the pod starts; its status says what it passed over
        initcontainer.write_termination_log(log, outcome.local_damaged)
    if args.json:
        output.print_json(output.verify_json(outcome))
    else:
        print(outcome.summary)
    return 0


def cmd_prefetch(args: argparse.Namespace) -> int:
    """Keep a KernelCache's generation on this node's disk (the prefetch DaemonSet's work).

    --want is the artifact (repo@sha256:..., pulled) or, with --store, the generation id
    (copied out of the shared store). Older copies are evicted oldest first to stay within
    --limit; never one a KernelCache names or a pod is reading.
    """
    from kernelcache import initcontainer, prefetch

    log = args.termination_log or initcontainer.default_termination_log()
    try:
        synced = prefetch.sync(
            args.root,
            args.key,
            args.want,
            limit_bytes=args.limit,
            store=args.store,
            ref=None if args.store is not None else args.want,
            auth=args.authfile,
            ca_file=args.ca_file,
            plain_http=args.plain_http,
            public_key=args.public_key,
            require_signature=args.require_signature,
        )
    except KernelCacheError as exc:
        line = initcontainer.error_line(exc)
        initcontainer.write_termination_log(log, line)
        raise
    print(synced.summary)
    return 0


def _manifest_of(ref: str, store_root: Path | None) -> Any:
    """The manifest a reference names: a MANIFEST.json or generation dir, or with ``--store``
    a key (its current generation) or a generation id (or a unique prefix of one)."""
    from kernelcache.store import MANIFEST_NAME, Manifest

    path = Path(ref)
    if store_root is not None and not path.exists():
        store = _existing_store(store_root)
        if ref.count("/") == 2:
            manifest = store.current_manifest(ref)
            if manifest is None:
                raise MissingGenerationError(f"{ref}: no published generation in {store.root}")
            return manifest
        found = [m for key in store.keys() for m in store.generations(key)]  # noqa: SIM118
        matches = {m.generation: m for m in found if ref and m.generation.startswith(ref)}
        if len(matches) != 1:
            what = "no generation" if not matches else f"{len(matches)} generations"
            raise MissingGenerationError(f"{ref}: {what} in {store.root} with this id")
        return next(iter(matches.values()))
    if path.is_dir():
        if not (path / MANIFEST_NAME).exists():
            raise SpecError(f"{ref}: a directory without {MANIFEST_NAME}: not a generation dir")
        path = path / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except OSError as exc:
        hint = "" if store_root is not None else " (a key or generation id needs --store)"
        raise SpecError(f"{ref}: cannot read: {exc.strerror}{hint}") from exc
    return Manifest.parse(data, str(path))


def cmd_explain(args: argparse.Namespace) -> int:
    """Name the factors that differ between two stamps (exit 4 when any differ).

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
        for m in [_manifest_of(ref, args.store)]
    }
    untold: list[str] = []  # what the stamp cannot judge here: IR-keyed kernels, untraced
    if "env" in (args.left, args.right):  # recomputed against the factors the other recorded
        (recorded, _), *_ = generations.values()
        generations["env"] = (stamps.environment_stamp(recorded), stamps.ENVIRONMENT_SIDE)
        untold = _unchecked(args.right if args.left == "env" else args.left, args.store)
    (left, left_side), (right, right_side) = generations[args.left], generations[args.right]
    diffs = stamps.explain(left, right)
    if args.json:
        output.print_json(
            {
                "hit": False if diffs else (None if untold else True),
                "unchecked": untold,
                "left": left.digest,
                "right": right.digest,
                "differences": [
                    {"factor": d.name, "left": d.left, "right": d.right} for d in diffs
                ],
            }
        )
        return int(ExitCode.STAMP_MISMATCH) if diffs else 0
    if "env" not in (args.left, args.right):
        _explain_vllm(args.left, args.right, args.store)
    else:
        _explain_cute(args.right if args.left == "env" else args.left, args.store)
    if not diffs and untold:
        print(f"same stamp {left.digest}, no verdict on the rest: {'; '.join(untold)}")
    elif not diffs:
        print(f"same stamp {left.digest}: a hit")
    else:
        for diff in diffs:
            print(diff.describe((left_side, right_side)))
    return int(ExitCode.STAMP_MISMATCH) if diffs else 0


def _unchecked(ref: str, store_root: Path | None) -> list[str]:
    """What each toolchain says a stamp cannot judge of the generation ``ref``."""
    from kernelcache.toolchains import toolchains

    manifest = _manifest_of(ref, store_root)
    return [note for t in toolchains() if (note := t.unchecked(manifest))]


def _explain_cute(ref: str, store_root: Path | None) -> None:
    """Which input each CuTe-DSL kernel's compile read has moved in this environment, where a
    generation's records can tell: why a kernel's IR may differ here (it is keyed by its IR)."""
    from kernelcache.store import FILES_DIR
    from kernelcache.toolchains.cute_dsl import SUBDIR

    path = Path(ref)
    if store_root is not None and not path.exists() and ref.count("/") == 2:
        found = _existing_store(store_root).current(ref)
        path = found if found is not None else path
    generation = path if path.is_dir() else path.parent
    root = generation / FILES_DIR / SUBDIR
    if not root.is_dir():
        return
    try:  # resolve the DSL's modules as a serving process does
        import cutlass.cute  # noqa: F401
    except ImportError:
        return  # no DSL here: no serving process here would load these kernels either
    from kernelcache.runtime.cute import moved_since

    for function, problem in moved_since(root).items():
        print(f"cute-dsl {function}: since its compile: {problem}")


def _explain_vllm(left: str, right: str, store_root: Path | None) -> None:
    """vLLM's own cache key factors of two generations, where their warm reports hold them."""
    from kernelcache.toolchains import vllm

    reports = [_manifest_of(ref, store_root).report for ref in (left, right)]
    for line in vllm.factor_diffs(*reports):
        print(f"vllm cache_key_factors: {line}")
    for line in vllm.coverage_diffs(*reports):
        print(f"vllm coverage: {line}")


def cmd_inspect(args: argparse.Namespace) -> int:
    """List keys, generations and what the current one holds.

    A key that cannot be read (a broken CURRENT, say) is listed with its error and hides no
    other key; the exit code is then the first such error's class.
    """
    store = _existing_store(args.store)
    keys = [_published_key(store, args.key)] if args.key else store.keys()
    rows: list[dict[str, Any]] = []
    failures: list[KernelCacheError] = []
    for key in keys:
        try:
            current = store.current_manifest(key)
            generations = store.generations(key)
        except KernelCacheError as exc:
            failures.append(exc)
            print(error_line(exc), file=sys.stderr)
            rows.append({"key": key, "error": error_object(exc)["error"]})
            continue
        for m in generations:
            rows.append(
                {
                    "key": key,
                    "generation": m.generation,
                    "current": current is not None and m.generation == current.generation,
                    "created": m.created,
                    "files": len(m.files),
                    "bytes": m.total_bytes,
                    "stamp": m.stamp.get("digest"),
                    "report": m.report if args.json else None,
                }
            )
    code = int(failures[0].code) if failures else 0
    if args.json:
        print(json.dumps(rows, indent=1))
        return code
    columns = ("key", "generation", "current", "created", "files", "bytes", "stamp")
    cells = [
        [row["key"], "unreadable: see the error above", "", "", "", "", ""]
        if "error" in row
        else [
            str(row["key"]),
            str(row["generation"])[:16],
            "*" if row["current"] else "",
            str(row["created"])[:19] + "Z",
            str(row["files"]),
            f"{row['bytes']:,}",
            str(row["stamp"]).removeprefix("blake3:")[:16],
        ]
        for row in rows
    ]
    title = f"kernelcache store {args.store}"
    whole, right = ("key", "generation", "current"), ("files", "bytes")
    _console().print(output.table(title, columns, cells, whole=whole, right=right))
    _print_coverage(store, keys)
    return code


def _print_coverage(store: Any, keys: list[str]) -> None:
    """What each key's current generation enumerated, family by family (vLLM's warm)."""
    from kernelcache.toolchains import vllm

    for key in keys:
        with contextlib.suppress(KernelCacheError):
            current = store.current_manifest(key)
            for line in vllm.coverage_lines(current.report if current is not None else {}):
                print(f"{key} coverage: {line}")


def cmd_gc(args: argparse.Namespace) -> int:
    """Remove old generations: the current one stays, and the N most recently current
    besides it (the rollback targets)."""
    store = _existing_store(args.store)
    verb = "would remove" if args.dry_run else "removed"
    keys = []
    for key in [_published_key(store, args.key)] if args.key else store.keys():

        def waiting(holder: str, key: str = key) -> None:
            print(
                f"kernelcache: {key}: waiting for the writer lock ({holder}), at most "
                f"{args.timeout:g} s",
                file=sys.stderr,
                flush=True,
            )

        removed = store.gc(
            key, keep=args.keep, dry_run=args.dry_run, timeout=args.timeout, on_wait=waiting
        )
        keys.append({"key": key, "removed": removed})
        if not args.json:
            print(f"{key}: {verb} {len(removed)} generation(s)" + "".join(f" {r}" for r in removed))
    if args.json:
        output.print_json({"dry_run": args.dry_run, "keep": args.keep, "keys": keys})
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check this environment before anything runs: GPU and arch, toolchains, cache variables,
    the start-up hook, and against a generation the stamp factors that would make it miss.
    Every check is reported, whatever the others found.

    The generation is a generation dir or MANIFEST.json, with --store a key or generation id,
    or the current one of -f SPEC in --store for this arch; -f alone checks the toolchains
    the spec's warmers need.
    """
    from kernelcache import doctor

    kc = _load_spec(args.file) if args.file is not None else None
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
        _console().print(output.doctor_table(report))
    return report.exit_code


def _doctor_generation(args: argparse.Namespace, kc: Any, arch: str | None) -> Any:
    """The generation doctor compares with: the one named, else the spec's current one in
    the store for ``arch`` (the one seen here)."""
    from kernelcache import build

    if args.generation is not None:
        return _manifest_of(args.generation, args.store)
    if arch is None:
        raise NoGpuInfoError(
            f"no arch here to pick the spec's generation by: --arch {' or '.join(kc.spec.arches())}"
        )
    key = build.cache_key(kc, arch)
    manifest = _existing_store(args.store).current_manifest(key)
    if manifest is None:
        raise MissingGenerationError(f"{key}: no published generation in {args.store}")
    return manifest


def cmd_keygen(args: argparse.Namespace) -> int:
    """Write an ed25519 key pair for signing manifests."""
    from kernelcache.store import generate_keypair

    private, public = generate_keypair(args.dir)
    print(f"private key: {private}\npublic key: {public}")
    print(
        "signing Secret: kubectl create secret generic NAME "
        f"--from-file={private} --from-file={public}"
    )
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    """Print a completion script generated from this parser.

    bash: eval "$(kernelcache completion bash)"; zsh: eval "$(kernelcache completion zsh)".
    """
    from kernelcache.completion import script

    print(script(build_parser(), args.shell))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    """Push the key's current generation (or --generation) to a registry as an OCI artifact,
    image-shaped (an image volume can mount it), signed with --signing-key; prints
    REGISTRY/REPOSITORY@sha256:..., the reference to pull.

    Credentials: --authfile, else $DOCKER_CONFIG/config.json, else ~/.docker/config.json.
    """
    from kernelcache import distribution

    result = distribution.push(
        args.store,
        args.key,
        args.ref,
        generation=args.generation,
        auth=args.authfile,
        ca_file=args.ca_file,
        plain_http=args.plain_http,
        signing_key=args.signing_key,
        gzip=args.gzip,
    )
    if args.json:
        output.print_json(asdict(result))
    else:
        print(result.ref_digest)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    """Pull a generation by digest (never a tag) into a store as its key's CURRENT one,
    every blob, file and signature checked on the way in; a refusal leaves the store as it
    was. Credentials as for push (a Kubernetes pull secret's .dockerconfigjson works too).
    """
    from kernelcache import distribution

    result = distribution.pull(
        args.ref,
        args.store,
        key=args.key,
        auth=args.authfile,
        ca_file=args.ca_file,
        plain_http=args.plain_http,
        public_key=args.public_key,
        require_signature=args.require_signature,
    )
    if args.json:
        output.print_json({**asdict(result), "gen_dir": str(result.gen_dir)})
    else:
        signed = ", signature verified" if result.signature_verified else ""
        print(
            f"{result.key}: generation {result.generation} from {result.ref_digest} "
            f"({result.files} files, {result.bytes:,} bytes{signed})"
        )
    return 0


def cmd_operator(args: argparse.Namespace) -> int:
    """Run the Kubernetes operator until stopped; it is configured by KERNELCACHE_OPERATOR_*."""
    try:
        from kernelcache.controller.main import run
    except ModuleNotFoundError as exc:
        missing = f"operator: {exc.name} is not installed; install kernelcache[operator]"
        raise NotInstalledError(missing) from None
    return run(verbose=args.verbose)


def _existing_store(root: Path) -> Any:
    """The store at ``root`` for a command that reads one: a root that is missing or is not
    a directory is an I/O failure (an unmounted volume, a typo), never an empty store."""
    from kernelcache.initcontainer import check_store_root
    from kernelcache.store import Store

    store = Store(root)
    check_store_root(store.root)
    return store


def _published_key(store: Any, key: str) -> str:
    """``key``, refused when the store has no generation of it (and left uncreated)."""
    if not store.key_dir(key).is_dir():
        raise MissingGenerationError(f"{key}: no published generation in {store.root}")
    return key


def _check_output_dir(path: Path, flag: str) -> None:
    """Refuse an output file whose directory is missing before any work, not after it."""
    if not path.parent.is_dir():
        raise SpecError(f"{flag} {path}: directory {path.parent} does not exist")


def _path(text: str) -> Path:
    """A path argument; an empty one would silently mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return Path(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is a failure like every other (``main`` reports it);
    no option is taken by an abbreviation (as kubectl and helm take none), an unknown option
    is named before anything else the words lack, and a mistyped option, command or choice
    gets the nearest one suggested."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str) -> Any:
        raise SpecError(f"{self.prog}: {one_line(message)}")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        words = sys.argv[1:] if args is None else list(args)
        for word in words:
            if word == "--" or (self._subparsers is not None and not word.startswith("-")):
                break  # past the options: positionals, or the command's own words
            if word.startswith("-") and not _NUMBER.match(word):
                name = word.split("=", 1)[0] if word.startswith("--") else word[:2]
                if name not in self._option_string_actions:
                    self.error(f"unknown option {name}{_did_you_mean(name, self._known_options())}")
        return super().parse_known_args(args, namespace)

    def _known_options(self) -> list[str]:
        return [o for o in self._option_string_actions if o.startswith("--")]

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            choices = [str(c) for c in action.choices]
            raise argparse.ArgumentError(
                action,
                f"invalid choice: {value!r}{_did_you_mean(str(value), choices)} "
                f"(choose from {', '.join(choices)})",
            )


_NUMBER = re.compile(r"^-\d")  # a negative number is a value, not an option


def _did_you_mean(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kernelcache",
        description="Compile GPU kernels ahead of time, store them stamped, verify before serving.",
        epilog=_exit_codes_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kernelcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str,
        func: Callable[[argparse.Namespace], int],
        help_text: str,
        failed: Callable[[argparse.Namespace, int, str, float], Any] | None = None,
    ) -> Any:
        p = sub.add_parser(
            name,
            help=help_text,
            description=output.plain_help(func.__doc__),
            epilog="exit codes: see kernelcache --help",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(func=func, failed=failed)
        return p

    def store_arg(p: Any) -> None:
        p.add_argument("--store", type=_path, required=True, help="store root (the PV mount)")

    def registry_args(p: Any) -> None:
        p.add_argument(
            "--authfile",
            type=_path,
            help="docker config or .dockerconfigjson with the registry's credentials",
        )
        p.add_argument("--ca-file", type=_path, help="CA bundle the registry's TLS must chain to")
        p.add_argument(
            "--plain-http",
            action="store_true",
            help="speak plain HTTP to the registry: only a loopback one (localhost, 127.0.0.1, "
            "::1) or one named in KERNELCACHE_PLAIN_HTTP_HOSTS",
        )

    def json_arg(p: Any, schema: str) -> None:
        p.add_argument(
            "--json", action="store_true", help=f"print JSON (schema: docs/cli-schemas/{schema})"
        )

    def dry_run_arg(p: Any) -> None:
        p.add_argument(
            "--dry-run",
            action="store_true",
            help="compile nothing: say what would be compiled, from which stamp, and why",
        )

    def trusted_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--public-key",
            type=_path,
            help="the public key(s) pods verify with (PEM, several during a rotation): the "
            "signing key must be one; a generation signed by another is re-signed, not rebuilt",
        )

    def learned_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--learned",
            type=_path,
            metavar="FILE",
            help=f"a learned record (JSON, what a serving pod serves at {learned.PATH}, or "
            f"{contract.LEARNED.name}): its keys are warmed too",
        )

    p = add("build", cmd_build, "warm, seal and publish every arch of a spec")
    p.add_argument("-f", "--file", type=_path, required=True, help="KernelCache YAML")
    store_arg(p)
    p.add_argument("--arch", action="append", help="only this arch (repeatable)")
    p.add_argument("--signing-key", type=_path, help="ed25519 private key to sign manifests")
    trusted_arg(p)
    p.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    learned_arg(p)
    dry_run_arg(p)
    json_arg(p, "build.json")

    p = add("warm", cmd_warm, "warm and publish one arch (the compile Job's command)", _warm_failed)
    p.add_argument("-f", "--file", type=_path, required=True, help="KernelCache YAML")
    store_arg(p)
    p.add_argument("--arch", required=True, help="SM arch, e.g. sm_90a")
    p.add_argument("--signing-key", type=_path, help="ed25519 private key to sign the manifest")
    trusted_arg(p)
    p.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    learned_arg(p)
    dry_run_arg(p)
    p.add_argument("--result", type=_path, help="write the result as JSON here")
    p.add_argument(
        "--push", metavar="REPOSITORY", help="then push the generation there (tag: its id)"
    )
    registry_args(p)
    p.add_argument(
        "--progress",
        action="store_true",
        help=f"print each warmer and kernel compiled to stderr (or {contract.PROGRESS.name}=1)",
    )
    json_arg(p, "warm.json")

    p = add("verify", cmd_verify, "verify this node's generation (the init-container's check)")
    p.add_argument("--store", type=_path, help="store root (the PV mount)")
    p.add_argument(
        "--pull",
        action="append",
        default=[],
        metavar="ARCH=REF@sha256:...",
        help="pull this arch's generation by digest (into --materialize's directory) instead",
    )
    p.add_argument(
        "--artifact",
        action="append",
        default=[],
        metavar="ARCH=DIR",
        help="this arch's generation is the artifact mounted at DIR (an image volume)",
    )
    registry_args(p)
    p.add_argument(
        "--local", type=_path, metavar="DIR", help="the node's prefetched copies: used first"
    )
    p.add_argument(
        "--want",
        action="append",
        default=[],
        metavar="ARCH=TOKEN",
        help="the artifact digest or generation id a --local copy of this arch must be of",
    )
    p.add_argument(
        "--local-wait",
        type=_non_negative,
        default=0,
        metavar="SECONDS",
        help="wait this long for the node's copy before falling back (default 0)",
    )
    p.add_argument(
        "--local-only", action="store_true", help="refuse rather than fall back after the wait"
    )
    p.add_argument("--key", help="NAMESPACE/NAME/ARCH (else --namespace/--name or -f)")
    p.add_argument("--namespace", help="the KernelCache's namespace (with --name)")
    p.add_argument("--name", help="the KernelCache's name: the key is NAMESPACE/NAME/<node arch>")
    p.add_argument("-f", "--file", type=_path, help="KernelCache YAML (its namespace and name)")
    p.add_argument("--arch", help=f"this node's SM arch, e.g. sm_90a (else {contract.ARCH.name})")
    p.add_argument(
        "--gpu-product", help=f"this node's GPU product (else {contract.GPU_PRODUCT.name})"
    )
    p.add_argument(
        "--node-name",
        help=f"read the arch from this node's GPU labels (else {contract.NODE_NAME.name})",
    )
    p.add_argument(
        "--node-map",
        type=Path,
        help=f"the operator's node map (else {contract.NODE_MAP.name}, {nodemap.MOUNT_DIR})",
    )
    p.add_argument(
        "--expect-image", metavar="IMAGE[@sha256:...]", help="the pod's engine image must match"
    )
    p.add_argument(
        "--expect-factor",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a stamp factor the pod requires, compared exactly (repeatable)",
    )
    p.add_argument("--public-key", type=_path, help="ed25519 public key: the signature must verify")
    p.add_argument("--require-signature", action="store_true", help="refuse unsigned manifests")
    p.add_argument(
        "--check-env",
        action="store_true",
        help="refuse when this environment's factors differ from the stamp",
    )
    p.add_argument(
        "--policy",
        choices=contract.POLICIES,
        default="strict",
        help="tuning from another GPU product: refuse (strict) or drop it with a warning",
    )
    p.add_argument(
        "--materialize",
        type=_path,
        metavar="DIR",
        help="copy the verified generation here and write DIR/kernelcache.env",
    )
    p.add_argument(
        "--termination-log",
        type=_path,
        metavar="FILE",
        help="write a failure here too (default: /dev/termination-log when writable)",
    )
    json_arg(p, "verify.json")

    p = add("prefetch", cmd_prefetch, "keep a generation on this node's disk (prefetch)")
    p.add_argument("--root", type=_path, required=True, help="the node-local root (a hostPath)")
    p.add_argument("--key", required=True, help="NAMESPACE/NAME/ARCH the copy serves")
    p.add_argument(
        "--want", required=True, metavar="REF@sha256:...|GENERATION", help="what to keep"
    )
    p.add_argument("--store", type=_path, help="copy from this store (else pull --want)")
    p.add_argument(
        "--limit", type=_non_negative, required=True, metavar="BYTES", help="disk use bound"
    )
    registry_args(p)
    p.add_argument("--public-key", type=_path, help="ed25519 public key: the signature must verify")
    p.add_argument("--require-signature", action="store_true", help="refuse unsigned artifacts")
    p.add_argument("--termination-log", type=_path, metavar="FILE", help="write a failure here too")

    p = add("explain", cmd_explain, "name the factors that differ between two stamps")
    sides = "MANIFEST.json, generation dir, KEY or generation id (with --store), or 'env'"
    p.add_argument("left", help=sides)
    p.add_argument("right", help=sides)
    p.add_argument("--store", type=_path, help="store root to find a key or generation in")
    json_arg(p, "explain.json")

    p = add("inspect", cmd_inspect, "list keys and generations of a store")
    store_arg(p)
    p.add_argument("key", nargs="?", help="NAMESPACE/NAME/ARCH (default: all)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON, with warm reports (schema: docs/cli-schemas/inspect.json)",
    )

    p = add("gc", cmd_gc, "remove old generations (never the current one)")
    store_arg(p)
    p.add_argument("key", nargs="?", help="NAMESPACE/NAME/ARCH (default: all)")
    p.add_argument(
        "--keep", type=_non_negative, default=2, help="kept besides the current (default 2)"
    )
    p.add_argument("--dry-run", action="store_true", help="remove nothing; say what would go")
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=GC_LOCK_TIMEOUT_S,
        metavar="SECONDS",
        help="wait at most this long for a key's writer lock, held by a build while it warms "
        f"(default {GC_LOCK_TIMEOUT_S:g}; then exit {int(ExitCode.LOCKED)})",
    )
    json_arg(p, "gc.json")

    p = add("push", cmd_push, "push a generation to an OCI registry")
    store_arg(p)
    p.add_argument("--key", required=True, help="NAMESPACE/NAME/ARCH")
    p.add_argument("ref", metavar="REF", help="REGISTRY/REPOSITORY[:TAG] (tag: the generation id)")
    p.add_argument("--generation", help="this generation of the key (default: the current one)")
    p.add_argument("--signing-key", type=_path, help="ed25519 private key to sign the artifact")
    p.add_argument("--gzip", action="store_true", help="compress the layers")
    registry_args(p)
    json_arg(p, "push.json")

    p = add("pull", cmd_pull, "pull a generation by digest from an OCI registry into a store")
    p.add_argument("ref", metavar="REF", help="REGISTRY/REPOSITORY@sha256:<hex> (a digest)")
    store_arg(p)
    p.add_argument("--key", help="NAMESPACE/NAME/ARCH the artifact must be of")
    p.add_argument("--public-key", type=_path, help="ed25519 public key: the signature must verify")
    p.add_argument("--require-signature", action="store_true", help="refuse unsigned artifacts")
    registry_args(p)
    json_arg(p, "pull.json")

    p = add("operator", cmd_operator, "run the Kubernetes operator (kopf)")
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level")

    p = add("doctor", cmd_doctor, "check this environment against a generation or a spec")
    p.add_argument(
        "generation",
        nargs="?",
        help="generation dir or MANIFEST.json, or KEY or generation id (with --store)",
    )
    p.add_argument("-f", "--file", type=_path, help="KernelCache YAML: its warmers' toolchains")
    p.add_argument(
        "--store", type=_path, help="store root: of a KEY or generation id, or with -f of its key"
    )
    p.add_argument("--arch", help="this node's SM arch (else CUTE_DSL_ARCH, else the GPU)")
    json_arg(p, "doctor.json")

    p = add(
        "keygen",
        cmd_keygen,
        f"write an ed25519 key pair for signing ({SIGNING_KEY_FILE}, {PUBLIC_KEY_FILE}): the "
        "key names of the signing Secret",
    )
    p.add_argument(
        "dir", type=_path, help=f"directory for {SIGNING_KEY_FILE} and {PUBLIC_KEY_FILE}"
    )

    p = add("completion", cmd_completion, "print a shell completion script")
    p.add_argument("shell", choices=["bash", "zsh"], help="the shell to complete for")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure, a bad command line included, is reported here and
    only here: its one line on stderr, the exit code of its class and, when ``--json`` was
    asked for, one failure object on stdout (the command's own, else ``error_object``), so a
    new subcommand gets all three without a line of its own.

    A reader that stops reading (``| head``, a closed ``less``) ends the command quietly with
    141, as a command killed by SIGPIPE exits in a shell: no line, no traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        try:
            return _run(argv)
        finally:  # what is still buffered meets a closed pipe here, not at interpreter exit
            sys.stdout.flush()
    except BrokenPipeError:
        output.detach_closed_outputs()
        return int(ExitCode.BROKEN_PIPE)


def _run(argv: list[str]) -> int:
    args = None
    start = time.perf_counter()
    with _interrupts() as interrupted:
        try:
            args = build_parser().parse_args(argv)
            return int(args.func(args))
        except (Exception, KeyboardInterrupt) as exc:  # a bug too: one line, its class
            if isinstance(exc, BrokenPipeError) and output.outputs_closed():
                raise  # the reader went away: main ends quietly
            # A Ctrl-C is the cause of whatever failure it led to on its way out (a warmer's
            # child ended by it first, a pipe it closed): the exit is 130 all the same.
            failure: BaseException = KeyboardInterrupt() if interrupted else exc
            line, code = error_line(failure), exit_code_of(failure)
    print(line, file=sys.stderr)
    failed = getattr(args, "failed", None)
    payload = failed(args, code, line, time.perf_counter() - start) if failed else None
    if _wants_json(argv):
        output.print_json(payload if payload is not None else error_object(failure))
    return code


@contextlib.contextmanager
def _interrupts() -> Iterator[list[int]]:
    """Record every SIGINT this process gets (and raise ``KeyboardInterrupt`` as Python
    does) while a command runs; only the main thread can take signals."""
    seen: list[int] = []
    on_main = threading.current_thread() is threading.main_thread()
    if not on_main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield seen  # not ours to take (a process started with SIGINT ignored keeps it so)
        return

    def on_sigint(signum: int, frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def _wants_json(argv: list[str]) -> bool:
    """``--json`` among the options (read from the words, since a failed parse has no args)."""
    return "--json" in (argv[: argv.index("--")] if "--" in argv else argv)


if __name__ == "__main__":
    sys.exit(main())
