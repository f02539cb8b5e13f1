"""As vLLM's attention: which kernels a batch loads depends on its shape.

An MLA model (its config.json has ``kv_lora_rank``, as DeepSeek's) runs, as vLLM 0.26.0's
``mla_attention``: a decode kernel for requests of one token; a prefill kernel for the others;
a context kernel when a prefill has context (a chunked prefill, a prefix hit); and
``mask_empty_context_kernel`` when a batch's prefills mix requests with and without context
(``has_empty_context``). Other models run one kernel, specialized on whether the batch is
all decodes. Kernels load through the fused-MoE stand-in's ``load`` (Triton's listener, the
JIT monitor), defined in ``vllm.v1.attention.ops``.
"""

from __future__ import annotations

MODULE = "vllm.v1.attention.ops.triton_merge_attn_states"


def kernels_for_batch(queries: list[int], seq_lens: list[int], mla: bool) -> list[str]:
    contexts = [seq - query for query, seq in zip(queries, seq_lens, strict=True)]
    if not mla:
        return [f"unified_attention_kernel[decode_only={all(q == 1 for q in queries)}]"]
    kernels = []
    prefills = [context for query, context in zip(queries, contexts, strict=True) if query > 1]
    if len(prefills) < len(queries):
        kernels.append("mla_decode_kernel")
    if prefills:
        kernels.append("mla_prefill_kernel")
    if any(context > 0 for context in prefills):
        kernels.append("mla_context_chunk_kernel")
        if any(context == 0 for context in prefills):
            kernels.append("mask_empty_context_kernel")
    return kernels
