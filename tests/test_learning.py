"""Learning from serving: the runtime's record of compiles with their keys, served over HTTP;
bounded Prometheus labels; the record's merge, bound and parse (``kernelcache.learned``)."""

from __future__ import annotations

import json
import urllib.request
from datetime import datetime, timezone

import pytest

from kernelcache import learned
from kernelcache.controller import peer
from kernelcache.controller.learning import (
    BACKOFF_MOST_S,
    Backoff,
    configmap_data,
    endpoints,
    events,
    merged,
    read,
)
from kernelcache.controller.peer import PeerError
from kernelcache.errors import SpecError
from kernelcache.runtime import learning, metrics
from kernelcache.spec import LearnedKey


@pytest.fixture(autouse=True)
def fresh_record():
    learning.forget()
    yield
    learning.forget()


def key(kernel: str, tokens: int | None = None, count: int = 1, **more) -> LearnedKey:
    return LearnedKey(toolchain="vllm", kernel=kernel, tokens=tokens, count=count, **more)


def test_compiles_are_served_with_their_keys_and_labels_stay_bounded():
    port = metrics.serve_metrics(0, "127.0.0.1")
    metrics.set_generation("default/kc", "sm_90a", "g1", "s1", mismatch=False)
    metrics.record_compile("triton", "learn_matmul", 0.5, key="abc123")
    for tokens in range(1, 301):  # many distinct token counts of one kernel
        metrics.record_vllm_jit_event("triton", "learn_moe_kernel", tokens)
    metrics.record_vllm_jit_event("triton", "learn_moe_kernel", 7)
    base = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(f"{base}{learned.PATH}", timeout=5) as answer:
        record = json.load(answer)
    assert record["kind"] == learned.KIND and record["generation"] == "g1"
    assert record["cache"] == "default/kc" and record["arch"] == "sm_90a"
    keys, dropped = learned.parse(json.dumps(record), "record")
    assert len(keys) == learned.LIMIT and dropped == 301 - learned.LIMIT
    # The operator's reader (one deadline, HTTP/1.0) reads the runtime's server as it is.
    body = peer.get(f"{base}{learned.PATH}", 5.0, learned.MAX_RECORD_BYTES)
    assert learned.parse(body, "read by the operator") == (keys, dropped)
    assert next(k for k in keys if k.tokens == 7).count == 2
    assert any(k.key == "abc123" and k.toolchain == "triton" for k in keys)
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    series = [
        line
        for line in text.splitlines()
        if line.startswith("kernelcache_vllm_jit_events_total{")
        and 'kernel="learn_moe_kernel"' in line
    ]
    assert series == [
        'kernelcache_vllm_jit_events_total{backend="triton",kernel="learn_moe_kernel"} 301.0'
    ]
    assert "abc123" not in text and "tokens" not in text


def test_merge_takes_the_larger_count_and_the_earliest_time_and_stays_bounded():
    kept = [key("moe", 17, count=3, first_seen="2026-12-01T00:00:00Z")]
    pod_a = [key("moe", 17, count=2, first_seen="2026-12-02T00:00:00Z"), key("moe", 33)]
    pod_b = [key("moe", 17, count=2), key("sampler")]
    merged, dropped = learned.merge(kept, {"pod-a": pod_a, "pod-b": pod_b})
    assert dropped == 0
    assert [(k.kernel, k.tokens, k.count) for k in merged] == [
        ("moe", 17, 4), ("moe", 33, 1), ("sampler", None, 1),
    ]  # fmt: skip
    assert merged[0].first_seen == "2026-12-01T00:00:00Z"
    again, _ = learned.merge(merged, {"pod-a": pod_a, "pod-b": pod_b})
    assert again == merged  # the same pods read again: nothing counted twice
    assert learned.sizes(merged) == [17, 33]
    many = {"pod-a": [key("moe", n, count=n) for n in range(1, 11)]}
    small, dropped = learned.merge([], many, limit=3)
    assert [k.tokens for k in small] == [8, 9, 10] and dropped == 7


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "record: not a learned record (expected an object with keys: [...])"),
        ('{"keys": [{"kernel": "k"}]}', "record: keys[0].toolchain: Field required"),
        ('{"keys": [{"toolchain": "vllm", "kernel": "k", "tokens": 0}]}', "record: keys[0].tokens"),
        ('{"keys": [], "dropped": -1}', "record: dropped: expected a count, got -1"),
    ],
)
def test_a_bad_record_is_one_line_naming_the_field(text, message):
    with pytest.raises(SpecError) as caught:
        learned.parse(text, "record")
    assert caught.value.message.startswith(message) and "\n" not in caught.value.message


# ------------------------------------------------------------------------------ the operator's side


def pod(name: str, port: int | None = 9400, ready: bool = True, ip: str = "10.0.0.7") -> dict:
    ports = [{"name": "kc-metrics", "containerPort": port}] if port else []
    return {
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "engine", "ports": ports}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_only_ready_pods_with_a_metrics_port_are_asked():
    pods = [pod("a"), pod("b", port=None), pod("c", ready=False), pod("d", ip="fd00::7")]
    assert endpoints(pods) == {
        "a": f"http://10.0.0.7:9400{learned.PATH}",
        "d": f"http://[fd00::7]:9400{learned.PATH}",
    }


