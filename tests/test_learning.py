"""Learning from serving: the runtime's record of compiles with their keys, served over HTTP;
bounded Prometheus labels; the record's merge, bound and parse (``kernelcache.learned``)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from kernelcache import learned
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
    merged, dropped = learned.merge(kept, [pod_a, pod_b])
    assert dropped == 0
    assert [(k.kernel, k.tokens, k.count) for k in merged] == [
        ("moe", 17, 4), ("moe", 33, 1), ("sampler", None, 1),
    ]  # fmt: skip
    assert merged[0].first_seen == "2026-12-01T00:00:00Z"
    again, _ = learned.merge(merged, [pod_a, pod_b])
    assert again == merged  # the same pods read again: nothing counted twice
    assert learned.sizes(merged) == [17, 33]
    many = [[key("moe", n, count=n) for n in range(1, 11)]]
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
