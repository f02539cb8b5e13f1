"""Generations beyond one volume: a generation as an OCI artifact in a registry.

``push`` sends a store's generation to a registry as an image-shaped artifact (an OCI image
manifest whose tar layers hold the generation's own files, so an image volume mounts it) and
signs it under cosign's tag scheme; ``pull`` fetches one by digest into a store, checking
every blob by its digest, the signature, then the generation itself, and publishes it through
the store's writer. ``artifact`` is the artifact's shape, ``auth`` where credentials come
from, ``registry`` the thin layer over the client library (oras-py). docs/distribution.md
says why each choice was made.
"""

from kernelcache.distribution.auth import Credentials, credentials_for
from kernelcache.distribution.oci import Artifact, PullResult, PushResult, describe, pull, push
from kernelcache.distribution.reference import Reference

__all__ = [
    "Artifact",
    "Credentials",
    "PullResult",
    "PushResult",
    "Reference",
    "credentials_for",
    "describe",
    "pull",
    "push",
]
