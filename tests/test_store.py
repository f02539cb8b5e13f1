"""kernelcache.store: publish, content addressing, gc, signing, manifest parsing, verify and
materialize. Fault injection (kill -9, full disk, racing writers) is in test_store_faults.py."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kernelcache.errors import (
    ExitCode,
    IntegrityError,
    ManifestError,
    SignatureError,
    SpecError,
    StorageError,
    UnsafePathError,
)
from kernelcache.store import (
    COMPLETE_MARKER,
    CURRENT_NAME,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    SIGNATURE_NAME,
    FileEntry,
    Manifest,
    Store,
    digest_file,
    digest_tree,
    digests,
    generate_keypair,
    generation_id,
    load_private_key,
    load_public_key,
    materialize,
    verify,
)
from kernelcache.store.digests import _CHUNK as CHUNK
from kernelcache.store.materialization import _BATCH_BYTES as BATCH_BYTES
from kernelcache.store.materialization import _BATCH_FILES as BATCH_FILES
from tests.conftest import publish_files, scaled

KEY = "team/llama-70b/sm_90a"


def stamp(label: str = "one") -> dict[str, object]:
    factors = {"torch": "2.5.1", "cuda": "12.4", "triton": "3.1.0"}
    return {
        "digest": f"blake3:stamp-{label}",
        "compile_digest": f"blake3:compile-{label}",
        "factors": factors,
        "factor_digests": {name: f"blake3:{value}" for name, value in factors.items()},
    }


def random_files(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {
        "triton/abc/kernel.cubin": rng.randbytes(3000),
        "triton/abc/kernel.json": rng.randbytes(400),
        "cute/def/gemm.o": rng.randbytes(70_000),
        "cute/empty.bin": b"",
        "flashinfer/big.so": rng.randbytes(1_200_000),
    }


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def publish(store: Store, files: dict[str, bytes], label: str = "one", **kwargs) -> Manifest:
    return publish_files(store, KEY, files, stamp(label), {"compiled": len(files)}, **kwargs)


def transient(key_dir: Path) -> list[str]:
    transient_prefixes = (".staging-", ".trash-", ".CURRENT.", ".HISTORY.")
    return [n for n in os.listdir(key_dir) if n.startswith(transient_prefixes)]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


# --------------------------------------------------------------------------- publish


def test_publish_then_current_verifies(store: Store) -> None:
    files = random_files(1)
    assert store.current(KEY) is None
    assert store.current_manifest(KEY) is None

    manifest = publish(store, files)

    gen_dir = store.current(KEY)
    assert gen_dir == store.key_dir(KEY) / manifest.generation
    assert (store.key_dir(KEY) / CURRENT_NAME).read_text() == manifest.generation + "\n"
    assert store.current_manifest(KEY) == manifest
    assert store.keys() == [KEY]
    assert manifest.format == MANIFEST_FORMAT
    assert manifest.key == KEY
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", manifest.created)
    assert manifest.total_bytes == sum(len(d) for d in files.values())
    assert [e.path for e in manifest.files] == sorted(files)

    result = verify(gen_dir)
    assert result.ok, result.problems
    assert result.manifest == manifest
    assert result.bytes_checked == manifest.total_bytes
    assert (gen_dir / MANIFEST_NAME).read_bytes() == manifest.to_bytes()
    for rel, data in files.items():
        assert (gen_dir / "files" / rel).read_bytes() == data
    assert transient(store.key_dir(KEY)) == []


def test_manifest_bytes_are_canonical(store: Store) -> None:
    manifest = publish(store, random_files(1))
    data = manifest.to_bytes()
    assert data.endswith(b"}\n")
    assert data == (json.dumps(json.loads(data), sort_keys=True, indent=1) + "\n").encode()
    assert Manifest.parse(data, "m").to_bytes() == data


def test_identical_content_is_one_generation(store: Store) -> None:
    first = publish(store, random_files(1))
    second = publish(store, random_files(1))
    assert second.generation == first.generation
    gens = [n for n in os.listdir(store.key_dir(KEY)) if not n.startswith(".") and n != "CURRENT"]
    assert gens == [first.generation]
    assert len(store.generations(KEY)) == 1
    assert verify(store.current(KEY)).ok


def test_generation_id_is_content_addressed(tmp_path: Path) -> None:
    write_tree(tmp_path, random_files(1))
    entries = digest_tree(tmp_path)
    gen = generation_id("blake3:s", entries)
    assert len(gen) >= 16
    assert gen == generation_id("blake3:s", list(reversed(entries)))
    assert gen != generation_id("blake3:t", entries)
    changed = [
        FileEntry(e.path, e.size, "blake3:" + "0" * 64) if i == 0 else e
        for i, e in enumerate(entries)
    ]
    assert gen != generation_id("blake3:s", changed)


def test_publish_from_outside_staging_copies_in(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "built"
    write_tree(src, random_files(2))
    with store.writer(KEY) as writer:
        manifest = writer.publish(src, stamp(), {})
    assert verify(store.current(KEY)).ok
    assert manifest.generation == publish(store, random_files(2)).generation
    assert sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()) == sorted(
        random_files(2)
    )


def test_republish_replaces_a_generation_that_no_longer_verifies(store: Store) -> None:
    manifest = publish(store, random_files(1))
    damaged = store.current(KEY) / "files" / "triton/abc/kernel.cubin"
    damaged.write_bytes(b"rot" + damaged.read_bytes()[3:])
    assert not verify(store.current(KEY)).ok

    again = publish(store, random_files(1))
    assert again.generation == manifest.generation
    assert verify(store.current(KEY)).ok


def test_publish_replaces_what_lies_under_its_generation_id(store: Store, tmp_path: Path) -> None:
    """A symlink (to a copy outside the store) or a file where the new generation goes is
    not the generation: it is replaced, and the published directory is the store's own."""
    manifest = publish(store, random_files(1))
    gen_dir = store.key_dir(KEY) / manifest.generation
    outside = tmp_path / "outside"
    shutil.copytree(gen_dir, outside)
    for planted in ("symlink", "file"):
        shutil.rmtree(gen_dir)
        if planted == "symlink":
            gen_dir.symlink_to(outside)
        else:
            gen_dir.write_text("not a generation\n")
        assert publish(store, random_files(1)).generation == manifest.generation, planted
        assert not gen_dir.is_symlink() and verify(gen_dir, key=KEY).ok, planted
        assert transient(store.key_dir(KEY)) == [], planted


