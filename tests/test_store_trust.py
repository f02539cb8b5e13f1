"""Trust by construction: what is materialized is what was checked, and signatures follow the
key.

- **Verify copies what it checked**: the materialized MANIFEST.json and signature are the
  bytes checked (a store whose pair is swapped mid-verify yields a pair that verifies, or a
  failure); an earlier copy in the target is never reused; a symlink anywhere under the
  target, and a target in a store, are refused.
- **Re-pointing checks the signature**: a kept generation edited without signing (the spec
  then reverted) is not made current and signed by a signing build: it compiles anew.
- **Signing follows the key**: a signing build over one signed by a key being rotated out
  (trusted beside the new one) re-signs without compiling, after a full digest check; an
  unsigned generation is never signed by a build that did not make it (every signature
  deleted and CURRENT forged included): it compiles; a signing key the trusted public keys
  do not include is refused.
- **Key rotation** as ``docs/security.md`` gives it: pods keep starting, nothing compiles.
- ``build --json``'s schema enumerates every status the code can print.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from kernelcache import build
from kernelcache.errors import ExitCode, KernelCacheError, UnsafePathError
from kernelcache.initcontainer import Options, run
from kernelcache.store import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    Store,
    generate_keypair,
    load_public_key,
    materialize,
    verify,
)
from kernelcache.store.manifest import load_manifest
from kernelcache.store.signing import load_private_key, signature_bytes
from tests.conftest import SCHEMAS, checked, kernelcache_doc, one_line_error, run_kernelcache
from tests.helpers import generations
from tests.helpers.trust import KERNEL, forge, warmer

KEY = "default/kc/sm_90a"


class Builds:
    """``kernelcache build`` of a one-warmer spec into one store, counting compiles."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.store, self.runs = tmp, tmp / "store", tmp / "runs"
        self.spec = tmp / "kc.yaml"

    def build(self, version: str, *args: str) -> dict[str, object]:
        doc = kernelcache_doc("kc", warmers=[warmer(version)])
        self.spec.write_text(yaml.safe_dump(doc))
        proc = run_kernelcache(
            "build", "-f", str(self.spec), "--store", str(self.store), "--json", *args,
            KC_TEST_RUNS=str(self.runs),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        (result,) = checked("build", proc.stdout)["results"]
        return result

    def compiles(self) -> int:
        return len(self.runs.read_text().splitlines()) if self.runs.exists() else 0

    def pod(self, target: Path, *args: str) -> subprocess.CompletedProcess[str]:
        """A serving pod's init-container, as the webhook writes its arguments."""
        return run_kernelcache(
            "verify", "--store", str(self.store), "--key", KEY, "--check-env",
            "--materialize", str(target), *args,
        )  # fmt: skip

    def current(self) -> Path:
        gen = Store(self.store).current(KEY)
        assert gen is not None
        return gen


@pytest.fixture
def builds(tmp_path: Path) -> Builds:
    return Builds(tmp_path)


def keys(directory: Path) -> tuple[Path, Path]:
    return generate_keypair(directory)


# --------------------------------------------------------------------------- re-pointing


def test_the_re_point_attack_compiles_anew_instead_of_signing_the_edit(
    builds: Builds, tmp_path: Path
) -> None:
    """A kept generation edited without signing, then the spec reverted: a signing build
    does not make the edit current (nor sign it); it compiles, and the pod reads the kernel
    that was built, never EVIL."""
    priv, pub = keys(tmp_path / "keys")
    first = builds.build("v1", "--signing-key", str(priv))
    builds.build("v2", "--signing-key", str(priv))
    kept = Store(builds.store).key_dir(KEY) / str(first["generation"])
    forged = forge(kept, KERNEL, b"EVIL")

    again = builds.build("v1", "--signing-key", str(priv))

    assert again["status"] == "published" and builds.compiles() == 3
    assert again["generation"] != forged.name
    target = tmp_path / "pod"
    proc = builds.pod(target, "--public-key", str(pub), "--require-signature")
    assert proc.returncode == 0, proc.stderr
    assert (target / str(again["generation"]) / "files" / KERNEL).read_bytes() == b"kernel v1"
    assert not verify(forged, public_key=pub, require_signature=True).ok  # never signed


def test_re_pointing_refuses_a_kept_generation_whose_signature_does_not_verify(
    tmp_path: Path,
) -> None:
    """The writer's rule, every way a kept generation's signature can fail: missing,
    another key's, or a valid signature of other manifest bytes."""
    priv, _ = keys(tmp_path / "k")
    foreign, _ = keys(tmp_path / "f")
    root = tmp_path / "store"
    store = Store(root)
    damages = {
        "missing": lambda sig: sig.unlink(),
        "foreign": lambda sig: sig.write_bytes(
            signature_bytes(load_private_key(foreign), (sig.parent / MANIFEST_NAME).read_bytes())
        ),
        "other bytes": lambda sig: sig.write_bytes(signature_bytes(load_private_key(priv), b"{}")),
    }
    for n, (what, damage) in enumerate(damages.items()):
        key = f"ns/kc{n}/sm_90a"
        kept = generations.publish(root, key, signing_key=priv)
        generations.publish(root, key, files={"x": b"x"}, signing_key=priv)
        damage(kept / SIGNATURE_NAME)
        with store.writer(key) as writer:
            stamp_digest = load_manifest(kept).stamp["digest"]
            assert writer.make_current_again(stamp_digest, signing_key=priv) is None, what
        assert store.current(key) != kept, what


# --------------------------------------------------------------------------- signing


def test_turning_signing_on_compiles_once_and_signs_what_it_built(
    builds: Builds, tmp_path: Path
) -> None:
    """An unsigned generation is never signed by a build that did not make it: turning
    signing on costs one warm, whose same content gets the same id, now signed."""
    priv, pub = keys(tmp_path / "keys")
    unsigned = builds.build("v1")
    assert unsigned["signed_by"] is None

    signed = builds.build("v1", "--signing-key", str(priv))

    assert signed["status"] == "published" and builds.compiles() == 2
    assert signed["generation"] == unsigned["generation"]
    assert verify(builds.current(), public_key=pub, require_signature=True).ok
    assert builds.build("v1", "--signing-key", str(priv))["status"] == "up-to-date"


def test_every_signature_deleted_and_current_forged_is_not_signed_by_the_next_build(
    builds: Builds, tmp_path: Path
) -> None:
    """Someone who can write the volume deletes every signature of the key, so it looks as
    if signing was never on, and points CURRENT at an edited generation. The next signing
    build must not take that for "signing just turned on": it compiles, signs what it
    built, and a pod requiring a signature reads the kernel that was built, never EVIL."""
    priv, pub = keys(tmp_path / "keys")
    builds.build("v0", "--signing-key", str(priv))
    builds.build("v1", "--signing-key", str(priv))
    for sig in Store(builds.store).key_dir(KEY).glob(f"*/{SIGNATURE_NAME}"):
        sig.unlink()
    forged = forge(builds.current(), KERNEL, b"EVIL")
    (Store(builds.store).key_dir(KEY) / "CURRENT").write_text(forged.name + "\n")
    assert builds.current() == forged

    again = builds.build("v1", "--signing-key", str(priv))

    assert again["status"] == "published" and builds.compiles() == 3
    assert again["generation"] != forged.name
    assert not verify(forged, public_key=pub, require_signature=True).ok  # never signed
    target = tmp_path / "pod"
    proc = builds.pod(target, "--public-key", str(pub), "--require-signature")
    assert proc.returncode == 0, proc.stderr
    assert (target / str(again["generation"]) / "files" / KERNEL).read_bytes() == b"kernel v1"


def test_an_unsigned_current_generation_among_signed_ones_is_compiled_anew(
    builds: Builds, tmp_path: Path
) -> None:
    """Signing was on (a kept generation is signed), yet the current one is unsigned: it may
    have been edited, so it is not vouched for; the build compiles it again."""
    priv, pub = keys(tmp_path / "keys")
    builds.build("v0", "--signing-key", str(priv))
    current = builds.build("v1", "--signing-key", str(priv))
    (builds.current() / SIGNATURE_NAME).unlink()

    again = builds.build("v1", "--signing-key", str(priv))

    assert again["status"] == "published" and builds.compiles() == 3
    assert again["generation"] == current["generation"]  # same content, fresh and signed
    assert verify(builds.current(), public_key=pub, require_signature=True).ok


def test_another_signing_key_re_signs_when_the_old_one_is_trusted_and_compiles_otherwise(
    builds: Builds, tmp_path: Path
) -> None:
    old, old_pub = keys(tmp_path / "old")
    new, new_pub = keys(tmp_path / "new")
    both = tmp_path / "both.pub"
    both.write_bytes(old_pub.read_bytes() + new_pub.read_bytes())
    builds.build("v1", "--signing-key", str(old))

    rotated = builds.build("v1", "--signing-key", str(new), "--public-key", str(both))

    assert rotated["status"] == "re-signed" and builds.compiles() == 1
    assert verify(builds.current(), public_key=new_pub, require_signature=True).ok
    # Signed by a key nobody trusts now: not vouched for, compiled anew.
    third, _ = keys(tmp_path / "third")
    anew = builds.build("v1", "--signing-key", str(third))
    assert anew["status"] == "published" and builds.compiles() == 2


def test_a_signing_key_the_public_keys_do_not_include_is_refused(
    builds: Builds, tmp_path: Path
) -> None:
    priv, _ = keys(tmp_path / "a")
    _, other_pub = keys(tmp_path / "b")
    builds.spec.write_text(yaml.safe_dump(kernelcache_doc("kc", warmers=[warmer("v1")])))
    proc = run_kernelcache(
        "build", "-f", str(builds.spec), "--store", str(builds.store),
        "--signing-key", str(priv), "--public-key", str(other_pub),
        KC_TEST_RUNS=str(builds.runs),
    )  # fmt: skip
    assert proc.returncode == ExitCode.SIGNATURE, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert "is not among the trusted public keys" in line and "would refuse" in line
    assert builds.compiles() == 0


def test_key_rotation_as_documented_keeps_pods_starting_with_no_compile(
    builds: Builds, tmp_path: Path
) -> None:
    """docs/security.md, "Rotating the signing key": an overlap in which the Secret's
    kernelcache.pub holds both public keys. After each step a pod starts (verifying with the
    Secret's public key file as it then is), and nothing is compiled after the first build."""
    secret = tmp_path / "secret"
    old, old_pub = keys(tmp_path / "old")
    new, new_pub = keys(tmp_path / "new")

    def step(private: Path, *public: Path) -> str:
        secret.mkdir(exist_ok=True)
        shutil.copy(private, secret / "kernelcache.key")
        (secret / "kernelcache.pub").write_bytes(b"".join(p.read_bytes() for p in public))
        result = builds.build(
            "v1", "--signing-key", str(secret / "kernelcache.key"),
            "--public-key", str(secret / "kernelcache.pub"),
        )  # fmt: skip
        target = tmp_path / f"pod-{len(list(tmp_path.glob('pod-*')))}"
        proc = builds.pod(
            target, "--public-key", str(secret / "kernelcache.pub"), "--require-signature"
        )
        assert proc.returncode == 0, proc.stderr
        return str(result["status"])

    assert step(old, old_pub) == "published"
    assert step(old, old_pub, new_pub) == "up-to-date"  # 1. trust both
    assert step(new, old_pub, new_pub) == "re-signed"  # 2. sign with the new key
    assert step(new, new_pub) == "up-to-date"  # 3. drop the old public key
    assert builds.compiles() == 1
    assert verify(builds.current(), public_key=new_pub, require_signature=True).ok
    assert not verify(builds.current(), public_key=old_pub, require_signature=True).ok


def test_build_statuses_are_exactly_the_schemas() -> None:
    """Derived from the code: the type of ``ArchResult.status`` (the only type a result's
    status may have, checked by mypy), against both schemas that print a result."""
    status_type = typing.get_type_hints(build.ArchResult)["status"]
    statuses = {s.value for s in status_type}
    assert {"published", "up-to-date", "re-pointed", "re-signed", "failed"} <= statuses
    import json

    build_schema = json.loads((SCHEMAS / "build.json").read_text())
    warm_schema = json.loads((SCHEMAS / "warm.json").read_text())
    # Each schema's first branch is the result; the other, the failure object (error.json).
    item = build_schema["oneOf"][0]["properties"]["results"]["items"]["properties"]
    assert set(item["status"]["enum"]) == statuses
    assert set(warm_schema["oneOf"][0]["properties"]["status"]["enum"]) == statuses


def test_a_re_pointed_build_prints_json_its_schema_accepts(builds: Builds) -> None:
    builds.build("v1")
    builds.build("v2")
    assert builds.build("v1")["status"] == "re-pointed"  # checked() validated it
    assert builds.compiles() == 2


# --------------------------------------------------------------------------- the target


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A signed generation (generations.KEY), its store root and public key."""
    priv, pub = keys(tmp_path / "keys")
    gen = generations.publish(tmp_path / "store", signing_key=priv)
    return tmp_path / "store", gen, pub


def pod_options(root: Path, pub: Path, target: Path) -> Options:
    return Options(
        store=root,
        key=generations.KEY,
        gpu_product=generations.PRODUCT,
        public_key=pub,
        require_signature=True,
        materialize=target,
    )


def evil_copy(directory: Path, gen: Path) -> None:
    """A directory that looks like a finished copy of gen, holding EVIL."""
    shutil.copytree(gen, directory)
    for path in (directory / "files").rglob("*"):
        if path.is_file():
            path.write_bytes(b"EVIL")
    (directory / ".complete").write_text(f"{gen.name}\n")


def test_a_generation_entry_symlinked_to_an_attackers_copy_is_refused(
    signed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    root, gen, pub = signed
    target = tmp_path / "pod"
    target.mkdir()
    evil_copy(tmp_path / "evil", gen)
    (target / gen.name).symlink_to(tmp_path / "evil")

    proc = run_kernelcache(
        "verify", "--store", str(root), "--key", generations.KEY, "--gpu-product",
        generations.PRODUCT, "--public-key", str(pub), "--require-signature",
        "--materialize", str(target),
    )  # fmt: skip

    assert proc.returncode == ExitCode.UNSAFE_PATH, proc.stderr
    assert f"{target / gen.name}: is a symlink" in one_line_error(proc)
    assert not (target / "kernelcache.env").exists()


def test_an_earlier_copy_in_the_target_is_never_reused(
    signed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """A tampered <generation>/ with its .complete marker: copied afresh over it."""
    root, gen, pub = signed
    target = tmp_path / "pod"
    target.mkdir()
    evil_copy(target / gen.name, gen)

    outcome = run(pod_options(root, pub, target), env={})

    assert outcome.materialized == target / gen.name
    for rel, data in {**generations.COMPILED, **generations.TUNING}.items():
        assert (target / gen.name / "files" / rel).read_bytes() == data
    assert verify(target / gen.name, public_key=pub, require_signature=True).ok


@pytest.mark.parametrize(
    "where",
    ["deep in an earlier copy", "a stray entry", "the target itself", "an untuned copy"],
)
def test_a_symlink_anywhere_under_the_target_is_refused(
    signed: tuple[Path, Path, Path], tmp_path: Path, where: str
) -> None:
    root, gen, pub = signed
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "pod"
    link = {
        "deep in an earlier copy": target / gen.name / "files" / "triton" / "k3x",
        "a stray entry": target / "lib",
        "the target itself": target,
        "an untuned copy": target / f"{gen.name}-untuned",
    }[where]
    if link != target:
        evil_copy(target / gen.name, gen)
        shutil.rmtree(link, ignore_errors=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside)

    with pytest.raises(UnsafePathError) as err:
        run(pod_options(root, pub, target), env={})

    assert str(err.value).startswith(f"{link}: is a symlink")
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("inside", ["the key directory", "the store root", "another store"])
def test_a_target_in_a_store_is_refused(
    signed: tuple[Path, Path, Path], tmp_path: Path, inside: str
) -> None:
    root, gen, pub = signed
    other = generations.publish(tmp_path / "other", "x/y/sm_90a").parent
    target = {
        "the key directory": gen.parent,
        "the store root": root / "serve",
        "another store": other / "serve",
    }[inside]
    with pytest.raises(UnsafePathError) as err:
        run(pod_options(root, pub, target), env={})
    assert "lies in a store" in str(err.value)
    assert verify(gen, public_key=pub, require_signature=True).ok  # untouched


# --------------------------------------------------------------------------- the race

SWAPPER = """
import os, sys
gen, a, b = sys.argv[1:4]
pairs = [(open(a + ".json", "rb").read(), open(a + ".sig", "rb").read()),
         (open(b + ".json", "rb").read(), open(b + ".sig", "rb").read())]
def put(name, data):
    tmp = os.path.join(gen, "." + name + ".swap")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(gen, name))
