"""As vLLM's: the memory snapshot a worker takes at start (its free memory)."""

from vllm.v1.worker.gpu_worker import _Snapshot as MemorySnapshot

__all__ = ["MemorySnapshot"]
