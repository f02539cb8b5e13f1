"""Generations as OCI artifacts, against a real registry (Debian's docker-registry, TLS with a
CA made here, htpasswd basic auth) and read back by an independent client (skopeo).

Push then pull is byte-identical; every way the artifact in the registry can differ from
what was pushed is refused with one line and its exit class, and leaves the target store as
it was: the blob, the manifest, the layers' order and content, the annotations, the
signature, and tar entries that are links or escape the generation.
"""

from __future__ import annotations

import filecmp
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernelcache import contract
from kernelcache.distribution import artifact, describe, push
from kernelcache.distribution.auth import Credentials
from kernelcache.distribution.reference import Reference
from kernelcache.distribution.registry import Client
from kernelcache.errors import ExitCode
from kernelcache.store import Store, generate_keypair, verify
from tests.conftest import checked, one_line_error, run_kernelcache, scaled, subprocess_env
from tests.helpers.generations import COMPILED, KEY, PRODUCT, TUNING, publish
from tests.helpers.registry import PASSWORD, USER, Registry, authfile, running_registry

TOOLCHAINS = ("cute-dsl", "triton", "flashinfer")


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("registry")) as running:
        yield running


@dataclass(frozen=True)
class Keys:
    private: Path
    public: Path
    foreign_private: Path
    foreign_public: Path


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    ours = generate_keypair(tmp_path_factory.mktemp("ours"))
    theirs = generate_keypair(tmp_path_factory.mktemp("theirs"))
    return Keys(*ours, *theirs)


def files_of(case: str) -> dict[str, bytes]:
    """A generation's files, each toolchain's subtree made unique to ``case``: the layers a
    test damages in the registry are its own (the registry shares equal blobs)."""
    unique = {f"{tc}/case-{case}.txt": case.encode() for tc in TOOLCHAINS}
    long_name = f"flashinfer/aot/{'fused_moe_' * 12}/{case}.so"  # past ustar's 100: PAX
    return {**COMPILED, **TUNING, **unique, long_name: b"\x7fELF" + case.encode() * 100}


def registry_flags(registry: Registry) -> list[str]:
    return ["--authfile", str(registry.authfile), "--ca-file", str(registry.ca_file)]


