"""The alert rules: valid for Prometheus, and each alert firing and not firing as intended.

``prometheus/kernelcache-rules.test.yaml`` holds the cases; promtool evaluates them against
``prometheus/kernelcache-rules.yaml`` (the file the Helm chart embeds).
"""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.conftest import REPO, scaled, system_tool

RULES = REPO / "prometheus" / "kernelcache-rules.yaml"
RULE_TESTS = REPO / "prometheus" / "kernelcache-rules.test.yaml"
# Where the alerts' runbooks are, by default: the operations doc in the repository.
RUNBOOK = "docs/operations.md"  # each alert's section, by path in this repository
ALERTS = {
    "KernelCacheColdCompile",
    "KernelCacheCompileBudgetExceeded",
    "KernelCacheStampMismatch",
    "KernelCacheCompileJobFailed",
    "KernelCacheNotReady",
    "KernelCacheVerifyFailed",
}


def promtool(*args: str) -> subprocess.CompletedProcess:
    command = [system_tool("promtool"), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=scaled(120))


def test_rules_are_valid():
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


def test_every_alert_fires_and_stays_quiet_as_tested():
    proc = promtool("test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_severity_a_runbook_and_both_tests():
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == ALERTS  # each one fires
    assert {c["alertname"] for c in cases if not c["exp_alerts"]} == ALERTS  # and stays quiet
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert set(rule["annotations"]) >= {"summary", "description", "runbook"}
        anchor = rule["alert"].lower()
        assert rule["annotations"]["runbook"] == f"{RUNBOOK}#{anchor}"


def anchors(markdown: str) -> set[str]:
    """The anchors a repository host makes of a document's headings (GitHub's rule:
    lowercased, punctuation dropped, spaces to hyphens)."""
    found = set()
    for line in markdown.splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            found.add(re.sub(r"[^\w\- ]", "", match[1].strip().lower()).replace(" ", "-"))
    return found


def test_the_runbook_is_a_doc_of_this_repository_and_the_chart_links_nowhere_unasked():
    """No default URL: a link to a site that may not exist is worse than a path."""
    values = yaml.safe_load((REPO / "charts" / "kernelcache" / "values.yaml").read_text())
    assert values["prometheus"]["prometheusrule"]["runbookBaseURL"] == ""
    assert (REPO / RUNBOOK).is_file()
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert not [r["alert"] for r in rules if "runbook_url" in r["annotations"]]


def test_every_runbook_link_has_its_section_in_the_operations_doc():
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    doc = (REPO / "docs" / "operations.md").read_text()
    for rule in rules:
        anchor = rule["annotations"]["runbook"].rsplit("#", 1)[1]
        assert anchor == rule["alert"].lower()
        assert f"### {rule['alert']}\n" in doc
        assert anchor in anchors(doc)
