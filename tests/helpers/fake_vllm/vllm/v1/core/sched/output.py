"""As vLLM 0.26.0's scheduler output: what one step hands the worker (new requests with the
tokens already computed before them, continued ones, the tokens each schedules now, the
requests finished)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    prefill_token_ids: list[int] | None = None

    @classmethod
    def from_request(
        cls, request: Any, block_ids: tuple[list[int], ...], prefill_token_ids: Any = None
    ) -> NewRequestData:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            block_ids,
            request.num_computed_tokens,
            prefill_token_ids,
        )


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_block_ids: list[Any] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls()


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    num_common_prefix_blocks: list[int]
    finished_req_ids: set[str]

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData.make_empty(), {}, 0, [], set())
