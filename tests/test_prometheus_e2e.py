"""The real Prometheus server, scraping real serving processes and the real operator,
evaluating the real rules and every query of the shipped Grafana dashboard.

A cold process serves without a generation (its ``KERNELCACHE_DIR`` names none, as when the
init-container did not run) and compiles the example CuTe-DSL kernels; a warm one serves
from a generation ``kernelcache build`` published. The operator reconciles a KernelCache
whose compile Job ends (the emulator's kubelet is played by the test). With 1 s scrape and
evaluation intervals, the KernelCacheColdCompile alert of ``prometheus/kernelcache-rules.yaml``
(no ``for``) must fire for the cold process within seconds, and never for the warm one; and
every panel query of ``prometheus/kernelcache-dashboard.json`` must return series.
"""

from __future__ import annotations

import json
import re
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

from kernelcache.controller.kube import jobs_path, kernelcache_path
from tests.conftest import (
    REPO,
    SMALL_WORKLOAD,
    DemoBuild,
    free_port,
    kernelcache_doc,
    needs_cute,
    scaled,
    subprocess_env,
    system_tool,
)
from tests.operator_process import api_harness, finish_job, result_generation

RULES = REPO / "prometheus" / "kernelcache-rules.yaml"
DASHBOARD = REPO / "prometheus" / "kernelcache-dashboard.json"
HELPER = Path(__file__).parent / "helpers" / "runtime_serve.py"
DEADLINE_S = 60

pytestmark = [pytest.mark.slow, needs_cute]


@contextmanager
def serving(**env: str) -> Iterator[int]:
    """A serving process that ran the example kernels with ``env``; yields its port."""
    base = {k: v for k, v in subprocess_env().items() if not k.startswith("KERNELCACHE_")}
    proc = subprocess.Popen(
        [sys.executable, str(HELPER), "--serve", "--cute", json.dumps(SMALL_WORKLOAD)],
        env={**base, **env},
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
        proc.wait(timeout=scaled(30))


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


@contextmanager
def operator_with_a_finished_job(tmp: Path) -> Iterator[tuple[int, str]]:
    """The operator, its /metrics port, once a KernelCache's compile Job published; yields the
    port and the generation published."""
    port = free_port()
    tmp.mkdir()
    with api_harness(tmp) as api:
        operator = api.start_operator(METRICS_PORT=str(port))
        api.kube.request("POST", kernelcache_path("ml"), body=kernelcache_doc("dash", "ml"))
        (job,) = wait_for_jobs(api.kube)
        finish_job(api.kube, job, succeeded=True)

        def ready() -> bool:
            (kc,) = api.kube.list(kernelcache_path("ml"))
            return (kc.get("status") or {}).get("phase") == "Ready"

        deadline = time.monotonic() + DEADLINE_S
        while not ready():
            assert time.monotonic() < deadline, operator.tail()
            time.sleep(0.2)
        yield port, result_generation(job["metadata"]["name"])
        operator.stop()


def wait_for_jobs(kube: Any) -> list[dict]:
    deadline = time.monotonic() + DEADLINE_S
    while not (jobs := kube.list(jobs_path("ml"))):
        assert time.monotonic() < deadline, "no compile Job"
        time.sleep(0.2)
    return list(jobs)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory, demo_build: DemoBuild) -> Iterator[dict[str, Any]]:
    """Prometheus scraping a cold and a warm serving process and the operator."""
    tmp = tmp_path_factory.mktemp("e2e")
    generation = demo_build.generation
    with ExitStack() as stack:
        cold = stack.enter_context(
            serving(
                KERNELCACHE_DIR=str(tmp / "not-materialized"),
                KERNELCACHE_CUTE_DSL_DIR=str(tmp / "cold-cache"),
            )
        )
        warm = stack.enter_context(serving(KERNELCACHE_DIR=str(generation)))
        operator, published = stack.enter_context(operator_with_a_finished_job(tmp / "api"))
        targets = {"cold": cold, "warm": warm, "operator": operator}
        server = stack.enter_context(prometheus(tmp, targets))
        yield {
            "server": server,
            "log": tmp / "prometheus.log",
            "served": generation.name,
            "published": published,
        }


def test_a_cold_compile_fires_the_alert_and_a_warm_process_does_not(scraped):
    server, log = scraped["server"], scraped["log"]

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
    assert firing[0]["annotations"]["runbook"] == "docs/operations.md#kernelcachecoldcompile"

    # The warm process was scraped and the rules evaluated since: no alert names it.
    def warm_hits() -> list[dict]:
        query = 'kernelcache_cache_hits_total{job="warm",toolchain="cute-dsl"} == 2'
        return list(api(server, "query", query=query)["result"])

    wait_for("the warm process's two cache hits scraped", warm_hits, log)
    time.sleep(3)  # a few more evaluations
    alerts = api(server, "alerts")["alerts"]
    assert [a for a in alerts if a["labels"].get("job") == "warm"] == []


def as_sent(expr: str) -> str:
    """A query as Grafana sends it with every variable at All (``.*``: an absent label too)."""
    expr = expr.replace("$__rate_interval", "30s")
    for name in ("namespace", "kernelcache", "arch"):
        expr = expr.replace(f"${name}", ".*")
    return expr


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard, as Grafana would send them."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], as_sent(target["expr"]))
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def test_every_dashboard_query_returns_series(scraped):
    server, log = scraped["server"], scraped["log"]
    queries = panel_queries()
    assert len(queries) >= 9
    results = {}
    for title, query in queries:
        results[query] = wait_for(
            f"series for {title!r}: {query}",
            lambda q=query: api(server, "query", query=q)["result"],
            log,
        )

    def labels(fragment: str) -> list[dict[str, str]]:
        (query,) = [q for _, q in queries if fragment in q]
        return [series["metric"] for series in results[query]]

    assert {"toolchain": "cute-dsl", "kernel": "demo_kernels:add"} in labels(
        "sum by (toolchain, kernel) (kernelcache_cold_compiles_total{"
    )
    assert {"toolchain": "cute-dsl"} in labels("kernelcache_cache_hits_total")
    served = labels("kernelcache_generation_info")
    assert [(m["arch"], m["generation"]) for m in served] == [("sm_90a", scraped["served"])]
    assert {"reason": "missing_generation"} in labels("kernelcache_verify_failures_total")
    published = labels("kernelcache_operator_generation_info")
    assert published == [
        {"namespace": "ml", "name": "dash", "arch": "sm_90a", "generation": scraped["published"]}
    ]
    assert {"arch": "sm_90a", "result": "succeeded"} in labels(
        "kernelcache_operator_compile_job_seconds_sum"
    )
    dashboard = json.loads(DASHBOARD.read_text())
    for variable in dashboard["templating"]["list"][1:]:  # each offers what the operator published
        selector, label = re.fullmatch(
            r"label_values\((.+), (\w+)\)", variable["definition"]
        ).groups()
        found = api(server, "query", query=as_sent(selector))["result"]
        assert [s["metric"][label] for s in found], variable["name"]
    phases = api(server, "query", query="sum by (phase) (kernelcache_operator_kernelcaches)")
    assert {s["metric"]["phase"]: s["value"][1] for s in phases["result"]}["Ready"] == "1"
