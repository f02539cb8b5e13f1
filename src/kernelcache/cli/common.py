"""What several commands read alike: a spec and its arches, keys, a store that must exist,
the manifest a reference names. Each failure is one line of its class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kernelcache.errors import MissingGenerationError, SignatureError, SpecError, StorageError


def load_spec(path: Path) -> Any:
    from kernelcache.spec import load_kernelcache
    from kernelcache.toolchains import check_warmer_env

    kc = load_kernelcache(path)
    check_warmer_env(kc.spec.warmers, str(path))
    return kc


def arches(kc: Any, requested: list[str] | None) -> list[str]:
    declared = kc.spec.arches()
    if not requested:
        return declared
    unknown = [a for a in requested if a not in declared]
    if unknown:
        raise SpecError(
            f"--arch {unknown[0]}: not an arch of spec.gpuClasses (declared: {', '.join(declared)})"
        )
    return list(dict.fromkeys(requested))  # an arch given twice is warmed once


def check_key_file(path: Path | None, flag: str) -> None:
    """A key that is not there is the signature class (as ``verify --public-key``'s is),
    found before any work: ``build`` would otherwise warm each arch to fail at publish."""
    if path is not None and not path.is_file():
        what = "is not a file" if path.exists() else "no such file"
        raise SignatureError(f"{flag} {path}: {what}", path=str(path))


def signing_key(path: Path | None) -> Any:
    if path is None:
        return None
    from kernelcache.store import load_private_key

    check_key_file(path, "--signing-key")
    return load_private_key(path)


def trusted_keys(path: Path | None) -> Any:
    if path is None:
        return None
    from kernelcache.store import load_public_keys

    return load_public_keys(path)


def existing_store(root: Path) -> Any:
    """The store at ``root`` for a command that reads one: a root that is missing or is not
    a directory is an I/O failure (an unmounted volume, a typo), never an empty store."""
    from kernelcache.initcontainer import check_store_root
    from kernelcache.store import Store

    store = Store(root)
    check_store_root(store.root)
    return store


def listed_store(root: Path) -> Any:
    """The store at ``root`` for a command that lists its keys (``inspect``, ``gc``): a
    directory without a single key's path is most often a wrong one (the volume's mount
    point before it is mounted, a typo's sibling), never an empty table and success. A key's
    directory without a generation yet (its first build runs) is a store, listed empty."""
    store = existing_store(root)
    if not store.keys() and not any(p.is_dir() for p in store.root.glob("*/*/sm_[0-9]*")):
        raise StorageError(  # as a directory of other things is: I/O, naming the path
            f"{store.root}: not a store: no generation published in it (an empty directory; "
            "build, warm or pull publishes one)",
            path=str(store.root),
        )
    return store


def published_key(store: Any, key: str) -> str:
    """``key``, refused when the store has no generation of it (and left uncreated)."""
    if not store.key_dir(key).is_dir():
        raise MissingGenerationError(f"{key}: no published generation in {store.root}")
    return key


def manifest_of(ref: str, store_root: Path | None) -> Any:
    """The manifest a reference names: a MANIFEST.json or generation dir, or with ``--store``
    a key (its current generation) or a generation id (or a unique prefix of one)."""
    from kernelcache.store import MANIFEST_NAME, Manifest

    path = Path(ref)
    if store_root is not None and not path.exists():
        store = existing_store(store_root)
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


def check_output_dir(path: Path, flag: str) -> None:
    """Refuse an output file whose directory is missing before any work, not after it."""
    if not path.parent.is_dir():
        raise SpecError(f"{flag} {path}: directory {path.parent} does not exist")
