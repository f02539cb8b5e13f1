"""The paths a rollout walks over the network, against a real registry behind a proxy that
fails as networks do: a registry that accepts and never speaks TLS, one silent before its
response headers, a blob that stops halfway (once: resumed; for good: one line), a redirect
from https to plain http, a token that expires during a pull, a local registry that speaks
plain HTTP.

Every failure is asserted as a user sees it: the exit code, the one line naming the registry
and the step, within the deadlines (scaled to the machine), the store as it was, and for
``verify --pull`` and ``prefetch`` the termination message, which the operator reports as
the node's status.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelcache import contract
from kernelcache.distribution import oci, push
from kernelcache.distribution.transport import Network
from kernelcache.errors import ExitCode
from kernelcache.store import Store, verify
from kernelcache.store.prefetched import find
from tests.conftest import one_line_error, run_kernelcache, scaled
from tests.helpers.faulty_proxy import Fault, Proxy, running_proxy, silent_listener
from tests.helpers.generations import ARCH, KEY, NAME, NS, publish
from tests.helpers.registry import Registry, authfile, running_registry

# The deadlines every command below runs with: small, scaled to the machine.
CONNECT_S, READ_S, TRIES = scaled(1.0), scaled(1.5), 2
NETWORK = {
    contract.REGISTRY_CONNECT_S.name: str(CONNECT_S),
    contract.REGISTRY_READ_S.name: str(READ_S),
    contract.REGISTRY_TRIES.name: str(TRIES),
}
# What a failing command may take at most: every try of every step it reaches, and start-up.
BOUND_S = scaled(30.0)
FILES = {"triton/k.cubin": os.urandom(300_000), "cute-dsl/k.o": b"\x7fELF" * 1000}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("registry")) as running:
        yield running


@pytest.fixture(scope="module")
def pushed(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The digest (repository kc/net) of a generation pushed straight to the registry."""
    source = tmp_path_factory.mktemp("source")
    publish(source, files=FILES)
    return push(
        source, KEY, registry.repo("kc/net"), auth=registry.authfile, ca_file=registry.ca_file
    ).digest


def largest_layer(registry: Registry, digest: str) -> str:
    """The digest of the artifact's largest layer (the one a fault breaks halfway)."""
    image = json.loads(registry.blob_file(digest).read_bytes())
    return str(max(image["layers"], key=lambda layer: layer["size"])["digest"])


def via(host: str, digest: str) -> str:
    return f"{host}/kc/net@{digest}"


def flags(registry: Registry, host: str, folder: Path) -> list[str]:
    """Credentials for ``host`` (the proxy) and the registry's CA."""
    auth = authfile(folder / f"auth-{host.replace(':', '-')}.json", host)
    return ["--authfile", str(auth), "--ca-file", str(registry.ca_file)]