def test_a_silent_or_wrong_pod_is_one_line_and_the_others_are_read():
    record = json.dumps(learned.document([key("moe", 17)], 2)).encode()

    def fetch(url: str, budget: float) -> bytes:
        assert 0 < budget <= 0.5  # what is left of the one deadline of the whole read
        if "silent" in url:
            raise PeerError("no complete answer within 0.5 s (0 bytes received)")
        return b"<html>" if "wrong" in url else record

    urls = {name: f"http://{name}/x" for name in ("good", "silent", "wrong")}
    records, dropped, problems = read(urls, 0.5, fetch, backoff=Backoff())
    assert list(records) == ["good"] and records["good"][0].tokens == 17 and dropped == 2
    assert problems == [
        "pod silent http://silent/x: no complete answer within 0.5 s (0 bytes received); "
        "not read for 60 s",
        "pod wrong http://wrong/x: not JSON (Expecting value: line 1 column 1 (char 0)); "
        "not read for 60 s",
    ]


def test_a_pod_that_failed_is_left_alone_for_a_back_off_that_doubles() -> None:
    """A trickling pod costs one deadline per back-off, not one per resync."""
    now = [1000.0]
    backoff = Backoff(clock=lambda: now[0])
    asked: list[str] = []

    def fetch(url: str, budget: float) -> bytes:
        asked.append(url)
        if "slow" in url:
            raise PeerError("no complete answer within 2 s (3 bytes received)")
        return json.dumps(learned.document([key("moe", 17)], 0)).encode()

    urls = {"slow": "http://slow/x", "good": "http://good/x"}
    read(urls, 2.0, fetch, backoff=backoff)
    assert sorted(asked) == ["http://good/x", "http://slow/x"]
    asked.clear()
    now[0] += 59  # the next resyncs: the slow pod is not asked, the good one is
    records, _, [problem] = read(urls, 2.0, fetch, backoff=backoff)
    assert asked == ["http://good/x"] and list(records) == ["good"]
    assert problem == "pod slow http://slow/x: not read for 1 s more (its last answer failed)"
    now[0] += 2
    asked.clear()
    _, _, [problem] = read(urls, 2.0, fetch, backoff=backoff)
    assert sorted(asked) == ["http://good/x", "http://slow/x"]
    assert problem.endswith("; not read for 120 s")  # doubled
    for _ in range(6):  # each time it fails again as soon as it is asked: capped
        now[0] += backoff.left("http://slow/x") + 1
        _, _, [problem] = read(urls, 2.0, fetch, backoff=backoff)
    assert problem.endswith(f"; not read for {BACKOFF_MOST_S:.0f} s")
    now[0] += 2 * BACKOFF_MOST_S + 1  # long past: forgotten, the next failure starts over
    read({"good": "http://good/x"}, 2.0, fetch, backoff=backoff)
    _, _, [problem] = read(urls, 2.0, fetch, backoff=backoff)
    assert problem.endswith("; not read for 60 s")


NOW = datetime(2026, 12, 2, 15, 0, tzinfo=timezone.utc)


def test_status_and_event_say_what_was_learned_and_only_once():
    assert merged(None, {}, 0, NOW) is None  # nothing learned, ever: no status.learned
    first = merged(None, {"pod-a": [key("moe", 17), key("moe", 33)]}, 0, NOW)
    assert first == {
        "keys": [
            {"toolchain": "vllm", "kernel": "moe", "tokens": 17, "count": 1, "pods": ["pod-a"]},
            {"toolchain": "vllm", "kernel": "moe", "tokens": 33, "count": 1, "pods": ["pod-a"]},
        ],
        "dropped": 0,
        "pods": ["pod-a"],
        "updatedAt": "2026-12-02T15:00:00Z",
    }
    assert [e.message for e in events(None, first)] == [
        "learned 2 specializations from serving: the next build warms them"
    ]
    later = NOW.replace(hour=16)
    again = merged(first, {"pod-a": [key("moe", 17)]}, 0, later)
    assert again == first and events(first, again) == []  # no new keys: no write, no event
    third = merged(first, {"pod-b": [key("moe", 65)]}, 0, later)
    assert third["updatedAt"] == "2026-12-02T16:00:00Z" and third["pods"] == ["pod-b"]
    assert [e.reason for e in events(first, third)] == ["Learned"]
    assert "learned 1 specialization from" in events(first, third)[0].message
    data = json.loads(configmap_data(third)["learned.json"])
    assert learned.sizes(learned.parse(json.dumps(data), "cm")[0]) == [17, 33, 65]
    assert configmap_data(None) == {}


def test_the_record_served_holds_what_sibling_processes_shared(tmp_path, monkeypatch):
    """The engine core of ``vllm serve`` cannot bind the port its API server holds: its keys
    reach the served record through the shared directory."""
    monkeypatch.setattr(learning.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(learning, "_shared", None)
    learning.share(9400)
    metrics.record_vllm_jit_event("triton", "shared_moe", 17)
    [own] = (tmp_path / "kernelcache-learned-9400").glob("*.json")
    assert learned.parse(own.read_bytes(), "own")[0][0].tokens == 17
    sibling = learned.document([key("shared_moe", 17, count=2), key("shared_moe", 33)], 1)
    (tmp_path / "kernelcache-learned-9400" / "1.json").write_text(json.dumps(sibling))
    (tmp_path / "kernelcache-learned-9400" / "2.json").write_text("{not json")  # skipped
    keys, dropped = learned.parse(json.dumps(learning.record()), "record")
    assert [(k.kernel, k.tokens, k.count) for k in keys] == [
        ("shared_moe", 17, 3),
        ("shared_moe", 33, 1),
    ]
    assert dropped == 1
