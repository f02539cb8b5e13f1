"""The vllm warmer driven against the fake engine (or a real one): the tiny model, the
KernelCache, and a warm and a verify through the real CLI; shared by the CPU and GPU tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.conftest import REPO, kernelcache_doc, scaled, subprocess_env

FAKE_VLLM = Path(__file__).resolve().parent / "fake_vllm"

MODEL = REPO / "bench" / "qwen3-moe-tiny"

ARCH = "sm_90a"

KEY = f"default/vq/{ARCH}"

PRODUCT = "NVIDIA H200"

PTH = REPO / "src" / "zz_kernelcache_runtime.pth"


@contextlib.contextmanager
def runtime_hook() -> Iterator[None]:
    """The runtime's ``.pth`` hook in this interpreter's site-packages, as an installed
    kernelcache has it, so every process ``vllm serve`` starts loads the runtime (inert unless
    ``KERNELCACHE_RUNTIME=1``); removed after."""
    installed = Path(sysconfig.get_path("purelib")) / f"zz_test_vllm_{os.getpid()}_{PTH.name}"
    shutil.copy(PTH, installed)
    try:
        yield
    finally:
        installed.unlink()


def workload(root: Path | str, **changes: Any) -> dict[str, Any]:
    return {
        "model": str(MODEL),
        "loadFormat": "dummy",
        "maxModelLen": 2048,
        "maxNumBatchedTokens": 512,
        "cacheRoot": str(root),
        "promptLengths": [5, 300, 1500],
        "batchSizes": [1, 3],
        "maxTokens": 4,
        **changes,
    }


def vllm_doc(root: Path | str, **changes: Any) -> dict[str, Any]:
    return kernelcache_doc(
        "vq",
        warmers=[{"type": "vllm", "workload": workload(root, **changes)}],
        gpuClasses=[{"name": "h200", "arch": ARCH, "gpuProduct": "NVIDIA H200"}],
    )


def build(tmp: Path, doc: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """``kernelcache build`` of ``doc`` into ``tmp/store``, then the warm's cache root removed
    (another node: only the generation travels): the paths, the build's log and its env."""
    import yaml

    root, store = tmp / "vllm-root", tmp / "store"
    (tmp / "kc.yaml").write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache", "build", "-f", str(tmp / "kc.yaml"),
         "--store", str(store)],
        env=env, capture_output=True, text=True, timeout=scaled(400),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    manifest = next(store.glob("default/vq/*/*/MANIFEST.json"))
    shutil.rmtree(root)
    return {"tmp": tmp, "root": root, "store": store, "manifest": manifest, "log": proc.stderr,
            "env": env}  # fmt: skip


def fake_env(**overrides: str) -> dict[str, str]:
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_VLLM), env["PYTHONPATH"]])
    env["PATH"] = os.pathsep.join([str(FAKE_VLLM / "bin"), env.get("PATH", "")])  # its GPU
    return {**env, "KERNELCACHE_ARCH": ARCH, "KERNELCACHE_GPU_PRODUCT": PRODUCT, **overrides}


PLAN = {"prompt_lengths": [5, 300, 1500], "batch_sizes": [1, 3], "max_tokens": 4}


def drive(tmp: Path, name: str, env: dict[str, str], **job: Any) -> tuple[int, dict, str]:
    """One ``vllm serve`` and its sweep, as bench/vllm_coldstart.py runs it: (rc, result,
    the server's output)."""
    job = {
        "engine": {"model": str(MODEL), "max_num_batched_tokens": 512},
        "sweep": PLAN,
        "runtime": "none",
        "preload": [],
        "result": str(tmp / f"{name}.json"),
        **job,
    }
    (tmp / f"{name}.job.json").write_text(json.dumps(job))
    proc = subprocess.run(
        [sys.executable, "-m", "kernelcache.toolchains.vllm", str(tmp / f"{name}.job.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    result = json.loads(Path(job["result"]).read_text()) if Path(job["result"]).exists() else {}
    return proc.returncode, result, proc.stderr


def verify(
    built: dict[str, Path], target: Path, env: dict[str, str], *extra: str
) -> subprocess.CompletedProcess:
    """The init-container's command, in the serving image (here: with this engine)."""
    return subprocess.run(
        [sys.executable, "-m", "kernelcache", "verify", "--store", str(built["store"]),
         "--key", KEY, "--check-env", "--materialize", str(target), *extra],
        env=env, capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip


def save_random_weights(config: Path, out: Path) -> Path:
    """A model directory: ``config`` and random bf16 weights for it as safetensors, in the
    Hugging Face names vLLM's Qwen3-MoE loader reads (a real-weights load without a hub)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config, out / "config.json")
    c = json.loads(config.read_text())
    h, hd, v = c["hidden_size"], c["head_dim"], c["vocab_size"]
    heads, kv, mi = c["num_attention_heads"], c["num_key_value_heads"], c["moe_intermediate_size"]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> Any:
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": ones(h),
               "lm_head.weight": rand(v, h)}  # fmt: skip
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * hd, h),
            p + "self_attn.k_proj.weight": rand(kv * hd, h),
            p + "self_attn.v_proj.weight": rand(kv * hd, h),
            p + "self_attn.o_proj.weight": rand(h, heads * hd),
            p + "self_attn.q_norm.weight": ones(hd),
            p + "self_attn.k_norm.weight": ones(hd),
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "mlp.gate.weight": rand(c["num_experts"], h),
        }
        for e in range(c["num_experts"]):
            q = f"{p}mlp.experts.{e}."
            tensors |= {q + "gate_proj.weight": rand(mi, h), q + "up_proj.weight": rand(mi, h),
                        q + "down_proj.weight": rand(h, mi)}  # fmt: skip
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
