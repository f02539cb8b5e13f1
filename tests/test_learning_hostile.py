"""What a serving pod reports is untrusted input: a pod that trickles, sends too much,
redirects or reports values past every bound costs the operator a fixed budget and cannot
push the other pods' keys out of ``status.learned``. Each fault at the size and speed that
broke the reader before: 1 byte every 0.5 s, a record over 1 MiB, a 302 to an internal URL,
256 keys with counts at the bound, 1e30 token counts and an 800 KB ``firstSeen``."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kernelcache import learned
from kernelcache.controller import peer
from kernelcache.controller.learning import Backoff, configmap_data, merged, read
from kernelcache.crd import crd_manifest
from kernelcache.errors import SpecError
from kernelcache.spec import (
    COUNT_MAX,
    LEARNED_KEYS_MAX,
    TOKENS_MAX,
    LearnedKey,
    LearnedStatus,
    parse_kernelcache,
)
from tests.conftest import scaled

ROOT = Path(__file__).resolve().parents[1]

RECORD = json.dumps(learned.document([LearnedKey(toolchain="vllm", kernel="moe", tokens=41)], 0))


class Peer:
    """A pod's metrics port on loopback that answers each connection with ``answer(conn)``,
    recording what happened to it (the bytes it sent before the reader hung up)."""

    def __init__(self, answer: Callable[[socket.socket, Peer], None]) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}{learned.PATH}"
        self.requests = 0
        self.sent = 0
        self.hung_up = threading.Event()
        self._answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.requests += 1
            with conn:
                conn.recv(4096)
                try:
                    self._answer(conn, self)
                except OSError:
                    self.hung_up.set()

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def peers() -> Iterator[Callable[[Callable[[socket.socket, Peer], None]], Peer]]:
    made: list[Peer] = []

    def make(answer: Callable[[socket.socket, Peer], None]) -> Peer:
        made.append(Peer(answer))
        return made[-1]

    yield make
    for p in made:
        p.close()


def trickle(total: int) -> Callable[[socket.socket, Peer], None]:
    """Headers at once, then a body of ``total`` bytes one byte every 0.5 s: each read
    returns within any per-socket timeout, the whole takes ``total / 2`` seconds."""

    def answer(conn: socket.socket, p: Peer) -> None:
        p.send(conn, f"HTTP/1.0 200 OK\r\nContent-Length: {total}\r\n\r\n".encode())
        for _ in range(total):
            p.send(conn, b" ")
            time.sleep(0.5)

    return answer


def test_a_pod_trickling_bytes_is_cut_off_at_the_one_deadline(peers) -> None:
    slow = peers(trickle(240))  # two minutes of trickle
    good = peers(lambda conn, p: p.send(conn, ok(RECORD.encode())))
    records, _, problems = read(
        {"slow": slow.url, "good": good.url}, scaled(2.0), backoff=Backoff()
    )
    assert list(records) == ["good"]
    [problem] = problems
    assert problem.startswith(f"pod slow {slow.url}: no complete answer within")
    # The reader hung up mid-trickle: the pod's next byte found the connection closed.
    assert slow.hung_up.wait(scaled(10)) and slow.sent < 240


def test_a_pod_trickling_headers_is_cut_off_too(peers) -> None:
    def headers_forever(conn: socket.socket, p: Peer) -> None:
        p.send(conn, b"HTTP/1.0 200 OK\r\n")
        for _ in range(240):
            p.send(conn, b"X: y\r\n")
            time.sleep(0.5)

    slow = peers(headers_forever)
    with pytest.raises(peer.PeerError, match=r"no complete answer within 1 s"):
        peer.get(slow.url, 1.0, learned.MAX_RECORD_BYTES)
    assert slow.hung_up.wait(scaled(10))


def ok(body: bytes, length: bool = True) -> bytes:
    head = (
        f"HTTP/1.0 200 OK\r\nContent-Length: {len(body)}\r\n\r\n"
        if length
        else "HTTP/1.0 200 OK\r\n\r\n"
    )
    return head.encode() + body


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "streamed"])
def test_a_record_over_the_cap_is_too_large_not_not_json(peers, declared: bool) -> None:
    huge = b'{"keys": [' + b" " * (learned.MAX_RECORD_BYTES + 10) + b"]}"
    big = peers(lambda conn, p: p.send(conn, ok(huge, length=declared)))
    records, _, [problem] = read({"big": big.url}, scaled(5.0), backoff=Backoff())
    assert records == {}
    assert problem.startswith(f"pod big {big.url}: too large") and "JSON" not in problem
    # The same record as a file (`build --learned`) is refused by size, unparsed.
    with pytest.raises(SpecError, match=r"^f: too large: more than 1 MiB$"):
        learned.parse(huge, "f")


def test_a_redirect_is_refused_and_named_never_followed(peers) -> None:
    internal = peers(lambda conn, p: p.send(conn, ok(RECORD.encode())))
    target = f"http://127.0.0.1:{internal.port}/api/v1/secrets"

    def redirect(conn: socket.socket, p: Peer) -> None:
        p.send(conn, f"HTTP/1.0 302 Found\r\nLocation: {target}\r\n\r\n".encode())

    steering = peers(redirect)
    records, _, [problem] = read({"steering": steering.url}, scaled(5.0), backoff=Backoff())
    assert records == {}
    assert problem == (
        f"pod steering {steering.url}: redirect (302) to '{target}' refused: "
        "redirects are not followed; not read for 60 s"
    )
    assert internal.requests == 0


# --------------------------------------------------------------------------------- the values


def entry(**fields: Any) -> str:
    return json.dumps({"keys": [{"toolchain": "vllm", "kernel": "moe", **fields}]})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (entry(tokens=10**30), "keys[0].tokens: Input should be less than or equal to 2147483647"),
        (entry(count=10**30), "keys[0].count: Input should be less than or equal to 9007199254"),
        (entry(tokens=1e30), "keys[0].tokens: Input should be a valid integer"),
        (entry(firstSeen="x" * 803_000), "keys[0].firstSeen: String should have at most 20"),
        (entry(firstSeen="yesterday"), "keys[0].firstSeen: String should match pattern"),
        (json.dumps({"keys": [], "dropped": 10**30}), "dropped: expected a count, got 1000000000"),
        (entry(tokens=8193), "keys[0].tokens: 8193 is more than the engine runs in one forward"),
    ],
)  # fmt: skip
def test_a_value_past_its_bound_refuses_the_record_naming_the_field(
    text: str, message: str
) -> None:
    with pytest.raises(SpecError) as caught:
        learned.parse(text, "pod p", max_tokens=8192)
    assert caught.value.message.startswith(f"pod p: {message}")
    assert "\n" not in caught.value.message and len(caught.value.message) < 300


def status_schema() -> dict[str, Any]:
    root = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return root["properties"]["status"]["properties"]["learned"]


@pytest.mark.parametrize(
    "bad",
    [
        {"keys": [{"toolchain": "v", "kernel": "k", "tokens": 10**30}]},
        {"keys": [{"toolchain": "v", "kernel": "k", "count": 2**53}]},
        {"keys": [{"toolchain": "v", "kernel": "k", "firstSeen": "x" * 803_000}]},
        {"keys": [{"toolchain": "v", "kernel": "k"}] * (LEARNED_KEYS_MAX + 1)},
        {"dropped": 10**30},
    ],
    ids=["tokens", "count", "firstSeen", "keys", "dropped"],
)
def test_the_crd_schema_refuses_what_the_operator_would_never_write(bad: dict[str, Any]) -> None:
    assert list(jsonschema.Draft4Validator(status_schema()).iter_errors(bad))


def test_the_status_bound_is_the_record_bound() -> None:
    assert LEARNED_KEYS_MAX == learned.LIMIT and COUNT_MAX == learned.COUNT_MAX
    assert TOKENS_MAX == learned.TOKENS_MAX
    assert LearnedKey.model_fields["pods"].metadata[0].max_length == learned.KEY_PODS


def test_the_engine_bound_is_the_kernelcaches_vllm_warmer() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "vllm-qwen3-moe.yaml").read_text())
    workload = next(w for w in doc["spec"]["warmers"] if w["type"] == "vllm")["workload"]
    workload["maxNumBatchedTokens"] = 4096
    assert parse_kernelcache(doc, "kc").spec.max_forward_tokens() == 4096
    del workload["maxNumBatchedTokens"]
    workload["maxModelLen"] = 32768  # no chunked budget set: a whole prompt is one forward
    assert parse_kernelcache(doc, "kc").spec.max_forward_tokens() == 32768


# --------------------------------------------------------------------------- the fair share

NOW = datetime(2026, 12, 2, 15, 0, tzinfo=timezone.utc)


def flood() -> list[LearnedKey]:
    """256 junk keys with counts at the bound: what one pod reported to evict the rest."""
    return [
        LearnedKey(toolchain="triton", kernel=f"junk{i}", count=learned.COUNT_MAX - i)
        for i in range(learned.LIMIT)
    ]


REAL = [
    LearnedKey(toolchain="vllm", kernel="fused_moe_kernel", tokens=41, count=3),
    LearnedKey(toolchain="triton", kernel="sampler_kernel", key="ab12"),
]


def kernels(status: dict[str, Any] | None) -> set[str]:
    return {k["kernel"] for k in (status or {}).get("keys", [])}


def test_one_pod_cannot_evict_another_pods_keys_and_its_own_age_out_when_it_is_gone() -> None:
    first = merged(None, {"engine-0": REAL}, 0, NOW, {"engine-0"}, 3600)
    hostile = merged(
        first, {"engine-0": REAL, "hostile": flood()}, 0, NOW, {"engine-0", "hostile"}, 3600
    )
    assert hostile is not None and len(hostile["keys"]) == learned.LIMIT
    assert {"fused_moe_kernel", "sampler_kernel"} <= kernels(hostile)  # the real keys stay
    assert hostile["dropped"] == 2  # two of the junk keys are what was left out
    assert all(c <= learned.COUNT_MAX for c in (k["count"] for k in hostile["keys"]))
    # The hostile pod is deleted: its keys are marked gone, then age out.
    gone = NOW + timedelta(minutes=1)
    after = merged(hostile, {"engine-0": REAL}, 0, gone, {"engine-0"}, 3600)
    junk = [k for k in after["keys"] if k["kernel"].startswith("junk")]
    assert junk and all(
        k["goneSince"] == "2026-12-02T15:01:00Z" and not k.get("pods") for k in junk
    )
    later = merged(
        after, {"engine-0": REAL}, 0, gone + timedelta(hours=1, seconds=1), {"engine-0"}, 3600
    )
    assert kernels(later) == {"fused_moe_kernel", "sampler_kernel"}
    # The next build warms what serving met, not the flood.
    build = json.loads(configmap_data(later)["learned.json"])
    assert {k["kernel"] for k in build["keys"]} == {"fused_moe_kernel", "sampler_kernel"}
    assert "pods" not in json.dumps(build)
    # Reading the same pods again writes nothing new.
    assert (
        merged(later, {"engine-0": REAL}, 0, gone + timedelta(hours=2), {"engine-0"}, 3600) == later
    )


def test_counts_summed_over_pods_saturate_at_the_bound() -> None:
    big = [LearnedKey(toolchain="v", kernel="k", count=learned.COUNT_MAX)]
    keys, _ = learned.merge([], {"a": big, "b": big})
    assert keys[0].count == learned.COUNT_MAX and keys[0].pods == ["a", "b"]
    LearnedStatus(keys=keys)  # still a valid status


def test_a_sibling_process_record_past_the_bounds_does_not_spoil_the_pods_record(
    tmp_path, monkeypatch
) -> None:
    """An engine's sibling process shares its record through a directory: a key there past
    any bound (which would make the operator refuse the pod's whole record) is left out."""
    from kernelcache.runtime import learning, metrics

    learning.forget()
    monkeypatch.setattr(learning.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(learning, "_shared", None)
    learning.share(9401)
    metrics.record_vllm_jit_event("triton", "real_moe", 17)
    shared = tmp_path / "kernelcache-learned-9401"
    bad = [
        {"toolchain": "vllm", "kernel": "k1", "tokens": 10**30, "count": 1},
        {"toolchain": "vllm", "kernel": "k2", "count": 10**30},
        {"toolchain": "vllm", "kernel": "k3", "count": 1, "firstSeen": "x" * 803_000},
        {"toolchain": "vllm", "kernel": "real_moe", "tokens": 17, "count": learned.COUNT_MAX},
    ]
    (shared / "1.json").write_text(json.dumps({"keys": bad, "dropped": 10**30}))
    keys, dropped = learned.parse(json.dumps(learning.record()), "record", max_tokens=8192)
    assert [(k.kernel, k.count) for k in keys] == [("real_moe", learned.COUNT_MAX)]
    assert dropped == learned.COUNT_MAX
    learning.forget()