print("swapping", flush=True)
n = 0
while not os.path.exists(os.path.join(gen, "..", "stop")):
    manifest, sig = pairs[n % 2]
    put("MANIFEST.json", manifest)
    put("MANIFEST.json.sig", sig)
    n += 1
print(n, flush=True)
"""


def test_a_manifest_and_signature_swapped_during_verify_materialize_as_a_pair(
    tmp_path: Path,
) -> None:
    """Two signed manifests of one generation (the same files, another report), swapped
    in place without pause, file by file, while pods verify and materialize: every copy
    holds a manifest and signature that verify together, or the pod is refused."""
    priv, pub = keys(tmp_path / "keys")
    root = tmp_path / "store"
    gen = generations.publish(root, signing_key=priv)
    first = load_manifest(gen)
    second = dataclasses.replace(first, report={"warmers": [], "variant": 2})
    private = load_private_key(priv)
    for name, manifest in (("a", first), ("b", second)):
        data = manifest.to_bytes()
        (tmp_path / f"{name}.json").write_bytes(data)
        (tmp_path / f"{name}.sig").write_bytes(signature_bytes(private, data))
    swapper = subprocess.Popen(
        [sys.executable, "-c", SWAPPER, str(gen), str(tmp_path / "a"), str(tmp_path / "b")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert swapper.stdout is not None and swapper.stdout.readline() == "swapping\n"
    copies, refused = [], 0
    try:
        for n in range(40):
            try:
                outcome = run(pod_options(root, pub, tmp_path / f"pod{n}"), env={})
            except KernelCacheError:
                refused += 1
                continue
            assert outcome.materialized is not None
            copies.append(outcome.materialized)
    finally:
        (gen.parent / "stop").touch()
        swaps = int(swapper.stdout.read().strip())
        swapper.wait()
    for copy in copies:
        result = verify(copy, public_key=load_public_key(pub), require_signature=True)
        assert result.ok, f"{copy}: {result.problems[0].message}"
    variants = {(c / MANIFEST_NAME).read_bytes() for c in copies}
    assert swaps > 40 and len(copies) + refused == 40
    # The swap reached verify: a pair read mid-swap was refused, or both were materialized.
    assert refused or len(variants) == 2, (refused, len(variants))


def test_materialize_needs_a_result_that_verified(signed: tuple[Path, Path, Path]) -> None:
    _, gen, _ = signed
    (gen / "files" / "extra").write_bytes(b"unlisted")
    with pytest.raises(ValueError):
        materialize(verify(gen), gen.parent.parent / "elsewhere")
    os.unlink(gen / "files" / "extra")
