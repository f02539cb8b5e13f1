from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vllm.v1.worker.gpu_model_runner import GPUModelRunner


@dataclass
class _ModelConfig:
    model: str


@dataclass
class _VllmConfig:
    model_config: _ModelConfig


class Worker:
    CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)

    def __init__(self, model: str, root: Path, dtype: str) -> None:
        self.dtype = dtype
        self.vllm_config = _VllmConfig(_ModelConfig(model))
        self.root = root
        self.model_runner = GPUModelRunner()

    def load_model(self) -> None:
        pass

    def load_or_compile(self) -> bool:
        """True when the cache was there; a cache written at another root crashes."""
        import vllm

        path = vllm.cache_file(self.root)
        if not path.exists():
            vllm.write_cache(self.root, self.vllm_config.model_config.model, self.dtype)
            return False
        artifact = Path(json.loads(path.read_text())["artifact"])
        if not artifact.exists():
            raise FileNotFoundError(f"compiled artifact {artifact} not found")
        (self.root / "torch_compile_cache" / "torch_aot_compile").mkdir(exist_ok=True)
        (self.root / "torch_compile_cache" / "torch_aot_compile" / "written-on-load").write_text(
            "x"
        )
        return True

    def compile_or_warm_up_model(self) -> None:
        for size in self.CUDA_GRAPH_SIZES:
            self.model_runner._dummy_run(size)
        from vllm.utils.jit_monitor import activate as activate_jit_monitor

        activate_jit_monitor(mode=getattr(self, "jit_monitor_mode", "warn"))
