"""As vLLM 0.26.0's ``Request``: what the scheduler knows of one request."""

from __future__ import annotations

from typing import Any


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        sampling_params: Any,
        pooling_params: Any,
        **_: Any,
    ) -> None:
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.sampling_params, self.pooling_params = sampling_params, pooling_params
        self.num_computed_tokens = 0
