"""As vLLM's ``vllm.config``: where its configuration classes are named (the stand-in defines
them beside its worker)."""

from vllm.v1.worker.gpu_worker import (
    _CacheConfig as CacheConfig,
)
from vllm.v1.worker.gpu_worker import (
    _CompilationConfig as CompilationConfig,
)
from vllm.v1.worker.gpu_worker import (
    _ModelConfig as ModelConfig,
)
from vllm.v1.worker.gpu_worker import (
    _ParallelConfig as ParallelConfig,
)
from vllm.v1.worker.gpu_worker import (
    _SchedulerConfig as SchedulerConfig,
)
from vllm.v1.worker.gpu_worker import (
    _VllmConfig as VllmConfig,
)

__all__ = [
    "CacheConfig",
    "CompilationConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "VllmConfig",
]
