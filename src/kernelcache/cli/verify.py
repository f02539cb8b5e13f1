"""The node's side: ``verify`` (the init-container's check, and its copy-out) and
``prefetch`` (the prefetch DaemonSet's copy on the node's disk)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kernelcache import contract, nodemap, output
from kernelcache.cli import common, options
from kernelcache.errors import KernelCacheError, SpecError, error_line


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
            kc = common.load_spec(args.file)
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
            **options.registry_access(args),
            public_key=args.public_key,
            require_signature=args.require_signature,
        )
    except KernelCacheError as exc:
        line = initcontainer.error_line(exc)
        initcontainer.write_termination_log(log, line)
        raise
    print(synced.summary)
    return 0


def register(sub: Any) -> None:
    p = options.add_command(
        sub, "verify", cmd_verify, "verify this node's generation (the init-container's check)"
    )
    p.add_argument("--store", type=options.path, help="store root (the PV mount)")
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
    options.registry_args(p)
    p.add_argument(
        "--local", type=options.path, metavar="DIR", help="the node's prefetched copies: used first"
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
        type=options.non_negative,
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
    p.add_argument(
        "-f", "--file", type=options.path, help="KernelCache YAML (its namespace and name)"
    )
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
    p.add_argument(
        "--public-key", type=options.path, help="ed25519 public key: the signature must verify"
    )
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
        type=options.path,
        metavar="DIR",
        help="copy the verified generation here and write DIR/kernelcache.env",
    )
    p.add_argument(
        "--termination-log",
        type=options.path,
        metavar="FILE",
        help="write a failure here too (default: /dev/termination-log when writable)",
    )
    options.json_arg(p, "verify.json")

    p = options.add_command(
        sub, "prefetch", cmd_prefetch, "keep a generation on this node's disk (prefetch)"
    )
    p.add_argument(
        "--root", type=options.path, required=True, help="the node-local root (a hostPath)"
    )
    p.add_argument("--key", required=True, help="NAMESPACE/NAME/ARCH the copy serves")
    p.add_argument(
        "--want", required=True, metavar="REF@sha256:...|GENERATION", help="what to keep"
    )
    p.add_argument("--store", type=options.path, help="copy from this store (else pull --want)")
    p.add_argument(
        "--limit",
        type=options.byte_quantity,
        required=True,
        metavar="SIZE",
        help="disk use bound: bytes, or a quantity such as 50Gi",
    )
    options.registry_args(p)
    p.add_argument(
        "--public-key", type=options.path, help="ed25519 public key: the signature must verify"
    )
    p.add_argument("--require-signature", action="store_true", help="refuse unsigned artifacts")
    p.add_argument(
        "--termination-log", type=options.path, metavar="FILE", help="write a failure here too"
    )
