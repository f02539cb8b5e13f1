"""A store's contents: ``inspect`` (keys, generations, what the current one holds) and ``gc``
(old generations removed, never the current one or its rollback targets)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from kernelcache import output
from kernelcache.cli import common, options
from kernelcache.errors import ExitCode, KernelCacheError, error_line, error_object

# gc takes each key's writer lock; a build holds it while it warms (minutes).
GC_LOCK_TIMEOUT_S = 60.0


def cmd_inspect(args: argparse.Namespace) -> int:
    """List keys, generations and what the current one holds.

    A key that cannot be read (a broken CURRENT, say) is listed with its error and hides no
    other key; the exit code is then the first such error's class.
    """
    if args.key:
        store = common.existing_store(args.store)
        keys = [common.published_key(store, args.key)]
    else:
        store = common.listed_store(args.store)
        keys = store.keys()
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
    output.console().print(output.table(title, columns, cells, whole=whole, right=right))
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
    store = (common.existing_store if args.key else common.listed_store)(args.store)
    verb = "would remove" if args.dry_run else "removed"
    keys = []
    for key in [common.published_key(store, args.key)] if args.key else store.keys():

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


def register(sub: Any) -> None:
    p = options.add_command(sub, "inspect", cmd_inspect, "list keys and generations of a store")
    options.store_arg(p)
    p.add_argument("key", nargs="?", help="NAMESPACE/NAME/ARCH (default: all)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON, with warm reports (schema: docs/cli-schemas/inspect.json)",
    )

    p = options.add_command(sub, "gc", cmd_gc, "remove old generations (never the current one)")
    options.store_arg(p)
    p.add_argument("key", nargs="?", help="NAMESPACE/NAME/ARCH (default: all)")
    p.add_argument(
        "--keep", type=options.non_negative, default=2, help="kept besides the current (default 2)"
    )
    p.add_argument("--dry-run", action="store_true", help="remove nothing; say what would go")
    p.add_argument(
        "--timeout",
        type=options.seconds,
        default=GC_LOCK_TIMEOUT_S,
        metavar="SECONDS",
        help="wait at most this long for a key's writer lock, held by a build while it warms "
        f"(default {GC_LOCK_TIMEOUT_S:g}; then exit {int(ExitCode.LOCKED)})",
    )
    options.json_arg(p, "gc.json")