def pull_cli(registry: Registry, ref: str, store: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_kernelcache("pull", ref, "--store", str(store), *registry_flags(registry), *extra)


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------- the round trip


def test_push_then_pull_is_byte_identical_and_skopeo_reads_the_artifact(
    registry: Registry, keys: Keys, tmp_path: Path
) -> None:
    source = publish(tmp_path / "a", files=files_of("round-trip"), signing_key=keys.private)
    repo = registry.repo("kc/round-trip")
    pushed = run_kernelcache(
        "push", "--store", str(tmp_path / "a"), "--key", KEY, repo,
        "--signing-key", str(keys.private), *registry_flags(registry), "--json",
    )  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    result = checked("push", pushed.stdout)
    ref = result["ref_digest"]
    assert ref == f"{repo}@{result['digest']}" and result["signed"] is True
    assert result["generation"] == source.name and result["tag"] == source.name
    assert result["layers"] == 1 + len(TOOLCHAINS)

    # skopeo, another client, reads it: the manifest's bytes hash to the digest pushed, it is
    # an image (config and tar layers), annotated with the key, the generation, the stamp.
    raw = registry.skopeo("inspect", "--raw", f"docker://{ref}")
    assert raw.returncode == 0, raw.stderr
    assert artifact.digest_of(raw.stdout.encode()) == result["digest"]
    image = json.loads(raw.stdout)
    assert image["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert image["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert {layer["mediaType"] for layer in image["layers"]} == {
        "application/vnd.oci.image.layer.v1.tar"
    }
    assert [layer["annotations"][contract.OCI_ANNOTATION_LAYER] for layer in image["layers"]] == [
        "MANIFEST.json", "files/cute-dsl", "files/flashinfer", "files/triton",
    ]  # fmt: skip
    assert image["annotations"][contract.OCI_ANNOTATION_KEY] == KEY
    assert image["annotations"][contract.OCI_ANNOTATION_GENERATION] == source.name
    inspected = registry.skopeo("inspect", f"docker://{ref}")
    assert inspected.returncode == 0, inspected.stderr
    info = json.loads(inspected.stdout)
    assert info["Digest"] == result["digest"] and info["Os"] == "linux"
    assert artifact.signature_tag(result["digest"]) in info["RepoTags"]
    described = describe(
        ref, auth=registry.authfile, ca_file=registry.ca_file, public_key=keys.public
    )  # what a consumer records before it mounts or pulls: no layer fetched
    assert (described.key, described.generation) == (KEY, source.name)
    assert described.stamp == json.loads((source / "MANIFEST.json").read_text())["stamp"]["digest"]
    copied = tmp_path / "skopeo-dir"
    copy = registry.skopeo("copy", f"docker://{ref}", f"dir:{copied}")
    assert copy.returncode == 0, copy.stderr  # skopeo checked every blob's digest

    pulled = pull_cli(
        registry, ref, tmp_path / "b", "--public-key", str(keys.public), "--require-signature",
        "--json",
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    got = checked("pull", pulled.stdout)
    assert got["key"] == KEY and got["generation"] == source.name and got["signature_verified"]
    target = Path(got["gen_dir"])
    assert Store(tmp_path / "b").current(KEY) == target
    assert tree(target) == tree(source)  # MANIFEST.json, its signature, every file
    comparison = filecmp.dircmp(source, target)
    assert not comparison.diff_files and not comparison.left_only and not comparison.right_only
    verified = run_kernelcache(
        "verify", "--store", str(tmp_path / "b"), "--key", KEY, "--arch", "sm_90a",
        "--public-key", str(keys.public), "--require-signature", "--gpu-product", PRODUCT,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr

    # Pulled again: the store's CURRENT generation is the artifact's and verifies, so no
    # layer is fetched and the generation stays the very directory it was.
    inode = target.stat().st_ino
    for layer in image["layers"]:  # what a fetch would now refuse
        flip_byte(registry.blob_file(layer["digest"]), 600)
    again_pulled = pull_cli(registry, ref, tmp_path / "b", "--public-key", str(keys.public))
    assert again_pulled.returncode == 0, again_pulled.stderr
    assert Store(tmp_path / "b").current(KEY) == target and target.stat().st_ino == inode
    for layer in image["layers"]:
        flip_byte(registry.blob_file(layer["digest"]), 600)  # restored

    # The same generation pushed again is the same artifact, and nothing is uploaded again.
    again = push(
        tmp_path / "a", KEY, repo, auth=registry.authfile, ca_file=registry.ca_file,
        signing_key=keys.private,
    )  # fmt: skip
    assert again.digest == result["digest"] and again.uploaded == 0


def test_gzip_layers_round_trip(registry: Registry, keys: Keys, tmp_path: Path) -> None:
    source = publish(tmp_path / "a", files=files_of("gzip"))
    pushed = push(
        tmp_path / "a", KEY, registry.repo("kc/gzip"), auth=registry.authfile,
        ca_file=registry.ca_file, gzip=True,
    )  # fmt: skip
    raw = registry.skopeo("inspect", "--raw", f"docker://{pushed.ref_digest}")
    assert {layer["mediaType"] for layer in json.loads(raw.stdout)["layers"]} == {
        "application/vnd.oci.image.layer.v1.tar+gzip"
    }
    pulled = pull_cli(registry, pushed.ref_digest, tmp_path / "b")
    assert pulled.returncode == 0, pulled.stderr
    assert tree(Store(tmp_path / "b").current(KEY)) == tree(source)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- refusals


@dataclass
class Pushed:
    ref: Reference
    digest: str
    image: dict
    config: dict
    client: Client
    registry: Registry

    def blob(self, index: int) -> Path:
        return self.registry.blob_file(self.image["layers"][index]["digest"])

    def republish(self, tag: str, image: dict | None = None, config: dict | None = None) -> str:
        """Upload a changed manifest (and config) under ``tag``; the reference to pull."""
        image = json.loads(json.dumps(image or self.image))
        if config is not None:
            data = artifact.canonical_json(config)
            upload_bytes(self.client, data)
            image["config"]["digest"], image["config"]["size"] = artifact.digest_of(data), len(data)
        data = artifact.canonical_json(image)
        self.client.put_manifest(tag, data, artifact.MANIFEST_MEDIA_TYPE)
        return self.ref.with_digest(artifact.digest_of(data))


def upload_bytes(client: Client, data: bytes) -> dict:
    with tempfile.TemporaryDirectory() as tmp:  # its own: another test process may upload it too
        path = Path(tmp) / "blob"
        path.write_bytes(data)
        client.upload_blob(path, artifact.digest_of(data), len(data))
    return {"digest": artifact.digest_of(data), "size": len(data)}


def replace_layer(pushed: Pushed, index: int, tar_bytes: bytes, tag: str) -> str:
    """The artifact with layer ``index`` replaced by these tar bytes (its diff id too)."""
    blob = upload_bytes(pushed.client, tar_bytes)
    image = json.loads(json.dumps(pushed.image))
    image["layers"][index].update(blob)
    config = json.loads(json.dumps(pushed.config))
    config["rootfs"]["diff_ids"][index] = blob["digest"]
    return pushed.republish(tag, image, config)


def tar_of(*entries: tuple[tarfile.TarInfo, bytes], form: int = tarfile.PAX_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=form) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out.getvalue()


def entry(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname, info.mode = kind, len(data), link, 0o644
    return info, data


def triton_layer(
    pushed: Pushed, *extra: tuple[tarfile.TarInfo, bytes], form: int = tarfile.PAX_FORMAT
) -> bytes:
    """The triton layer as pushed, with ``extra`` entries appended (long names written as
    ``form`` writes them: PAX records, or GNU long-name entries)."""
    index = next(
        i for i, layer in enumerate(pushed.image["layers"])
        if layer["annotations"][contract.OCI_ANNOTATION_LAYER] == "files/triton"
    )  # fmt: skip
    original = pushed.blob(index).read_bytes()
    with tarfile.open(fileobj=io.BytesIO(original)) as tar:
        kept = [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar]  # type: ignore[union-attr]
    return tar_of(*kept, *extra, form=form)


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def layer_index(pushed: Pushed, subtree: str) -> int:
    return next(
        i for i, layer in enumerate(pushed.image["layers"])
        if layer["annotations"][contract.OCI_ANNOTATION_LAYER] == subtree
    )  # fmt: skip


def _flipped_blob(p: Pushed) -> str:
    flip_byte(p.blob(layer_index(p, "files/triton")), 2000)  # inside a file's content
    return p.ref.with_digest(p.digest)


def _truncated_blob(p: Pushed) -> str:
    path = p.blob(layer_index(p, "files/cute-dsl"))
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:3000])
    return p.ref.with_digest(p.digest)


def _lengthened_blob(p: Pushed) -> str:
    path = p.blob(layer_index(p, "files/cute-dsl"))
    path.chmod(0o644)
    path.write_bytes(path.read_bytes() + bytes(4096))
    return p.ref.with_digest(p.digest)


def _swapped_layers(p: Pushed) -> str:
    image, config = json.loads(json.dumps(p.image)), json.loads(json.dumps(p.config))
    a, b = layer_index(p, "files/cute-dsl"), layer_index(p, "files/triton")
    for key in ("digest", "size"):  # contents exchanged, the subtrees they claim kept
        image["layers"][a][key], image["layers"][b][key] = (
            image["layers"][b][key], image["layers"][a][key],
        )  # fmt: skip
    ids = config["rootfs"]["diff_ids"]
    ids[a], ids[b] = ids[b], ids[a]
    return p.republish("swapped", image, config)


def _manifest_bytes_altered(p: Pushed) -> str:
    stored = p.registry.blob_file(p.digest)
    text = stored.read_bytes()
    stored.chmod(0o644)
    stored.write_bytes(text.replace(b'"schemaVersion":2', b'"schemaVersion":2 '))
    return p.ref.with_digest(p.digest)


def _annotation_lies(name: str, value: str | None) -> Callable[[Pushed], str]:
    """The manifest with one annotation changed (None: removed)."""

    def tamper(p: Pushed) -> str:
        image = json.loads(json.dumps(p.image))
        image["annotations"][name] = value
        if value is None:
            del image["annotations"][name]
        return p.republish("lying", image)

    return tamper


def _layer_with(
    *extra: tuple[tarfile.TarInfo, bytes], form: int = tarfile.PAX_FORMAT
) -> Callable[[Pushed], str]:
    def tamper(p: Pushed) -> str:
        layer = triton_layer(p, *extra, form=form)
        return replace_layer(p, layer_index(p, "files/triton"), layer, "bad")

    return tamper


def _foreign_signature(p: Pushed) -> str:
    return p.ref.with_digest(p.digest)  # pushed with the foreign key: see `signer` below


def _signature_of_another_artifact(p: Pushed) -> str:
    """The signature image of one artifact put under another's signature tag (a replay)."""
    other = _annotation_lies("org.example.note", "another artifact")(p)  # unsigned, same key
    data, _ = p.client.get_manifest(
        artifact.signature_tag(p.digest), (artifact.MANIFEST_MEDIA_TYPE,)
    )
    other_digest = other.rpartition("@")[2]
    p.client.put_manifest(artifact.signature_tag(other_digest), data, artifact.MANIFEST_MEDIA_TYPE)
    return other


@dataclass(frozen=True)
class Case:
    tamper: Callable[[Pushed], str]
    code: ExitCode
    says: str
    signer: str = "ours"  # who signs the pushed artifact: "ours", "foreign", None
    verify_signature: bool = False  # pull with --public-key --require-signature


CASES = {
    "flipped byte in a blob": Case(_flipped_blob, ExitCode.INTEGRITY, "layer 3 (files/triton"),
    "truncated blob": Case(_truncated_blob, ExitCode.INTEGRITY, "truncated"),
    "lengthened blob": Case(
        _lengthened_blob, ExitCode.INTEGRITY, "longer than its descriptor says"
    ),
    "swapped layers": Case(_swapped_layers, ExitCode.INTEGRITY, "lies outside files/"),
    "swapped layers, signed pull": Case(
        _swapped_layers, ExitCode.SIGNATURE, "unsigned", verify_signature=True
    ),
    "foreign-signed artifact": Case(
        _foreign_signature, ExitCode.SIGNATURE, "not by this public key", "foreign", True
    ),
    "unsigned artifact, signature required": Case(
        _foreign_signature, ExitCode.SIGNATURE, "unsigned", None, True
    ),
    "signature of another artifact": Case(
        _signature_of_another_artifact, ExitCode.SIGNATURE, "signs another artifact", "ours", True
    ),
    "manifest bytes altered in the registry": Case(
        _manifest_bytes_altered, ExitCode.INTEGRITY, "manifest digest mismatch"
    ),
    "annotation lies about the key": Case(
        _annotation_lies(contract.OCI_ANNOTATION_KEY, "ns/other/sm_90a"),
        ExitCode.INTEGRITY,
        f"annotation {contract.OCI_ANNOTATION_KEY} says ns/other/sm_90a",
    ),
    "annotation lies about the generation": Case(
        _annotation_lies(contract.OCI_ANNOTATION_GENERATION, "0" * 32),
        ExitCode.INTEGRITY,
        f"annotation {contract.OCI_ANNOTATION_GENERATION} says {'0' * 32}",
    ),
    "an image without the key annotation": Case(
        _annotation_lies(contract.OCI_ANNOTATION_KEY, None),
        ExitCode.MALFORMED_MANIFEST,
        f"annotation {contract.OCI_ANNOTATION_KEY}: missing (not a kernelcache generation)",
    ),
    "path escaping the generation": Case(
        _layer_with(entry("files/triton/../../../../escaped", b"x")),
        ExitCode.UNSAFE_PATH,
        "'..' segment",
    ),
    "path escaping through a GNU long name": Case(
        _layer_with(
            entry("files/triton/" + "d/" * 60 + "../" * 70 + "escaped", b"x"),
            form=tarfile.GNU_FORMAT,
        ),
        ExitCode.UNSAFE_PATH,
        "'..' segment",
    ),
    "symlink in a layer": Case(
        _layer_with(entry("files/triton/passwd", kind=tarfile.SYMTYPE, link="/etc/passwd")),
        ExitCode.UNSAFE_PATH,
        "is a symlink (to '/etc/passwd')",
    ),
    "hard link in a layer": Case(
        _layer_with(entry("files/triton/shared", kind=tarfile.LNKTYPE, link="files/triton/k3x")),
        ExitCode.UNSAFE_PATH,
        "is a hard link",
    ),
    "file not in MANIFEST.json": Case(
        _layer_with(entry("files/triton/extra.so", b"\x7fELF")),
        ExitCode.INTEGRITY,
        "files/triton/extra.so: not in MANIFEST.json",
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_tampered_artifact_is_refused_and_the_store_left_as_it_was(
    registry: Registry, keys: Keys, tmp_path: Path, case: str
) -> None:
    spec = CASES[case]
    slug = case.replace(" ", "-").replace(",", "").replace(".", "-").lower()
    publish(tmp_path / "source", files=files_of(slug))
    signer = {"ours": keys.private, "foreign": keys.foreign_private, None: None}[spec.signer]
    pushed = push(
        tmp_path / "source", KEY, registry.repo(f"kc/{slug}"), auth=registry.authfile,
        ca_file=registry.ca_file, signing_key=signer,
    )  # fmt: skip
    ref = Reference.parse(pushed.ref_digest)
    client = Client(ref, Credentials(USER, PASSWORD), registry.ca_file)
    image_bytes, _ = client.get_manifest(pushed.digest, (artifact.MANIFEST_MEDIA_TYPE,))
    image = json.loads(image_bytes)
    config = json.loads(registry.blob_file(image["config"]["digest"]).read_bytes())
    target_ref = spec.tamper(Pushed(ref, pushed.digest, image, config, client, registry))

    # The target store serves an older generation of the same key; it must go on doing so.
    old = publish(tmp_path / "target", files={"triton/old.cubin": b"old"}, signing_key=keys.private)
    key_dir = old.parent
    before = sorted(os.listdir(key_dir))
    flags = (
        ["--public-key", str(keys.public), "--require-signature"] if spec.verify_signature else []
    )
    refused = pull_cli(registry, target_ref, tmp_path / "target", *flags)

    assert refused.returncode == spec.code, refused.stderr
    line = one_line_error(refused)
    assert spec.says in line, line
    assert Store(tmp_path / "target").current(KEY) == old
    assert sorted(os.listdir(key_dir)) == before  # no staging left, nothing new published
    assert verify(old, key=KEY, public_key=keys.public).ok
    assert not (tmp_path / "target" / "ns" / "other").exists()  # a lying key made nothing


def test_pull_refuses_an_artifact_of_another_key_than_asked(
    registry: Registry, pushed_once: str, tmp_path: Path
) -> None:
    refused = pull_cli(registry, pushed_once, tmp_path / "s", "--key", "ns/other/sm_90a")
    assert refused.returncode == ExitCode.INTEGRITY
    assert f"an artifact of key {KEY}, not of ns/other/sm_90a" in one_line_error(refused)
    assert not (tmp_path / "s").exists()


def test_pull_takes_a_digest_not_a_tag(registry: Registry, tmp_path: Path) -> None:
    refused = pull_cli(registry, registry.repo("kc/round-trip:latest"), tmp_path / "s")
    assert refused.returncode == ExitCode.USAGE
    assert "not a tag" in one_line_error(refused)
    assert not (tmp_path / "s").exists()


def test_a_signature_required_without_a_key_is_refused(registry: Registry, tmp_path: Path) -> None:
    ref = registry.repo("kc/x") + "@sha256:" + "0" * 64
    refused = pull_cli(registry, ref, tmp_path / "s", "--require-signature")
    assert refused.returncode == ExitCode.SIGNATURE
    assert "no public key" in one_line_error(refused)


# --------------------------------------------------------------------------- auth and TLS


@pytest.fixture(scope="module")
def pushed_once(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("auth-source")
    publish(root, files=files_of("auth"))
    return push(
        root, KEY, registry.repo("kc/auth"), auth=registry.authfile, ca_file=registry.ca_file
    ).ref_digest


def test_credentials_from_a_pull_secret_or_docker_config(
    registry: Registry, pushed_once: str, tmp_path: Path
) -> None:
    # A Kubernetes pull secret's .dockerconfigjson, as the kubelet reads it (username/password).
    secret = tmp_path / ".dockerconfigjson"
    secret.write_text(json.dumps({"auths": {f"https://{registry.host}/v1/": {
        "username": USER, "password": PASSWORD}}}))  # fmt: skip
    from_secret = run_kernelcache(
        "pull", pushed_once, "--store", str(tmp_path / "a"), "--authfile", str(secret),
        "--ca-file", str(registry.ca_file),
    )  # fmt: skip
    assert from_secret.returncode == 0, from_secret.stderr
    # DOCKER_CONFIG, as docker and skopeo read it.
    config_dir = tmp_path / "docker"
    config_dir.mkdir()
    authfile(config_dir / "config.json", registry.host)
    from_env = run_kernelcache(
        "pull", pushed_once, "--store", str(tmp_path / "b"), "--ca-file", str(registry.ca_file),
        DOCKER_CONFIG=str(config_dir),
    )  # fmt: skip
    assert from_env.returncode == 0, from_env.stderr


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--authfile", "WRONG", "--ca-file", "CA"], "refused the credentials (HTTP 401)"),
        (["--authfile", "OTHER", "--ca-file", "CA"], "none were given (no entry for"),
        (["--authfile", "RIGHT"], "TLS refused"),
    ],
    ids=["wrong password", "no credentials for this registry", "CA not trusted"],
)
def test_registry_access_failures_are_one_io_line(
    registry: Registry, pushed_once: str, tmp_path: Path, flags: list[str], says: str
) -> None:
    files = {
        "WRONG": authfile(tmp_path / "wrong.json", registry.host, password="nope"),
        "OTHER": authfile(tmp_path / "other.json", "registry.example:5000"),
        "RIGHT": registry.authfile,
        "CA": registry.ca_file,
    }
    args = [str(files.get(flag, flag)) for flag in flags]
    refused = run_kernelcache(
        "pull", pushed_once, "--store", str(tmp_path / "s"), *args, DOCKER_CONFIG=str(tmp_path)
    )
    assert refused.returncode == ExitCode.IO, refused.stderr
    assert says in one_line_error(refused)
    if "OTHER" in flags:  # the file it looked in, named: in a pod, the mounted pull secret
        assert f"no entry for {registry.host} in {files['OTHER']})" in one_line_error(refused)


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("token-registry"), token_auth=True) as running:
        yield running


def test_token_auth_push_and_pull_through_the_realm(
    token_registry: Registry, tmp_path: Path
) -> None:
    """A registry with ``auth: token`` (Docker Hub's scheme, Harbor's, GitLab's): push with a
    pull secret, pull with a docker config, each through the token service's realm; a pull
    (scope ``pull``) then a push (``pull,push``) in one client; a wrong password is one line."""
    registry, tokens = token_registry, token_registry.tokens
    assert tokens is not None
    secret = tmp_path / ".dockerconfigjson"
    secret.write_text(json.dumps({"auths": {registry.host: {
        "username": USER, "password": PASSWORD}}}))  # fmt: skip
    publish(tmp_path / "source", files=files_of("token"))
    pushed = push(
        tmp_path / "source", KEY, registry.repo("kc/token"), auth=secret,
        ca_file=registry.ca_file,
    )  # fmt: skip
    assert f"{USER} repository:kc/token:pull,push" in tokens.granted

    config_dir = tmp_path / "docker"
    config_dir.mkdir()
    authfile(config_dir / "config.json", registry.host)
    pulled = run_kernelcache(
        "pull", pushed.ref_digest, "--store", str(tmp_path / "target"),
        "--ca-file", str(registry.ca_file), DOCKER_CONFIG=str(config_dir),
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    assert f"{USER} repository:kc/token:pull" in tokens.granted
    source, target = Store(tmp_path / "source"), Store(tmp_path / "target")
    assert tree(target.current(KEY) / "files") == tree(source.current(KEY) / "files")

    # One client that reads first (a token for ``pull``) and then writes: the registry
    # asks for ``pull,push``, and the narrower token must not be offered again and again.
    client = Client(Reference.parse(registry.repo("kc/token")), Credentials(USER, PASSWORD),
                    registry.ca_file)  # fmt: skip
    assert client.has_blob(pushed.digest) is False  # a manifest is not a blob: read only
    blob = tmp_path / "blob"
    blob.write_bytes(b"written after a read")
    client.upload_blob(blob, artifact.digest_of(blob.read_bytes()), blob.stat().st_size)
    assert client.has_blob(artifact.digest_of(blob.read_bytes()))

    wrong = authfile(tmp_path / "wrong.json", registry.host, password="nope")
    refused = run_kernelcache(
        "pull", pushed.ref_digest, "--store", str(tmp_path / "other"), "--authfile", str(wrong),
        "--ca-file", str(registry.ca_file),
    )  # fmt: skip
    assert refused.returncode == ExitCode.IO, refused.stderr
    assert "token service" in one_line_error(refused) and "refused" in one_line_error(refused)
    assert not (tmp_path / "other").exists() or Store(tmp_path / "other").current(KEY) is None


# --------------------------------------------------------------------------- a crash


CRASHING_PULL = """
import os, sys
from kernelcache.distribution import oci
from kernelcache.cli import main

written = []
original = oci._FileWriter.__call__

def crash_after_one(self, member, content):
    original(self, member, content)
    if content is not None:
        written.append(member.name)
        if len(written) == 2:
            os._exit(137)  # as SIGKILL would: no cleanup, no finally

oci._FileWriter.__call__ = crash_after_one
sys.exit(main(sys.argv[1:]))
"""


def test_a_pull_killed_midway_leaves_the_store_as_it_was(
    registry: Registry, pushed_once: str, keys: Keys, tmp_path: Path
) -> None:
    old = publish(tmp_path / "target", files={"triton/old.cubin": b"old"})
    args = ["pull", pushed_once, "--store", str(tmp_path / "target"), *registry_flags(registry)]
    crashed = subprocess.run(
        [sys.executable, "-c", CRASHING_PULL, *args], env=subprocess_env(), capture_output=True,
        text=True, timeout=scaled(300),
    )  # fmt: skip
    assert crashed.returncode == 137, crashed.stderr
    store = Store(tmp_path / "target")
    assert store.current(KEY) == old and verify(old, key=KEY).ok
    leftovers = [n for n in os.listdir(old.parent) if n.startswith(".staging-")]
    assert leftovers  # the crash was mid-way: a partial staging, under a name no reader reads

    again = run_kernelcache(*args)
    assert again.returncode == 0, again.stderr
    current = store.current(KEY)
    assert current is not None and current != old and verify(current, key=KEY).ok
    assert not [n for n in os.listdir(old.parent) if n.startswith(".staging-")]


# --------------------------------------------------------------------------- the store's side


def test_adopt_refuses_a_generation_of_another_key_and_keeps_current(
    keys: Keys, tmp_path: Path
) -> None:
    """``Writer.adopt`` publishes a generation made elsewhere only whole and only for its
    key, whatever its caller checked before."""
    import shutil

    from kernelcache.errors import IntegrityError

    foreign = publish(tmp_path / "a", key="ns/other/sm_90a", files=files_of("adopt"))
    old = publish(tmp_path / "b", files={"triton/old.cubin": b"old"})
    store = Store(tmp_path / "b")
    with store.writer(KEY) as writer:
        staging = writer.staging().parent
        shutil.rmtree(staging)
        shutil.copytree(foreign, staging)
        with pytest.raises(IntegrityError, match="published for key ns/other/sm_90a"):
            writer.adopt(staging)
    assert store.current(KEY) == old
    assert not [n for n in os.listdir(old.parent) if n.startswith(".staging-")]
    assert sorted(os.listdir(old.parent)) == sorted([old.name, "CURRENT", ".lock"])
