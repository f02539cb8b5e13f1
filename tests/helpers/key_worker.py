"""One fresh process's view of the cache key, for the key-correctness matrix.

    key_worker.py DECLARED_JSON

DECLARED_JSON is what a spec declares: ``workload`` (the warm-up: entry point, GEMM shapes,
dtype, alignment, compile options and the warmer's ``env``) and ``extra`` (model, engine
image). Prints one JSON object:

- ``stamp``: the environment stamp (``kernelcache.stamp.collect``), with the entry point's
  module and the project-local modules it imports as ``source/`` factors and the toolchain
  settings as ``setting/`` factors, as a build records them;
- ``cute``: the CuTe-DSL disk-layer key factors and digest of each GEMM shape, for the
  arguments ``examples/cute_gemm.py``'s ``specializations`` builds (with the declared dtype
  and alignment): traced, not compiled;
- ``observed``: facts about this process that the perturbations change (its PID, hostname,
  clock, where packages were found, ...), so a test can check that a perturbation was real.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import locale
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import blake3

from kernelcache.sources import module_sources
from kernelcache.stamp import collect


def cute_keys(warmup: dict[str, Any]) -> list[dict[str, Any]]:
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor

    from kernelcache.runtime.cute import trace

    module, _, attr = warmup["entryPoint"].partition(":")
    fn = getattr(importlib.import_module(module), attr)
    dtype = getattr(cutlass, warmup["dtype"])

    def fake(rows: int, cols: int) -> Any:
        return make_fake_compact_tensor(
            dtype, (rows, cols), stride_order=(1, 0), assumed_align=warmup["align"]
        )

    keys = []
    for m, n, k in warmup["shapes"]:
        traced = trace(fn, fake(m, k), fake(k, n), fake(m, n), options=warmup["options"])
        keys.append({"factors": traced.factors, "digest": traced.key})
    return keys


def visible_gpus() -> int:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    query = [exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"]
    return len(
        subprocess.run(query, capture_output=True, text=True, check=True).stdout.splitlines()
    )


def observed(kernel_module: str, declared: dict[str, Any]) -> dict[str, Any]:
    umask = os.umask(0)
    os.umask(umask)
    torch = importlib.metadata.distribution("torch")
    site = Path(str(torch.locate_file("")))
    kernel = importlib.util.find_spec(kernel_module)
    return {
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "boot_days": int(time.clock_gettime(time.CLOCK_BOOTTIME) // 86400),
        "cwd": os.getcwd(),
        "home": str(Path.home()),
        "tmpdir": tempfile.gettempdir(),
        "tzname": list(time.tzname),
        "locale": locale.setlocale(locale.LC_ALL),
        "encoding": locale.getpreferredencoding(False),
        "umask": umask,
        "hash": hash("kernelcache"),
        "stdin_tty": os.isatty(0),
        "environ": dict(os.environ),
        "env_order": list(os.environ),
        "gpus": visible_gpus(),
        "prefix": sys.prefix,
        "site": str(site),
        "site_device": os.stat(site).st_dev,
        "site_mtime": max(p.stat().st_mtime for p in site.glob("*.dist-info/*")),
        "record": blake3.blake3((torch.read_text("RECORD") or "").encode()).hexdigest(),
        "kernel_file": kernel.origin if kernel else None,
        "declared_order": [list(declared["workload"]), list(declared["extra"])],
    }


def main() -> None:
    declared = json.loads(sys.argv[1])
    warmup = declared["workload"]
    locale.setlocale(locale.LC_ALL, "")  # as a serving process would: the locale takes effect
    module = warmup["entryPoint"].partition(":")[0]
    # As a build: the stamp of the process's own environment (Triton asked for its settings),
    # then the warmer's env set for the warm, before the DSL is imported.
    stamp = collect(
        sources=module_sources(module), workload=warmup, extra=declared["extra"], ask_triton=True
    )
    os.environ.update(warmup["env"])
    report = {
        "stamp": stamp.to_dict(),
        "cute": cute_keys(warmup),
        "observed": observed(module, declared),
    }
    print(json.dumps(report, sort_keys=True))


if __name__ == "__main__":
    main()
