"""A generation to and from an OCI registry: ``push`` (image-shaped, signed) and ``pull`` (by
digest only, every blob, file and signature checked on the way in)."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from kernelcache import output
from kernelcache.cli import options


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
        **options.registry_access(args),
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
        **options.registry_access(args),
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


def register(sub: Any) -> None:
    p = options.add_command(sub, "push", cmd_push, "push a generation to an OCI registry")
    options.store_arg(p)
    p.add_argument("--key", required=True, help="NAMESPACE/NAME/ARCH")
    p.add_argument("ref", metavar="REF", help="REGISTRY/REPOSITORY[:TAG] (tag: the generation id)")
    p.add_argument("--generation", help="this generation of the key (default: the current one)")
    p.add_argument(
        "--signing-key", type=options.path, help="ed25519 private key to sign the artifact"
    )
    p.add_argument("--gzip", action="store_true", help="compress the layers")
    options.registry_args(p)
    options.json_arg(p, "push.json")

    p = options.add_command(
        sub, "pull", cmd_pull, "pull a generation by digest from an OCI registry into a store"
    )
    p.add_argument("ref", metavar="REF", help="REGISTRY/REPOSITORY@sha256:<hex> (a digest)")
    options.store_arg(p)
    p.add_argument("--key", help="NAMESPACE/NAME/ARCH the artifact must be of")
    p.add_argument(
        "--public-key", type=options.path, help="ed25519 public key: the signature must verify"
    )
    p.add_argument("--require-signature", action="store_true", help="refuse unsigned artifacts")
    options.registry_args(p)
    options.json_arg(p, "pull.json")
