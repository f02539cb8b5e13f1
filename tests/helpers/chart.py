"""The chart rendered by the real helm, for the chart and least-privilege tests."""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml
from tests.conftest import REPO, scaled

CHART = REPO / "charts" / "kernelcache"
HELM = REPO / ".tools" / "bin" / "helm"
NAMESPACE = "kernelcache-system"
# Value sets rendered by the tests, by name.
VALUES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cert-manager": {"certManager": {"enabled": True}},
    "prometheus-operator": {
        "prometheus": {
            "servicemonitor": {"enabled": True},
            "podmonitor": {"enabled": True},
            "prometheusrule": {"enabled": True},
        }
    },
    # The same values on a cluster without the Prometheus Operator's CRDs.
    "prometheus-operator-absent": {
        "prometheus": {
            "servicemonitor": {"enabled": True},
            "podmonitor": {"enabled": True},
            "prometheusrule": {"enabled": True},
        }
    },
    "prometheus-off": {"prometheus": {"enabled": False}},
    "grafana-dashboard": {"prometheus": {"grafanadashboard": {"enabled": True}}},
    "crds-off": {"crds": {"enabled": False}},
    "namespaced": {"operator": {"watchNamespaces": ["team-a", "team-b"]}},
}

# The API groups each value set's cluster serves beyond the built-in ones (helm template's
# --api-versions, as .Capabilities reads them from a live cluster).
API_VERSIONS: dict[str, tuple[str, ...]] = {"prometheus-operator": ("monitoring.coreos.com/v1",)}


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HELM), *args], capture_output=True, text=True, timeout=scaled(120), check=False
    )


def values_args(values: dict[str, Any], tmp: Path) -> list[str]:
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values), encoding="utf-8")
    return ["-f", str(path)]


@functools.cache
def render_text(name: str, extra: str = "{}") -> subprocess.CompletedProcess[str]:
    """``helm template`` of value set ``name`` with the JSON ``extra`` merged at the top level;
    cached, since most tests read the same few renders."""
    values = {**VALUES[name], **json.loads(extra)}
    with tempfile.TemporaryDirectory() as tmp:
        args = values_args(values, Path(tmp))
        for api in API_VERSIONS.get(name, ()):
            args += ["--api-versions", api]
        return helm("template", "kc", str(CHART), "--namespace", NAMESPACE, *args)


def render(name: str, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The manifests of value set ``name`` (plus ``extra`` at the top level); it must render."""
    done = render_text(name, json.dumps(extra or {}))
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def granted_rules(docs: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    granted = set()
    for role in (d for d in docs if d["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            assert not set(rule) - {"apiGroups", "resources", "verbs"}, rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((group, resource, verb))
    return granted
