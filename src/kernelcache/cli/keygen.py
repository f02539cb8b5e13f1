"""``keygen``: the ed25519 key pair a signing Secret holds."""

from __future__ import annotations

import argparse
from typing import Any

from kernelcache.cli import options
from kernelcache.spec import PUBLIC_KEY_FILE, SIGNING_KEY_FILE


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


def register(sub: Any) -> None:
    p = options.add_command(
        sub,
        "keygen",
        cmd_keygen,
        f"write an ed25519 key pair for signing ({SIGNING_KEY_FILE}, {PUBLIC_KEY_FILE}): the "
        "key names of the signing Secret",
    )
    p.add_argument(
        "dir", type=options.path, help=f"directory for {SIGNING_KEY_FILE} and {PUBLIC_KEY_FILE}"
    )