def timed(*args: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = run_kernelcache(*args, **NETWORK, **env)
    return done, time.monotonic() - started


def assert_failed_within(done: subprocess.CompletedProcess, seconds: float, *says: str) -> str:
    assert done.returncode == ExitCode.IO, done.stderr
    line = one_line_error(done)
    assert all(part in line for part in says), line
    assert seconds < BOUND_S, f"took {seconds:.1f} s: {line}"
    return line


# --------------------------------------------------------------------------- silence


def test_a_registry_that_accepts_and_never_speaks_tls_fails_in_one_line(
    pushed: str, tmp_path: Path
) -> None:
    with silent_listener() as host:
        done, took = timed("pull", via(host, pushed), "--store", str(tmp_path / "s"))
    assert_failed_within(
        done, took, host, "GET /v2/", f"no TLS handshake within {CONNECT_S:g} s", f"{TRIES} tries"
    )
    assert not (tmp_path / "s").exists() or Store(tmp_path / "s").current(KEY) is None


def pull_via_proxy(
    registry: Registry, pushed: str, tmp_path: Path, *faults: Fault
) -> tuple[subprocess.CompletedProcess, float, Proxy]:
    """``kernelcache pull`` of ``pushed`` through a proxy that plays ``faults``: what it did,
    how long it took, and the proxy (the requests it saw)."""
    with running_proxy(registry, *faults) as proxy:
        done, took = timed(
            "pull", via(proxy.host, pushed), "--store", str(tmp_path / "s"),
            *flags(registry, proxy.host, tmp_path),
        )  # fmt: skip
    return done, took, proxy


def test_a_registry_silent_before_its_response_headers_fails_naming_the_step(
    registry: Registry, pushed: str, tmp_path: Path
) -> None:
    fault = Fault("/manifests/", "silent-headers")
    done, took, proxy = pull_via_proxy(registry, pushed, tmp_path, fault)
    assert_failed_within(
        done, took, proxy.host, f"GET /v2/kc/net/manifests/{pushed}",
        f"no response within {READ_S:g} s",
    )  # fmt: skip
    assert len(fault.hits) == TRIES  # retried, and bounded


def test_a_blob_that_goes_silent_halfway_for_good_leaves_the_store_as_it_was(
    registry: Registry, pushed: str, tmp_path: Path
) -> None:
    old = publish(tmp_path / "s", files={"triton/old.cubin": b"old"})
    fault = Fault(largest_layer(registry, pushed), "silent-mid-blob", after_bytes=100_000)
    done, took, proxy = pull_via_proxy(registry, pushed, tmp_path, fault)
    line = assert_failed_within(done, took, "layer", f"silent for {READ_S:g} s at byte")
    assert line.startswith(f"kernelcache: error: {proxy.host}/kc/net@{pushed}"), line
    assert Store(tmp_path / "s").current(KEY) == old
    assert sorted(p.name for p in old.parent.iterdir() if p.name.startswith(".staging")) == []


def test_a_blob_that_goes_silent_once_is_resumed_where_it_stopped(
    registry: Registry, pushed: str, tmp_path: Path
) -> None:
    layer = largest_layer(registry, pushed)
    fault = Fault(layer, "silent-mid-blob", after_bytes=100_000, times=1)
    done, _, proxy = pull_via_proxy(registry, pushed, tmp_path, fault)
    resumed = [r for r in proxy.requests if "/blobs/" in r]
    assert done.returncode == 0, done.stderr
    assert verify(Store(tmp_path / "s").current(KEY), key=KEY).ok
    assert [r for r in resumed if layer in r] == [f"GET /v2/kc/net/blobs/{layer}"] * 2
    assert fault.hits == [f"GET /v2/kc/net/blobs/{layer} "]  # then resumed with a Range


def test_a_blob_redirected_from_https_to_plain_http_is_refused(
    registry: Registry, pushed: str, tmp_path: Path
) -> None:
    fault = Fault("/blobs/", "redirect-to-http")
    done, took, proxy = pull_via_proxy(registry, pushed, tmp_path, fault)
    assert_failed_within(done, took, proxy.host, "redirected from https to http", "refused")
    assert not any(r.startswith("GET") for r in proxy.requests if "http://" in r)
    assert not (tmp_path / "s").exists() or Store(tmp_path / "s").current(KEY) is None


def test_a_blob_trickling_512_bytes_every_5_s_fails_below_the_floor_rate(
    registry: Registry, pushed: str, tmp_path: Path
) -> None:
    """512 bytes every 5 s, with a read deadline longer than 5 s: no read ever times out
    (the pull hung with no output); the floor rate cuts it, each try, in one line."""
    old = publish(tmp_path / "s", files={"triton/old.cubin": b"old"})
    fault = Fault(largest_layer(registry, pushed), "trickle", after_bytes=100_000)
    read_s = max(6.0, READ_S)
    network = {**NETWORK, contract.REGISTRY_READ_S.name: str(read_s)}
    with running_proxy(registry, fault) as proxy:
        started = time.monotonic()
        done = run_kernelcache(
            "pull", via(proxy.host, pushed), "--store", str(tmp_path / "s"),
            *flags(registry, proxy.host, tmp_path), **network,
        )  # fmt: skip
        took = time.monotonic() - started
    floor = contract.REGISTRY_MIN_BYTES_S.default
    line = assert_failed_within(done, took, "layer", f"slower than {floor} bytes/s")
    assert f"{TRIES} tries" in line and "silent" not in line, line
    assert len(fault.hits) == TRIES  # resumed where it stopped, then given up
    assert Store(tmp_path / "s").current(KEY) == old


def test_a_manifest_trickling_fails_below_the_floor_rate(
    registry: Registry, pushed: str, tmp_path: Path
) -> None:
    fault = Fault("/manifests/", "trickle", after_bytes=10, trickle=8, every_s=0.5)
    done, took, proxy = pull_via_proxy(registry, pushed, tmp_path, fault)
    assert_failed_within(
        done, took, proxy.host, f"GET /v2/kc/net/manifests/{pushed}", "the answer came slower than"
    )


# --------------------------------------------------------------------------- where users see it


def test_verify_pull_against_a_silent_registry_fails_the_pod_in_one_line(
    registry: Registry, pushed: str, tmp_path: Path
) -> None:
    log = tmp_path / "termination-log"
    with running_proxy(registry, Fault("/blobs/", "silent-headers")) as proxy:
        done, took = timed(
            "verify", "--namespace", NS, "--name", NAME, "--arch", ARCH,
            "--pull", f"{ARCH}={via(proxy.host, pushed)}", "--materialize", str(tmp_path / "pod"),
            "--termination-log", str(log), *flags(registry, proxy.host, tmp_path),
        )  # fmt: skip
    line = assert_failed_within(done, took, proxy.host, "no answer")
    assert log.read_text().strip() == line
    assert not (tmp_path / "pod" / "kernelcache.env").exists()


def test_prefetch_against_a_silent_registry_fails_and_its_line_is_the_node_status(
    registry: Registry, pushed: str, tmp_path: Path
) -> None:
    log, root = tmp_path / "termination-log", tmp_path / "node"
    with running_proxy(registry, Fault("/manifests/", "silent-headers")) as proxy:
        ref = via(proxy.host, pushed)
        done, took = timed(
            "prefetch", "--root", str(root), "--key", KEY, "--want", ref, "--limit", "1000000000",
            "--termination-log", str(log), *flags(registry, proxy.host, tmp_path),
        )  # fmt: skip
    line = assert_failed_within(done, took, proxy.host, "no answer")
    assert log.read_text().strip() == line
    assert find(root, KEY, ref) is None


# --------------------------------------------------------------------------- tokens


def test_a_token_that_expires_during_a_pull_is_renewed_and_the_pull_completes(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """distribution allows a minute of clock skew past a token's ``exp``: tokens issued
    61 s "old" expire 1 s... after they are issued. The pull waits past that before its
    file layers, whose first GET gets 401 and a new token, and completes."""
    with running_registry(tmp_path_factory.mktemp("token"), token_auth=True) as registry:
        tokens = registry.tokens
        assert tokens is not None
        publish(tmp_path / "source", files=FILES)
        pushed = push(
            tmp_path / "source", KEY, registry.repo("kc/expiry"), auth=registry.authfile,
            ca_file=registry.ca_file,
        )  # fmt: skip
        tokens.lifetime = -58  # valid for about 2 s after it is issued
        fetch, waited = oci._fetch_layer, []

        def fetch_late(client, layer, *args):  # type: ignore[no-untyped-def]
            if layer.subtree != "MANIFEST.json" and not waited:
                waited.append(True)
                time.sleep(4)  # the token expires here
            fetch(client, layer, *args)

        monkeypatch.setattr(oci, "_fetch_layer", fetch_late)
        before = len(tokens.granted)
        pulled = oci.pull(
            pushed.ref_digest, tmp_path / "s", auth=registry.authfile, ca_file=registry.ca_file,
            workers=1,
        )  # fmt: skip
        assert verify(pulled.gen_dir, key=KEY).ok
        assert len(tokens.granted) - before >= 2  # the first token, and its renewal


# --------------------------------------------------------------------------- plain HTTP


def test_a_local_registry_over_plain_http_takes_push_and_pull_with_plain_http(
    registry: Registry, tmp_path: Path
) -> None:
    """A ``registry:2`` on localhost without TLS (the proxy, speaking HTTP): push and pull
    with ``--plain-http``; without it, one line saying what to add."""
    publish(tmp_path / "source", files=FILES)
    with running_proxy(registry, tls=False) as proxy:
        auth = flags(registry, proxy.host, tmp_path)[:2]
        pushed = run_kernelcache(
            "push", "--store", str(tmp_path / "source"), "--key", KEY, proxy.repo("kc/plain"),
            "--plain-http", *auth,
        )  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
        ref = pushed.stdout.strip()
        pulled = run_kernelcache("pull", ref, "--store", str(tmp_path / "s"), "--plain-http", *auth)
        assert pulled.returncode == 0, pulled.stderr
        assert verify(Store(tmp_path / "s").current(KEY), key=KEY).ok

        refused = run_kernelcache("pull", ref, "--store", str(tmp_path / "t"), *auth, **NETWORK)
    assert refused.returncode == ExitCode.IO, refused.stderr
    line = one_line_error(refused)
    assert proxy.host in line and "--plain-http" in line, line


def test_a_plain_http_registry_redirecting_to_a_host_not_allowed_plain_http_is_refused(
    registry: Registry, pushed: str, tmp_path: Path
) -> None:
    """An allowed loopback registry over plain HTTP sends its blobs to another plain-http
    host: refused, naming it, and never asked (it would be refused for --plain-http)."""
    fault = Fault("/blobs/", "redirect-to-http", location="http://storage.example:9000/b")
    with running_proxy(registry, fault, tls=False) as proxy:
        auth = flags(registry, proxy.host, tmp_path)[:2]
        done, took = timed(
            "pull", via(proxy.host, pushed), "--store", str(tmp_path / "s"), "--plain-http", *auth
        )
    assert_failed_within(
        done, took, proxy.host, "redirected to plain http on storage.example:9000",
        f"neither loopback nor named in {contract.PLAIN_HTTP_HOSTS.name}: refused",
    )  # fmt: skip
    assert not (tmp_path / "s").exists() or Store(tmp_path / "s").current(KEY) is None


def test_plain_http_is_refused_for_a_registry_neither_loopback_nor_allowed(
    tmp_path: Path,
) -> None:
    ref = "registry.example:5000/kc/net@sha256:" + "0" * 64
    refused = run_kernelcache("pull", ref, "--store", str(tmp_path / "s"), "--plain-http")
    assert refused.returncode == ExitCode.USAGE, refused.stderr
    assert one_line_error(refused) == (
        "kernelcache: error: registry.example:5000: --plain-http is for a loopback registry "
        f"or one named in {contract.PLAIN_HTTP_HOSTS.name}; registry.example:5000 is neither"
    )
    allowed = Network(plain_http_hosts=("registry.example:5000",))
    allowed.check_plain_http("registry.example:5000")  # named: allowed
    for loopback in ("localhost:5000", "127.0.0.1:5000", "[::1]:5000", "127.3.2.1"):
        Network().check_plain_http(loopback)