def test_a_symlinked_lock_file_is_not_followed(store: Store, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    store.key_dir(KEY).mkdir(parents=True)
    (store.key_dir(KEY) / ".lock").symlink_to(victim)
    with pytest.raises(StorageError, match="ELOOP"), store.writer(KEY):
        pass
    assert victim.read_text() == "precious\n"


def test_unpublished_staging_is_removed_when_the_writer_closes(store: Store) -> None:
    with store.writer(KEY) as writer:
        staging = writer.staging()
        (staging / "x").write_bytes(b"x")
        assert staging.parent.name.startswith(".staging-")
        assert staging.parent.parent == store.key_dir(KEY)
    assert not staging.exists()
    with pytest.raises(RuntimeError):
        writer.staging()


def test_publish_refuses_symlinks(store: Store) -> None:
    with store.writer(KEY) as writer:
        staging = writer.staging()
        (staging / "a").write_bytes(b"a")
        (staging / "link").symlink_to("a")
        with pytest.raises(UnsafePathError, match="link: is a symlink"):
            writer.publish(staging, stamp(), {})
    assert store.current(KEY) is None
    assert transient(store.key_dir(KEY)) == []


@pytest.mark.parametrize(
    "key",
    [
        "team/model",
        "team/model/sm_90a/x",
        "Team/model/sm_90a",
        "team/../sm_90a",
        "team/model/..",
        "/team/model/sm_90a",
        "team//sm_90a",
        "team/model/.hidden",
    ],
)
def test_bad_keys_are_refused(store: Store, key: str) -> None:
    with pytest.raises(SpecError, match="key"):
        store.key_dir(key)


# --------------------------------------------------------------------------- gc


def test_publish_keeps_the_newest_generations_besides_the_current_one(store: Store) -> None:
    ids = [publish(store, random_files(i), label=str(i), keep=2).generation for i in range(4)]
    assert [m.generation for m in store.generations(KEY)] == ids[-3:]
    assert store.current(KEY).name == ids[-1]


def test_retention_orders_by_when_each_generation_was_last_current(store: Store) -> None:
    """A, B, A again (the same content: its first creation time), then C: A is the one
    CURRENT named before C, the rollback target, and it is kept over B."""
    a = publish(store, random_files(1), label="a", keep=5).generation
    b = publish(store, random_files(2), label="b", keep=5).generation
    assert publish(store, random_files(1), label="a", keep=5).generation == a
    c = publish(store, random_files(3), label="c", keep=1).generation
    assert store.current(KEY).name == c
    assert sorted(m.generation for m in store.generations(KEY)) == sorted([a, c])
    assert [path.name for path, _ in store.rollback_order(KEY)] == [a]
    assert not (store.key_dir(KEY) / b).exists()


def test_make_current_again_points_current_at_a_kept_generation_of_the_stamp(
    store: Store, tmp_path: Path
) -> None:
    """No files are staged: the kept generation is verified (its signature too), re-signed
    with the key being rotated in, made current, and old generations collected as a publish
    does."""
    old_priv, old_pub = generate_keypair(tmp_path / "old")
    priv, pub = generate_keypair(tmp_path / "keys")
    a = publish(store, random_files(1), label="a", keep=5, signing_key=old_priv)
    b = publish(store, random_files(2), label="b", keep=5, signing_key=old_priv)
    with store.writer(KEY) as writer:
        assert writer.make_current_again(stamp("other")["digest"]) is None
        assert store.current(KEY).name == b.generation
        again = writer.make_current_again(
            a.stamp["digest"], signing_key=priv, keep=0, trusted=[load_public_key(old_pub)]
        )
    assert again == a
    assert store.current(KEY).name == a.generation
    assert verify(store.current(KEY), key=KEY, public_key=pub, require_signature=True).ok
    assert [m.generation for m in store.generations(KEY)] == [a.generation]  # keep=0


def test_make_current_again_skips_a_kept_generation_that_no_longer_verifies(
    store: Store,
) -> None:
    a = publish(store, random_files(1), label="a", keep=5)
    publish(store, random_files(2), label="b", keep=5)
    victim = store.key_dir(KEY) / a.generation / "files" / "cute" / "def" / "gemm.o"
    victim.write_bytes(b"corrupted")
    with store.writer(KEY) as writer:
        assert writer.make_current_again(a.stamp["digest"]) is None
    assert store.current(KEY).name != a.generation


def test_gc_keeps_newest_and_always_current(store: Store) -> None:
    """keep counts generations besides the current one; CURRENT set by hand (a rollback no
    writer recorded) still keeps the one it replaced, by that one's creation time."""
    ids = [publish(store, random_files(i), label=str(i), keep=10).generation for i in range(4)]
    assert [m.generation for m in store.generations(KEY)] == ids  # oldest → newest
    (store.key_dir(KEY) / CURRENT_NAME).write_text(ids[0] + "\n")  # a rollback

    assert store.gc(KEY, keep=2) == [ids[1]]
    assert [m.generation for m in store.generations(KEY)] == [ids[0], ids[2], ids[3]]

    assert sorted(store.gc(KEY, keep=0)) == sorted([ids[2], ids[3]])
    assert [m.generation for m in store.generations(KEY)] == [ids[0]]
    assert verify(store.current(KEY)).ok
    assert transient(store.key_dir(KEY)) == []


# --------------------------------------------------------------------------- signing


def test_signed_manifest_verifies(store: Store, tmp_path: Path) -> None:
    priv, pub = generate_keypair(tmp_path / "keys")
    publish(store, random_files(1), signing_key=priv)
    gen_dir = store.current(KEY)
    assert (gen_dir / SIGNATURE_NAME).is_file()
    assert verify(gen_dir, public_key=pub, require_signature=True).ok
    assert verify(gen_dir, public_key=load_public_key(pub)).ok


def test_tampered_factor_with_old_signature_fails(store: Store, tmp_path: Path) -> None:
    priv, pub = generate_keypair(tmp_path / "keys")
    publish(store, random_files(1), signing_key=priv)
    manifest_path = store.current(KEY) / MANIFEST_NAME
    data = manifest_path.read_bytes()
    assert data.count(b'"2.5.1"') == 1
    manifest_path.write_bytes(data.replace(b'"2.5.1"', b'"2.5.2"'))

    result = verify(store.current(KEY), public_key=pub)
    assert [p.code for p in result.problems] == [ExitCode.SIGNATURE]
    assert "does not match" in result.problems[0].message
    with pytest.raises(SignatureError):
        result.raise_for_problems()


@pytest.mark.parametrize(
    "edit",
    [
        lambda sig: sig[:-1],  # the newline cut off
        lambda sig: sig[:-1] + b"\x0b",  # the newline turned into another whitespace
        lambda sig: sig + b" ",
        lambda sig: sig[:-2] + bytes([sig[-2] ^ 1]) + b"\n",  # the last character's spare bit
    ],
    ids=["no-newline", "vertical-tab", "trailing-space", "spare-bit"],
)
def test_a_signature_file_changed_in_any_byte_is_refused(
    store: Store, tmp_path: Path, edit: Callable[[bytes], bytes]
) -> None:
    """Edits that still decode to the same signature: the file is not as it was written."""
    priv, pub = generate_keypair(tmp_path / "keys")
    publish(store, random_files(1), signing_key=priv)
    sig_path = store.current(KEY) / SIGNATURE_NAME
    sig_path.write_bytes(edit(sig_path.read_bytes()))
    result = verify(store.current(KEY), public_key=pub)
    assert [p.code for p in result.problems] == [ExitCode.SIGNATURE], result.problems


def test_missing_signature_when_required(store: Store, tmp_path: Path) -> None:
    _, pub = generate_keypair(tmp_path / "keys")
    publish(store, random_files(1))
    gen_dir = store.current(KEY)
    assert verify(gen_dir).ok
    result = verify(gen_dir, public_key=pub, require_signature=True)
    assert [p.code for p in result.problems] == [ExitCode.SIGNATURE]
    assert result.problems[0].message.endswith(f"{SIGNATURE_NAME}: missing")

    no_key = verify(gen_dir, require_signature=True)
    assert [p.code for p in no_key.problems] == [ExitCode.SIGNATURE]
    assert "no public key" in no_key.problems[0].message


def test_signature_from_another_key_fails(store: Store, tmp_path: Path) -> None:
    priv, _ = generate_keypair(tmp_path / "a")
    _, other_pub = generate_keypair(tmp_path / "b")
    publish(store, random_files(1), signing_key=priv)
    result = verify(store.current(KEY), public_key=other_pub)
    assert [p.code for p in result.problems] == [ExitCode.SIGNATURE]


def test_republish_signs_the_kept_generation(store: Store, tmp_path: Path) -> None:
    priv, pub = generate_keypair(tmp_path / "keys")
    publish(store, random_files(1))
    publish(store, random_files(1), signing_key=priv)
    assert verify(store.current(KEY), public_key=pub, require_signature=True).ok


def test_key_files(tmp_path: Path) -> None:
    priv, pub = generate_keypair(tmp_path)
    assert priv.stat().st_mode & 0o777 == 0o600
    with pytest.raises(SpecError, match="already exists"):
        generate_keypair(tmp_path)  # never overwrites a key

    raw = Ed25519PrivateKey.generate()
    (tmp_path / "raw.key").write_bytes(raw.private_bytes_raw())
    (tmp_path / "raw.pub").write_bytes(raw.public_key().public_bytes_raw())
    message = b"manifest"
    load_public_key(tmp_path / "raw.pub").verify(
        load_private_key(tmp_path / "raw.key").sign(message), message
    )
    (tmp_path / "bad.pub").write_bytes(b"not a key")
    for loader, path in [
        (load_public_key, tmp_path / "bad.pub"),
        (load_private_key, tmp_path / "missing.key"),
        (load_private_key, pub),  # a public key where a private one is expected
    ]:
        with pytest.raises(SignatureError) as err:
            loader(path)
        assert str(path) in str(err.value)
        assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- Manifest.parse


def valid_manifest_dict() -> dict:
    return {
        "format": MANIFEST_FORMAT,
        "key": KEY,
        "generation": "0123456789abcdef0123456789abcdef",
        "created": "2025-01-02T03:04:05.123456Z",
        "stamp": stamp(),
        "files": [
            {"path": "triton/a.cubin", "size": 3, "digest": "blake3:" + "a" * 64},
            {"path": "cute/b.o", "size": 0, "digest": "blake3:" + "b" * 64},
        ],
        "report": {"compiled": 2},
    }


def encode(obj: object) -> bytes:
    return json.dumps(obj).encode()


def with_path(path: str) -> bytes:
    d = valid_manifest_dict()
    d["files"][0]["path"] = path
    return encode(d)


def without(field: str) -> bytes:
    d = valid_manifest_dict()
    del d[field]
    return encode(d)


def changed(**fields: object) -> bytes:
    return encode({**valid_manifest_dict(), **fields})


def duplicated() -> bytes:
    d = valid_manifest_dict()
    d["files"].append(dict(d["files"][0]))
    return encode(d)


def file_and_dir() -> bytes:
    d = valid_manifest_dict()
    d["files"].append({"path": "triton/a.cubin/x", "size": 1, "digest": "blake3:" + "c" * 64})
    return encode(d)


def size_of(value: object) -> bytes:
    d = valid_manifest_dict()
    d["files"][0]["size"] = value
    return encode(d)


GOOD = encode(valid_manifest_dict())

BAD_MANIFESTS = {
    "truncated": (GOOD[: len(GOOD) // 2], ManifestError, "invalid JSON"),
    "garbage": (b"\xff\xfe\x00\x17garbage", ManifestError, "not UTF-8"),
    "not an object": (b"[1, 2]", ManifestError, "should be a valid dictionary"),
    "wrong format": (changed(format="kernelcache.dev/manifest/v0"), ManifestError, "format"),
    "missing report": (without("report"), ManifestError, "field report: Field required"),
    "missing files": (without("files"), ManifestError, "field files: Field required"),
    "extra field": (changed(extra=1), ManifestError, "field extra"),
    "bad key": (changed(key="a/b"), ManifestError, "field key"),
    "bad time": (changed(created="2025-13-02T03:04:05Z"), ManifestError, "field created"),
    "bad generation": (changed(generation="xyz"), ManifestError, "field generation"),
    "stamp without digest": (changed(stamp={"factors": {}}), ManifestError, "stamp.digest"),
    "negative size": (size_of(-1), ManifestError, "files.0.size"),
    "bool size": (size_of(True), ManifestError, "files.0.size"),
    "duplicate key": (GOOD[:-1] + b', "report": {}}', ManifestError, "duplicate JSON key"),
    "duplicate path": (duplicated(), ManifestError, "duplicate path 'triton/a.cubin'"),
    "file and dir": (file_and_dir(), ManifestError, "as a file and as a directory"),
    "absolute": (with_path("/etc/passwd"), UnsafePathError, "absolute path: '/etc/passwd'"),
    "dotdot": (with_path("../x"), UnsafePathError, "'..' segment: '../x'"),
    "inner dotdot": (with_path("a/../../x"), UnsafePathError, "'..' segment"),
    "empty segment": (with_path("a//b"), UnsafePathError, "empty path segment: 'a//b'"),
    "backslash": (with_path("a\\b"), UnsafePathError, "backslash"),
    "nul": (with_path("a\0b"), UnsafePathError, "NUL"),
    "empty": (with_path(""), UnsafePathError, "empty path"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_manifest_parse_rejects(case: str) -> None:
    data, error, fragment = BAD_MANIFESTS[case]
    with pytest.raises(error) as err:
        Manifest.parse(data, "gen/MANIFEST.json")
    message = str(err.value)
    assert message.startswith("gen/MANIFEST.json: "), message
    assert fragment in message, message
    assert "\n" not in message


def test_manifest_parse_accepts_the_valid_one() -> None:
    manifest = Manifest.parse(GOOD, "m")
    assert [e.path for e in manifest.files] == ["cute/b.o", "triton/a.cubin"]
    assert manifest.total_bytes == 3
    assert Manifest.parse(manifest.to_bytes(), "m") == manifest


# --------------------------------------------------------------------------- verify


def only_problem(gen_dir: Path) -> tuple[ExitCode, str | None, str]:
    result = verify(gen_dir)
    assert len(result.problems) == 1, result.problems
    problem = result.problems[0]
    assert "\n" not in problem.message
    assert problem.path is not None and problem.message.startswith(problem.path)
    return problem.code, problem.path, problem.message


def test_verify_detects_a_flipped_byte_in_every_file(store: Store) -> None:
    manifest = publish(store, random_files(1))
    gen_dir = store.current(KEY)
    rng = random.Random(7)
    for entry in manifest.files:
        if entry.size == 0:
            continue
        path = gen_dir / "files" / entry.path
        original = path.read_bytes()
        offset = rng.randrange(entry.size)
        flipped = bytearray(original)
        flipped[offset] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(flipped))

        code, problem_path, message = only_problem(gen_dir)
        assert (code, problem_path) == (ExitCode.INTEGRITY, str(path))
        assert message.endswith("digest mismatch")

        path.write_bytes(original)
        assert verify(gen_dir).ok


def test_verify_detects_truncation_deletion_and_additions(store: Store) -> None:
    publish(store, random_files(1))
    gen_dir = store.current(KEY)
    big = gen_dir / "files" / "flashinfer/big.so"
    data = big.read_bytes()

    big.write_bytes(data[:-10])
    assert only_problem(gen_dir) == (
        ExitCode.INTEGRITY,
        str(big),
        f"{big}: size {len(data) - 10} != manifest {len(data)}",
    )
    big.unlink()
    assert only_problem(gen_dir) == (ExitCode.INTEGRITY, str(big), f"{big}: missing")
    big.write_bytes(data)

    extra = gen_dir / "files" / "triton" / "extra.cubin"
    extra.write_bytes(b"smuggled")
    assert only_problem(gen_dir) == (ExitCode.INTEGRITY, str(extra), f"{extra}: not in manifest")
    extra.unlink()
    assert verify(gen_dir).ok


def test_verify_detects_a_file_swapped_in_from_another_generation(store: Store) -> None:
    old = publish(store, random_files(1), label="old", keep=5)
    new = publish(store, random_files(2), label="new", keep=5)  # same paths and sizes
    rel = "cute/def/gemm.o"
    target = store.key_dir(KEY) / new.generation / "files" / rel
    shutil.copyfile(store.key_dir(KEY) / old.generation / "files" / rel, target)
    assert only_problem(store.current(KEY)) == (
        ExitCode.INTEGRITY,
        str(target),
        f"{target}: digest mismatch",
    )


def test_verify_refuses_symlinks_inside_files(store: Store, tmp_path: Path) -> None:
    publish(store, random_files(1))
    gen_dir = store.current(KEY)
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")

    out_link = gen_dir / "files" / "triton" / "escape"
    out_link.symlink_to(outside)
    code, path, message = only_problem(gen_dir)
    assert (code, path) == (ExitCode.UNSAFE_PATH, str(out_link))
    assert "symlink" in message
    out_link.unlink()

    listed = gen_dir / "files" / "triton/abc/kernel.json"
    listed.unlink()
    listed.symlink_to("kernel.cubin")  # points inside, still refused
    code, path, _ = only_problem(gen_dir)
    assert (code, path) == (ExitCode.UNSAFE_PATH, str(listed))

    with pytest.raises(UnsafePathError, match=r"kernel\.json"):
        verify(gen_dir).raise_for_problems()


def test_verify_refuses_a_symlinked_directory(store: Store) -> None:
    publish(store, random_files(1))
    gen_dir = store.current(KEY)
    cute = gen_dir / "files" / "cute"
    cute.rename(gen_dir / "cute-elsewhere")
    cute.symlink_to(gen_dir / "cute-elsewhere")
    code, path, _ = only_problem(gen_dir)  # one problem: its files are not also "missing"
    assert (code, path) == (ExitCode.UNSAFE_PATH, str(cute))


def test_verify_manifest_problems(store: Store, tmp_path: Path) -> None:
    result = verify(tmp_path / "nowhere")
    assert [p.code for p in result.problems] == [ExitCode.MISSING_GENERATION]

    publish(store, random_files(1))
    gen_dir = store.current(KEY)
    manifest_path = gen_dir / MANIFEST_NAME
    data = manifest_path.read_bytes()

    manifest_path.unlink()
    assert only_problem(gen_dir) == (
        ExitCode.MALFORMED_MANIFEST,
        str(manifest_path),
        f"{manifest_path}: missing",
    )
    manifest_path.write_bytes(data[:100])
    assert only_problem(gen_dir)[0] == ExitCode.MALFORMED_MANIFEST

    # Any edit of the manifest is caught by its checksum ...
    edited = json.loads(data)
    edited["report"]["note"] = "edited"
    manifest_path.write_bytes(json.dumps(edited).encode())
    assert only_problem(gen_dir) == (
        ExitCode.MALFORMED_MANIFEST,
        str(manifest_path),
        f"{manifest_path}: checksum mismatch: the manifest changed after it was written",
    )
    # ... and, with the checksum gone too, a listed size or digest edited to match a tampered
    # file is still caught by the content id.
    edited = json.loads(data)
    del edited["checksum"]
    entry_size = edited["files"][0]["size"]
    edited["files"][0]["size"] += 1
    manifest_path.write_bytes(json.dumps(edited).encode())
    problems = verify(gen_dir).problems
    assert [p.code for p in problems] == [ExitCode.INTEGRITY] * 2
    entry = edited["files"][0]["path"]
    assert problems[0].message.endswith(f"{entry}: size {entry_size} != manifest {entry_size + 1}")
    assert "does not match its content" in problems[1].message


MANIFEST_FLIPS = 1000


def test_any_bit_flipped_in_an_unsigned_manifest_is_detected(store: Store) -> None:
    """Stamp factors, the warm report and the creation time are outside the generation id;
    the manifest's checksum covers them, so no flip anywhere in it goes unseen."""
    publish(store, {"cute/def/gemm.o": b"o" * 100})
    manifest_path = store.current(KEY) / MANIFEST_NAME
    data = manifest_path.read_bytes()
    rng = random.Random(20261130)
    missed = []
    for _ in range(MANIFEST_FLIPS):
        offset, bit = rng.randrange(len(data)), rng.randrange(8)
        flipped = bytearray(data)
        flipped[offset] ^= 1 << bit
        manifest_path.write_bytes(bytes(flipped))
        if verify(store.current(KEY), digests=False).ok:
            missed.append((offset, bit))
    manifest_path.write_bytes(data)
    assert verify(store.current(KEY)).ok
    assert missed == [], f"undetected flips (offset, bit), seed 20261130: {missed[:10]}"


def test_raise_for_problems_counts_the_rest(store: Store) -> None:
    publish(store, random_files(1))
    gen_dir = store.current(KEY)
    for rel in ("cute/def/gemm.o", "triton/abc/kernel.cubin", "triton/abc/kernel.json"):
        (gen_dir / "files" / rel).unlink()
    result = verify(gen_dir)
    assert not result.ok
    # The others named as the generation names them; each in full among the details.
    others = r"files/triton/abc/kernel\.cubin, files/triton/abc/kernel\.json"
    with pytest.raises(IntegrityError, match=rf": missing \(and 2 more: {others}\)$") as err:
        result.raise_for_problems()
    assert err.value.code == ExitCode.INTEGRITY
    assert len(err.value.details) == 3 and all(": missing" in d for d in err.value.details)


def test_digest_tree_and_file(tmp_path: Path) -> None:
    files = random_files(3)
    write_tree(tmp_path / "t", files)
    entries = digest_tree(tmp_path / "t", workers=3)
    assert [e.path for e in entries] == sorted(files)
    for entry in entries:
        assert entry.size == len(files[entry.path])
        assert entry.digest == digest_file(tmp_path / "t" / entry.path)
        assert re.fullmatch(r"blake3:[0-9a-f]{64}", entry.digest)
    (tmp_path / "t" / "cute" / "link").symlink_to("/etc/hostname")
    with pytest.raises(UnsafePathError, match="cute/link"):
        digest_tree(tmp_path / "t")


# --------------------------------------------------------------------------- materialize


def test_materialize_copies_exactly(store: Store, tmp_path: Path) -> None:
    files = random_files(1)
    publish(store, files)
    gen_dir = store.current(KEY)
    result = verify(gen_dir)
    assert result.manifest is not None
    target = tmp_path / "target"

    out = materialize(result, target, workers=4)

    assert out == target / result.manifest.generation
    assert sorted(os.listdir(target)) == [result.manifest.generation]
    assert (out / COMPLETE_MARKER).is_file()
    for rel, data in files.items():
        assert (out / "files" / rel).read_bytes() == data
    assert (out / MANIFEST_NAME).read_bytes() == (gen_dir / MANIFEST_NAME).read_bytes()
    assert verify(out).ok
    assert materialize(result, target) == out  # copied afresh to the same place


def test_materialize_of_a_corrupted_source_leaves_nothing(store: Store, tmp_path: Path) -> None:
    publish(store, random_files(1))
    gen_dir = store.current(KEY)
    checked = verify(gen_dir, digests=False)
    bad = gen_dir / "files" / "flashinfer/big.so"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    target = tmp_path / "target"

    with pytest.raises(IntegrityError) as err:
        materialize(checked, target)

    assert str(err.value) == f"{bad}: digest mismatch"
    assert os.listdir(target) == []


def test_materialize_replaces_an_incomplete_copy(store: Store, tmp_path: Path) -> None:
    manifest = publish(store, random_files(1))
    stale = tmp_path / "target" / manifest.generation
    (stale / "files").mkdir(parents=True)
    (stale / "files" / "junk").write_bytes(b"junk")  # no .complete: not to be trusted
    out = materialize(verify(store.current(KEY)), tmp_path / "target")
    assert out == stale
    assert verify(out).ok


def boundary_files(seed: int) -> dict[str, bytes]:
    """Files on every edge of the copy's reads and tasks: empty, one byte, a read buffer
    less one, exactly one, and one more, a task's size on each side, a directory of more
    files than one task takes, a big file beside small ones, and nested directories whose
    files sort between a sibling directory's."""
    rng = random.Random(seed)
    sizes = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7]
    files = {f"edges/f{i}.bin": rng.randbytes(size) for i, size in enumerate(sizes)}
    for i, size in enumerate([BATCH_BYTES - 1, BATCH_BYTES, BATCH_BYTES + 1]):
        files[f"mixed/big{i}.so"] = rng.randbytes(size)
        files[f"mixed/small{i}.json"] = rng.randbytes(rng.randint(1, 5000))
    for i in range(BATCH_FILES + 40):
        files[f"cute/k{i:04d}.o"] = rng.randbytes(rng.randint(0, 3000))
    files["cute/sub/inner.o"] = rng.randbytes(900)
    files["cute/sub/deeper/leaf.o"] = rng.randbytes(CHUNK + 3)
    files["cute-dsl/after.o"] = rng.randbytes(17)
    return files


def test_materialize_writes_each_files_own_bytes_on_every_edge(
    store: Store, tmp_path: Path
) -> None:
    """Files copied many to a task, through one reused read buffer: each copy holds its own
    file's bytes (none of a file read before it), and a corrupted file in the middle of a
    task is refused with the copy left as it was."""
    files = boundary_files(2)
    publish(store, files)
    gen_dir = store.current(KEY)
    checked = verify(gen_dir, digests=False)
    target = tmp_path / "target"

    out = materialize(checked, target, workers=3)

    for rel, data in files.items():
        assert (out / "files" / rel).read_bytes() == data, rel
    assert verify(out).ok
    bad = gen_dir / "files" / "cute" / f"k{BATCH_FILES // 2:04d}.o"
    data = bytearray(bad.read_bytes() or b"\0")
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=re.escape(str(bad))):
        materialize(checked, target, workers=3)
    assert os.listdir(target) == [out.name]
    assert verify(out).ok


def test_materialize_copies_on_several_threads_at_once(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy runs on its pool: the first two writes wait for each other (a copy on one
    thread would wait here until the barrier gives up, and fail)."""
    publish(store, boundary_files(3))
    checked = verify(store.current(KEY), digests=False)
    barrier = threading.Barrier(2, timeout=scaled(60))
    writers: set[int] = set()
    calls = 0
    lock = threading.Lock()
    real_write_all = digests.write_all

    def meeting_write_all(fd: int, data: bytes | memoryview) -> None:
        nonlocal calls
        with lock:
            calls += 1
            first_two = calls <= 2
            writers.add(threading.get_ident())
        if first_two:
            barrier.wait()
        real_write_all(fd, data)

    monkeypatch.setattr(digests, "write_all", meeting_write_all)
    out = materialize(checked, tmp_path / "target", workers=4)
    assert len(writers) >= 2
    assert verify(out).ok


@pytest.mark.parametrize("directory", ["cute/def", "cute"], ids=["its own", "one above it"])
def test_materialize_refuses_a_directory_swapped_for_a_symlink(
    store: Store, tmp_path: Path, directory: str
) -> None:
    """A directory of the store replaced after verify by a symlink to a copy of itself
    elsewhere (every byte the manifest's), the files' own directory or one above it: refused,
    naming it, and nothing materialized."""
    files = random_files(4)
    publish(store, files)
    gen_dir = store.current(KEY)
    checked = verify(gen_dir, digests=False)
    swapped = gen_dir / "files" / directory
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(swapped, elsewhere)
    shutil.rmtree(swapped)
    swapped.symlink_to(elsewhere)
    target = tmp_path / "target"

    with pytest.raises(UnsafePathError, match=f"^{re.escape(str(swapped))}: is a symlink"):
        materialize(checked, target, workers=2)

    assert os.listdir(target) == []


def test_materialize_names_a_file_whose_directory_went_missing(
    store: Store, tmp_path: Path
) -> None:
    """A directory of the store removed after verify: the copy names its first file missing
    (not the directory's errno), and nothing is materialized."""
    publish(store, random_files(5))
    gen_dir = store.current(KEY)
    checked = verify(gen_dir, digests=False)
    shutil.rmtree(gen_dir / "files" / "triton" / "abc")
    target = tmp_path / "target"

    with pytest.raises(IntegrityError) as err:
        materialize(checked, target, workers=2)

    assert str(err.value) == f"{gen_dir / 'files' / 'triton' / 'abc' / 'kernel.cubin'}: missing"
    assert os.listdir(target) == []


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """The permission bits of every entry under root (root itself as ".")."""
    found = {".": stat.S_IMODE(root.lstat().st_mode)}
    for path in root.rglob("*"):
        found[path.relative_to(root).as_posix()] = stat.S_IMODE(path.lstat().st_mode)
    return found


def test_published_files_are_the_generations_own_and_readable_by_all(
    store: Store, tmp_path: Path
) -> None:
    """A warmer under umask 077 that hard-links its cache to a file of its own: the
    generation holds a copy (editing the warmer's file changes nothing published), and every
    entry is readable by a serving user (an executable stays executable)."""
    outside = tmp_path / "warmer-cache.bin"
    outside.write_bytes(b"\x7fELF kernel")
    with umask(0o077), store.writer(KEY) as writer:
        staging = writer.staging()
        (staging / "triton" / "abc").mkdir(parents=True)
        os.link(outside, staging / "triton" / "abc" / "kernel.cubin")
        (staging / "triton" / "abc" / "launcher.so").write_bytes(b"so")
        (staging / "triton" / "abc" / "launcher.so").chmod(0o700)
        manifest = writer.publish(staging, stamp(), {})
    gen_dir = store.current(KEY)
    kernel = gen_dir / "files" / "triton" / "abc" / "kernel.cubin"
    assert kernel.stat().st_nlink == 1 and outside.stat().st_nlink == 1
    outside.write_bytes(b"changed by the warmer")
    assert kernel.read_bytes() == b"\x7fELF kernel"
    assert modes(gen_dir) == {
        ".": 0o755,
        MANIFEST_NAME: 0o644,
        "files": 0o755,
        "files/triton": 0o755,
        "files/triton/abc": 0o755,
        "files/triton/abc/kernel.cubin": 0o644,
        "files/triton/abc/launcher.so": 0o755,
    }
    assert stat.S_IMODE((store.key_dir(KEY) / CURRENT_NAME).stat().st_mode) == 0o644
    assert verify(gen_dir, key=KEY).ok and manifest.generation == gen_dir.name


def test_materialized_files_are_readable_by_all_whatever_the_store_holds(
    store: Store, tmp_path: Path
) -> None:
    """The store's copy made owner-only after publishing (root's init-container still reads
    it), materialized under umask 077: the serving user can read every file of the copy."""
    publish(store, random_files(1))
    gen_dir = store.current(KEY)
    (gen_dir / "files" / "cute" / "def" / "gemm.o").chmod(0o600)
    (gen_dir / "files" / "cute" / "def").chmod(0o700)
    result = verify(gen_dir, key=KEY)
    assert result.ok, result.problems
    assert result.manifest is not None
    with umask(0o077):
        out = materialize(result, tmp_path / "target")
    for rel, mode in modes(out).items():
        is_dir = (out / rel).is_dir()
        assert mode == (0o755 if is_dir else 0o644), (rel, oct(mode))


# --------------------------------------------------------------------------- readers


def test_readers_do_not_block_while_a_writer_holds_the_lock(store: Store) -> None:
    manifest = publish(store, random_files(1))
    seen: list[object] = []

    def read() -> None:
        gen_dir = store.current(KEY)
        seen.append(gen_dir)
        seen.append(verify(gen_dir).ok)
        seen.append(store.current_manifest(KEY))

    with store.writer(KEY) as writer:
        writer.staging()
        reader = threading.Thread(target=read)
        started = time.monotonic()
        reader.start()
        reader.join(timeout=10)
        assert not reader.is_alive(), "a reader blocked on the writer lock"
    assert time.monotonic() - started < 5
    assert seen == [store.key_dir(KEY) / manifest.generation, True, manifest]


def test_materialize_names_the_whole_path_of_a_file_gone_after_verify(
    store: Store, tmp_path: Path
) -> None:
    """A file removed after verify, opened by its name in its open directory: the error
    still names it by its whole path, as missing."""
    publish(store, random_files(5))
    gen_dir = store.current(KEY)
    checked = verify(gen_dir, digests=False)
    gone = gen_dir / "files" / "triton" / "abc" / "kernel.cubin"
    gone.unlink()

    with pytest.raises(IntegrityError) as err:
        materialize(checked, tmp_path / "target", workers=2)

    assert str(err.value) == f"{gone}: missing"
