"""As vLLM 0.26.0's ``GPUModelRunner``: ``execute_model`` runs a scheduled batch;
``_dummy_run`` forms a batch of its own, as vLLM's forms it (decode-only, prefill split over
up to ``max_num_seqs`` requests, mixed decode and prefill; sequence lengths as given), with
attention only where asked (``force_attention``). A forward loads the attention kernels of
its batch's shape and each MoE layer's kernels for its token count; a MoE layer with shared
experts whose last forward was run from outside the model still holds its output, and the
next forward of the model fails on it, as vLLM's ``shared_experts.py`` assertion does."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class GPUModelRunner:
    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = SimpleNamespace(
            num_blocks=4096, kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(
                block_size=16))]
        )  # fmt: skip
        self.requests: dict[str, int] = {}  # the input batch: each request's computed tokens
        self._mla: bool | None = None

    @property
    def mla(self) -> bool:
        """Whether the model's attention is MLA (its config.json has ``kv_lora_rank``)."""
        if self._mla is None:
            model = Path(self.vllm_config.model_config.model) / "config.json"
            self._mla = model.is_file() and "kv_lora_rank" in json.loads(model.read_text())
        return self._mla

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> None:
        """One step: finished requests leave the batch, new ones join it (with the tokens
        computed before them), then the scheduled tokens run."""
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.requests[req_id] = computed
        scheduled = scheduler_output.num_scheduled_tokens
        if not scheduled:
            return
        queries = [scheduled[req_id] for req_id in scheduled]
        seq_lens = [self.requests[req_id] + scheduled[req_id] for req_id in scheduled]
        self._forward(queries, seq_lens)

    def sample_tokens(self, grammar_output: Any) -> None:
        """The sampler of the last step (the stand-in samples nothing)."""

    def _dummy_run(
        self,
        num_tokens: int,
        cudagraph_runtime_mode: Any = None,
        force_attention: bool = False,
        uniform_decode: bool = False,
        allow_microbatching: bool = True,
        skip_eplb: bool = False,
        is_profile: bool = False,
        create_mixed_batch: bool = False,
        remove_lora: bool = True,
        is_graph_capturing: bool = False,
        num_active_loras: int = 0,
        profile_seq_lens: int | None = None,
    ) -> None:
        max_num_reqs = self.vllm_config.scheduler_config.max_num_seqs
        max_query_len = 1 if uniform_decode else num_tokens
        if create_mixed_batch:
            decodes = min(max_num_reqs - 1, num_tokens // 2)
            queries = [1] * decodes + [num_tokens - decodes]
            max_query_len = num_tokens - decodes
        elif uniform_decode:
            queries = [1] * min(max_num_reqs, num_tokens)
        else:
            requests = min(num_tokens, max_num_reqs)
            queries = [num_tokens // requests] * requests
            queries[-1] += num_tokens % requests
        assert sum(queries) == num_tokens
        seq_lens = None
        if force_attention:
            if profile_seq_lens is not None:
                seq_lens = [profile_seq_lens] * len(queries)
            elif create_mixed_batch:
                seq_lens = [1] * (len(queries) - 1) + [queries[-1] + 1]
            else:
                seq_lens = [max_query_len] * len(queries)
        self._forward(queries, seq_lens)

    def _forward(self, queries: list[int], seq_lens: list[int] | None) -> None:
        from vllm.model_executor.layers.attention import MODULE, kernels_for_batch
        from vllm.model_executor.layers.fused_moe import kernels_for, load

        config = self.vllm_config.compilation_config
        if seq_lens is not None:
            for kernel in kernels_for_batch(queries, seq_lens, self.mla):
                load(kernel, MODULE)
        for name in config.static_all_moe_layers:
            layer = config.static_forward_context[name]
            assert layer.shared_output is None, (
                "shared_experts.py:165 assert self._output[self._output_idx] is None"
            )
            for kernel in kernels_for(sum(queries), layer.moe_config):
                load(kernel)
