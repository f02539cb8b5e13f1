"""Batch shapes as the engine's scheduler hands them to its worker: one step of new requests,
each with the tokens it schedules now and the tokens already computed before it (its
context), run through the worker's own ``execute_model`` and ``sample_tokens`` and then
finished, as vLLM's own warm-up of its kernels drives its model runner (``vllm.v1.worker.gpu.
warmup.warmup_kernels``: scheduler outputs built from ``Request`` and ``NewRequestData``, a
last step that finishes them). The whole serving path runs: the input batch, the attention
metadata builders (which pick their kernels by how a batch mixes decodes, prefills and
context), the compiled graphs or CUDA graphs, MoE, the sampler; and nothing is left behind:
the requests are finished, their blocks were never the scheduler's.

Each shape (``SHAPES``) is a function of a token count and the engine's bounds: decode-only
batches, a prefill without context, a prefill with context (a chunked prefill's later chunk,
a prefix-cache hit), prefills with and without context in one batch (MLA's masking of empty
context), and decodes beside a prefill. Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CONTEXT = 16  # the context of a decode request: one block of a usual KV cache
Batch = list[tuple[int, int]]  # (tokens scheduled, tokens of context) per request
# A request whose context is negative is a chunked prefill continued: its -context tokens
# were scheduled in a step of their own before (a cached request now, as the scheduler hands
# on a long prompt's later chunk); a positive context is a prefix-cache hit.


@dataclass(frozen=True)
class Limits:
    """The engine's bounds on a batch, from its configuration."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


def _decode(tokens: int, limits: Limits) -> Batch | None:
    return [(1, CONTEXT)] * tokens if tokens <= limits.max_num_seqs else None


def _prefill(tokens: int, limits: Limits) -> Batch | None:
    return [(tokens, 0)] if tokens < limits.max_model_len else None


def _prefill_with_context(tokens: int, limits: Limits) -> Batch | None:
    context = min(tokens, limits.max_model_len - tokens - 1)
    return [(tokens, context)] if context > 0 else None


def _unequal_context(tokens: int, limits: Limits) -> Batch | None:
    """Two prefills, one behind context and one not."""
    second = tokens // 2
    first = tokens - second
    context = min(first, limits.max_model_len - first - 1)
    return [(first, context), (second, 0)] if second >= 2 and context > 0 else None


def _continued_beside_new(tokens: int, limits: Limits) -> Batch | None:
    """A long prompt's later chunk beside a new prompt's first, in one step (what chunked
    prefill forms whenever prompts queue up)."""
    second = tokens // 2
    first = tokens - second
    context = min(first, limits.max_model_len - first - 1, limits.max_num_batched_tokens)
    return [(first, -context), (second, 0)] if second >= 2 and context > 0 else None


def _mixed(tokens: int, limits: Limits) -> Batch | None:
    """Decodes beside one prefill, as vLLM's own mixed warm-up batch splits them."""
    decodes = min(limits.max_num_seqs - 1, tokens // 2)
    prefill = tokens - decodes
    if decodes < 1 or prefill >= limits.max_model_len:
        return None
    return [(1, CONTEXT)] * decodes + [(prefill, 0)]


SHAPES: dict[str, Callable[[int, Limits], Batch | None]] = {
    "decode": _decode,
    "prefill": _prefill,
    "prefill with context": _prefill_with_context,
    "prefills with and without context": _unequal_context,
    "a continued chunk beside a new prefill": _continued_beside_new,
    "decodes beside a prefill": _mixed,
}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class Steps:
    """Runs batches through one worker (the engine core's, its KV cache allocated)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.runner = worker.model_runner
        output = importlib.import_module("vllm.v1.core.sched.output")
        self._output = output.SchedulerOutput
        self._new = output.NewRequestData
        self._request = importlib.import_module("vllm.v1.request").Request
        self._params = importlib.import_module("vllm").SamplingParams
        config = self.runner.kv_cache_config
        self.block_sizes = [group.kv_cache_spec.block_size for group in config.kv_cache_groups]
        self.free_blocks = int(config.num_blocks) - 1  # block 0 is the null block
        self.serial = 0

    def fits(self, batch: Batch) -> bool:
        return self._blocks(batch) <= self.free_blocks

    def _blocks(self, batch: Batch) -> int:
        return sum(_ceil(q + abs(c) + 1, size) for q, c in batch for size in self.block_sizes)

    def run(self, batch: Batch) -> None:
        """One step of ``batch`` (greedy), sampled, then its requests finished; a continued
        request's earlier chunk runs first, in a step of its own."""
        self.serial += 1
        ids = [f"_kernelcache_{self.serial}_{index}" for index in range(len(batch))]
        blocks, next_block = [], 1
        for query, context in batch:
            mine = []
            for size in self.block_sizes:
                count = _ceil(query + abs(context) + 1, size)
                mine.append(list(range(next_block, next_block + count)))
                next_block += count
            blocks.append(tuple(mine))
        prompts = [
            [1 + (index + position) % 1000 for position in range(abs(context) + query)]
            for index, (query, context) in enumerate(batch)
        ]
        earlier = self._output.make_empty()  # the continued requests' first chunks
        step = self._output.make_empty()
        for index, (query, context) in enumerate(batch):
            if context < 0:
                earlier.scheduled_new_reqs.append(self._new_request(ids[index], prompts[index],
                                                                    blocks[index], 0))  # fmt: skip
                earlier.num_scheduled_tokens[ids[index]] = -context
                step.scheduled_cached_reqs.req_ids.append(ids[index])
                step.scheduled_cached_reqs.num_computed_tokens.append(-context)
                step.scheduled_cached_reqs.new_block_ids.append(None)
                step.scheduled_cached_reqs.num_output_tokens.append(0)
            else:
                step.scheduled_new_reqs.append(
                    self._new_request(ids[index], prompts[index], blocks[index], context)
                )
            step.num_scheduled_tokens[ids[index]] = query
        finish = self._output.make_empty()
        finish.finished_req_ids = set(ids)
        connector = getattr(self.runner, "kv_connector", None)
        if connector is not None:
            connector.set_disabled(True)
        try:
            for one in (earlier, step):
                if one.num_scheduled_tokens:
                    one.total_num_scheduled_tokens = sum(one.num_scheduled_tokens.values())
                    if hasattr(one, "num_common_prefix_blocks"):  # up to 0.33 (adapter)
                        one.num_common_prefix_blocks = [0] * len(self.block_sizes)
                    self.worker.execute_model(one)
                    self.worker.sample_tokens(None)
        finally:
            self.worker.execute_model(finish)
            if connector is not None:
                connector.set_disabled(False)

    def _new_request(
        self, req_id: str, prompt: list[int], blocks: tuple[list[int], ...], context: int
    ) -> Any:
        request = self._request(req_id, prompt, self._params(max_tokens=2, temperature=0.0), None)
        new = self._new.from_request(request, block_ids=blocks, prefill_token_ids=prompt)
        new.num_computed_tokens = context
        return new
