"""The real Prometheus server, scraping two real serving processes, evaluating the real rules.

A cold process compiles the example CuTe-DSL kernels (an empty cache) and a warm one loads
them from the cache the cold one filled. With 1 s scrape and evaluation intervals, the
KernelCacheColdCompile alert of ``prometheus/kernelcache-rules.yaml`` (no ``for``) must fire
for the cold process within seconds, and never for the warm one.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, needs_cute, subprocess_env, system_tool
from tests.test_build import SMALL_WORKLOAD

RULES = REPO / "prometheus" / "kernelcache-rules.yaml"
HELPER = Path(__file__).parent / "helpers" / "runtime_serve.py"
DEADLINE_S = 60

pytestmark = needs_cute


@contextmanager
def serving(cache: Path) -> Iterator[int]:
    """A serving process that ran the example kernels against ``cache``; yields its port."""
    proc = subprocess.Popen(
        [sys.executable, str(HELPER), "--serve", "--cute", json.dumps(SMALL_WORKLOAD)],
        env=subprocess_env(KERNELCACHE_CUTE_DSL_DIR=str(cache)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().split()[1])
        while proc.stdout.readline() not in ("--- metrics\n", ""):  # its compiles are done
            pass
        yield port
    finally:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["data"]


@contextmanager
def prometheus(tmp: Path, targets: dict[str, int]) -> Iterator[int]:
    """The server, its rules the repository's file, scraping ``job -> port`` every second."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for job, port in targets.items()
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            system_tool("prometheus"),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp / "prometheus.log").open("w"),
    )
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_for(what: str, check: Any, log: Path) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except OSError:  # the server is still starting
            pass
        time.sleep(0.5)
    pytest.fail(f"{what} within {DEADLINE_S} s; prometheus said:\n{log.read_text()[-3000:]}")


def test_a_cold_compile_fires_the_alert_and_a_warm_process_does_not(tmp_path):
    cache = tmp_path / "cute-cache"
    log = tmp_path / "prometheus.log"
    with ExitStack() as stack:
        cold = stack.enter_context(serving(cache))
        warm = stack.enter_context(serving(cache))  # the cold one filled the cache
        server = stack.enter_context(prometheus(tmp_path, {"cold": cold, "warm": warm}))

        def cold_alert() -> list[dict]:
            alerts = api(server, "alerts")["alerts"]
            return [
                a
                for a in alerts
                if a["labels"]["alertname"] == "KernelCacheColdCompile"
                and a["labels"]["job"] == "cold"
                and a["state"] == "firing"
            ]

        firing = wait_for("KernelCacheColdCompile firing for the cold process", cold_alert, log)
        assert {a["labels"]["kernel"] for a in firing} == {
            "demo_kernels:add",
            "demo_kernels:scale_tiled",
        }
        assert {a["labels"]["severity"] for a in firing} == {"warning"}
        assert firing[0]["annotations"]["runbook_url"].endswith("#kernelcachecoldcompile")

        # The warm process was scraped and the rules evaluated since: no alert names it.
        def warm_hits() -> list[dict]:
            query = 'kernelcache_cache_hits_total{job="warm",toolchain="cute-dsl"} == 2'
            return list(api(server, "query", query=query)["result"])

        wait_for("the warm process's two cache hits scraped", warm_hits, log)
        time.sleep(3)  # a few more evaluations
        alerts = api(server, "alerts")["alerts"]
        assert [a for a in alerts if a["labels"].get("job") == "warm"] == []
