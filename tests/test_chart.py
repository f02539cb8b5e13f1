"""The Helm chart (``charts/kernelcache``), rendered by the real helm.

``helm lint --strict``, then ``helm template`` over named value sets with assertions on what
is and is not rendered; every built-in manifest checked by ``kubernetes-validate --strict``
against Kubernetes 1.35; the CRD, peering CRDs and alert rules compared with their one
source; the example KernelCaches checked against the CRD's schema; the RBAC compared with
the table of what the operator's code does.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelcache.controller.config import OperatorConfig
from kernelcache.controller.manifests import peering_crds
from kernelcache.crd import crd_manifest, crd_yaml
from tests.conftest import system_tool
from tests.helpers.chart import (
    CHART,
    HELM,
    NAMESPACE,
    REPO,
    VALUES,
    granted_rules,
    helm,
    render,
    render_text,
    values_args,
)

KUBERNETES_VERSION = "1.35.0"

pytestmark = pytest.mark.skipif(
    not HELM.exists(), reason="helm is not installed: run scripts/install-kube-tools.sh"
)


CUSTOM_KINDS = {
    # kind: the group its apiVersion must be in (no schema for these in kubernetes-validate)
    "Certificate": "cert-manager.io",
    "Issuer": "cert-manager.io",
    "ServiceMonitor": "monitoring.coreos.com",
    "PodMonitor": "monitoring.coreos.com",
    "PrometheusRule": "monitoring.coreos.com",
}

# Every (apiGroup, resource) the operator may touch, the verbs, and where the code does it.
# The rendered RBAC must grant nothing else, and must grant all of it (in the mode that needs
# it: "all" in both, "cluster" when watching every namespace, "namespaced" otherwise).
USED: list[tuple[str, str, set[str], str]] = [
    # get: handle_reconcile_kernelcache (re-read on conflict), handle_update_job (the Job's
    # owner), webhook.lookup (the pod's KernelCache); list: handle_update_secret (those
    # signing with a changed Secret); list/watch: kopf's watch behind
    # main.reconcile/delete; patch: kopf's finalizer and progress annotations.
    ("kernelcache.dev", "kernelcaches", {"get", "list", "watch", "patch"}, "all"),
    # patch: handle_reconcile_kernelcache writes observed state to .../status.
    ("kernelcache.dev", "kernelcaches/status", {"patch"}, "all"),
    # list/watch: kopf index and event handler on compile Jobs (main.compile_jobs,
    # job_changed); list/get/delete/create: handle_delete_kernelcache (stop compiles, cleanup
    # Job); create/delete: handle_reconcile_kernelcache (new and stale compile Jobs).
    ("batch", "jobs", {"get", "list", "watch", "create", "delete"}, "all"),
    # list: the compile pods' results and why one cannot start (reconcile), running compiles
    # (delete).
    ("", "pods", {"list"}, "all"),
    # create: reconcile makes the cache claim; delete: the finalizer drops an owned claim.
    ("", "persistentvolumeclaims", {"create", "delete"}, "all"),
    # create: reconcile writes the spec ConfigMap the compile Jobs read; create/patch:
    # handle_update_nodes writes the node map serving pods read; get/create/patch: the
    # published record (reconcile), delete: the finalizer drops it with the data, patch: or
    # keeps the spec in it; get: webhook.lookup reads that kept spec for a deleted one;
    # list/watch: node_map_changed (main) writes a deleted node map again.
    ("", "configmaps", {"get", "list", "watch", "create", "patch", "delete"}, "all"),
    # list/watch: the gpu_nodes index and node_changed handler (main).
    ("", "nodes", {"list", "watch"}, "all"),
    # create: kopf.event in main._post and main.delete (and kopf's own handler events), and
    # main.inject's Warning about a pod of a deleted KernelCache;
    # list: a compile pod's Warning events, when its status does not say why it cannot start
    # (handle_reconcile_kernelcache._stuck).
    ("", "events", {"create", "list"}, "all"),
    # get: controller.signing reads the signing Secret a KernelCache names (reconcile);
    # list/watch: the secret_changed handler (main) follows a rotated key.
    ("", "secrets", {"get", "list", "watch"}, "all"),
    # list/watch: kopf's runtime discovery of CRDs (kopf._core.reactor.observation).
    ("apiextensions.k8s.io", "customresourcedefinitions", {"list", "watch"}, "all"),
    # list/watch: kopf's namespace observation when given namespaces (falls back if denied).
    ("", "namespaces", {"list", "watch"}, "namespaced"),
    # create: handle_start_operator.ensure_peering; list/watch/patch: kopf's peering.
    ("kopf.dev", "clusterkopfpeerings", {"list", "watch", "patch", "create"}, "cluster"),
    ("kopf.dev", "kopfpeerings", {"list", "watch", "patch", "create"}, "namespaced"),
]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(doc["kind"] for doc in docs)


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def env_of(docs: list[dict[str, Any]]) -> dict[str, str]:
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


# --- lint and rendering ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VALUES))
def test_helm_lint_strict(name: str, tmp_path: Path) -> None:
    done = helm("lint", "--strict", str(CHART), *values_args(VALUES[name], tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr


def test_defaults_render_operator_webhooks_crds_and_a_helm_certificate() -> None:
    docs = render("defaults")
    assert kinds(docs) == sorted(
        ["ServiceAccount", "Secret", "Deployment", "Service", "Service"]
        + ["CustomResourceDefinition"] * 3
        + ["ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding"]
        + ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
    )
    secret = one(docs, "Secret")
    assert secret["type"] == "kubernetes.io/tls"
    for kind, path in [
        ("MutatingWebhookConfiguration", "/inject"),
        ("ValidatingWebhookConfiguration", "/validate"),
    ]:
        config = one(docs, kind)
        assert "annotations" not in config["metadata"]
        (hook,) = config["webhooks"]
        assert hook["clientConfig"]["service"]["path"] == path
        assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
        assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    inject = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    assert inject["objectSelector"] == {
        "matchExpressions": [{"key": "kernelcache.dev/cache", "operator": "Exists"}]
    }
    assert inject["rules"][0]["operations"] == ["CREATE"]
    assert inject["rules"][0]["resources"] == ["pods"]
    validate = one(docs, "ValidatingWebhookConfiguration")["webhooks"][0]
    assert validate["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    assert validate["rules"][0]["resources"] == ["kernelcaches"]
    for crd in (d for d in docs if d["kind"] == "CustomResourceDefinition"):
        assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_deployment_env_is_a_valid_operator_config_and_the_pod_is_locked_down() -> None:
    docs = render("defaults")
    env = env_of(docs)
    config = OperatorConfig.from_env(env)  # raises on an unknown or bad variable
    assert config.webhook_port == 9443 and config.metrics_port == 9090
    assert config.webhook_tls_dir == "/etc/kernelcache/webhook-tls"
    assert config.peering == "kernelcache" and config.namespaces == ()
    assert config.peering_lifetime_seconds == 10
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.liveness == f"http://0.0.0.0:{ports['healthz']}/healthz"
    assert ports["webhook"] == config.webhook_port
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"] and container["resources"]["limits"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["webhook-tls"] == config.webhook_tls_dir
    # The peering identity is the pod's: a restarted container takes its own place back.
    (pod_id,) = [e for e in container["env"] if e["name"] == "POD_ID"]
    assert pod_id["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_fix_store_ownership_reaches_the_operator_config() -> None:
    assert OperatorConfig.from_env(env_of(render("defaults"))).fix_store_ownership is False
    docs = render("defaults", {"operator": {"fixStoreOwnership": True}})
    assert OperatorConfig.from_env(env_of(docs)).fix_store_ownership is True


def test_cert_manager_issues_the_certificate_and_injects_the_ca() -> None:
    docs = render("cert-manager")
    assert "Secret" not in kinds(docs)
    certificate = one(docs, "Certificate")
    assert one(docs, "Issuer")["spec"] == {"selfSigned": {}}
    service = one(docs, "Service", "kc-kernelcache-webhook")["metadata"]["name"]
    assert f"{service}.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    source = f"{NAMESPACE}/{certificate['metadata']['name']}"
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        config = one(docs, kind)
        assert config["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": source}
        assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    volumes = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"secretName": certificate["spec"]["secretName"]} in [v.get("secret") for v in volumes]


def test_prometheus_operator_on_renders_servicemonitor_and_rules() -> None:
    docs = render("prometheus-operator")
    monitor = one(docs, "ServiceMonitor")
    metrics = one(docs, "Service", "kc-kernelcache-metrics")
    assert monitor["spec"]["endpoints"][0]["port"] == metrics["spec"]["ports"][0]["name"]
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True  # the KernelCache's namespace
    assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(
        metrics["metadata"]["labels"].items()
    )
    one(docs, "PrometheusRule")


def test_the_podmonitor_scrapes_the_labelled_serving_pods() -> None:
    from kernelcache.contract import LABEL_CACHE

    monitor = one(render("prometheus-operator"), "PodMonitor", "kc-kernelcache-serving")
    labels = monitor["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "serving"  # not the operator's
    assert labels["app.kubernetes.io/instance"] == "kc"
    spec = monitor["spec"]
    assert spec["selector"] == {"matchExpressions": [{"key": LABEL_CACHE, "operator": "Exists"}]}
    assert spec["namespaceSelector"] == {"any": True}
    (endpoint,) = spec["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("kc-metrics", "/metrics")
    pod_label = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", LABEL_CACHE)
    assert {"sourceLabels": [pod_label], "targetLabel": "kernelcache"} in endpoint["relabelings"]
    watched = {"operator": {"watchNamespaces": ["team-a"]}}
    spec = one(render("prometheus-operator", watched), "PodMonitor")["spec"]
    assert spec["namespaceSelector"] == {"matchNames": ["team-a"]}


# A series selector of a query: the metric (a histogram's by its base name), its matchers.
SELECTOR = re.compile(r"(kernelcache_\w+?)(?:_sum|_count|_bucket)?(?:\{([^}]*)\})?[\[)]")


def test_the_dashboard_filters_each_panel_by_its_variables() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"namespace", "kernelcache", "arch"} <= set(variables)
    for name in ("namespace", "kernelcache", "arch"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    # What each series can be filtered by: the serving pods' through the PodMonitor's target
    # labels, the generation info by its own labels, the compile Jobs by arch.
    serving = {"namespace": "$namespace", "kernelcache": "$kernelcache"}
    info = {"namespace": "$namespace", "name": "$kernelcache", "arch": "$arch"}
    wanted = {
        "kernelcache_generation_info": info,
        "kernelcache_operator_generation_info": info,
        "kernelcache_operator_compile_job_seconds": {"arch": "$arch"},
        "kernelcache_operator_kernelcaches": {},
    }
    checked = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for metric, matchers in SELECTOR.findall(target["expr"]):
                found = dict(re.findall(r'(\w+)=~"(\$\w+)"', matchers))
                assert found == wanted.get(metric, serving), f"{panel['title']}: {metric}"
                checked += 1
    assert checked >= 12


@pytest.mark.parametrize("registry", [None, "registry.example.com/ml"])
def test_the_notes_say_how_to_get_unpublished_images(tmp_path: Path, registry: str | None) -> None:
    values = {}
    if registry is not None:
        values = {"image": {"repository": f"{registry}/kernelcache-operator"},
                  "operator": {"initImage": f"{registry}/kernelcache-init:0.1.0"}}  # fmt: skip
    done = helm("install", "kernelcache", str(CHART), "--namespace", NAMESPACE,
                "--dry-run=client", *values_args(values, tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:\n", 1)[1]
    operator = f"{registry or 'ghcr.io/kernelcache'}/kernelcache-operator:0.1.0"
    assert f"Images: operator {operator}, init-container " in notes
    building = "make images && make load-images CLUSTER=kind" in notes
    assert building is (registry is None)


def test_the_alerts_runbooks_follow_the_runbook_base_value() -> None:
    source = yaml.safe_load((REPO / "prometheus" / "kernelcache-rules.yaml").read_text())
    default = VALUES["prometheus-operator"]
    for base in (None, "https://wiki.example.com/kernelcache/runbooks"):
        rule = {"prometheusrule": {"enabled": True, "runbookBaseURL": base}} if base else {}
        values = {"prometheus": {**default["prometheus"], **rule}}
        docs = render("prometheus-operator", values)
        groups = one(docs, "PrometheusRule")["spec"]["groups"]
        rules = {r["alert"]: r["annotations"] for g in groups for r in g["rules"]}
        # What the promtool-tested rules say (a path to the section), and a link only when a
        # base is set: no default URL that may not exist.
        assert {a: r["runbook"] for a, r in rules.items()} == {
            r["alert"]: r["annotations"]["runbook"] for g in source["groups"] for r in g["rules"]
        }
        links = {a: r.get("runbook_url") for a, r in rules.items()}
        if base is None:
            assert set(links.values()) == {None}
        else:
            assert links == {alert: f"{base}#{alert.lower()}" for alert in rules}


@pytest.mark.parametrize("name", ["defaults", "prometheus-off", "prometheus-operator-absent"])
def test_no_monitors_or_prometheusrule_unless_asked_and_served(name: str) -> None:
    """Asked for on a cluster without the Prometheus Operator's CRDs, they are left out: the
    API server would refuse the whole install ("no matches for kind ServiceMonitor")."""
    docs = render(name)
    assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule"} & set(kinds(docs))
    if name == "prometheus-off":
        assert env_of(docs)["KERNELCACHE_OPERATOR_METRICS_PORT"] == "0"
        assert [d for d in docs if d["kind"] == "Service"] == [
            one(docs, "Service", "kc-kernelcache-webhook")
        ]


def test_crds_off_renders_no_crd_and_keep_off_drops_the_annotation() -> None:
    assert "CustomResourceDefinition" not in kinds(render("crds-off"))
    for crd in (
        d
        for d in render("defaults", {"crds": {"keep": False}})
        if d["kind"] == "CustomResourceDefinition"
    ):
        assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})


def test_namespaced_binds_only_in_the_watched_namespaces() -> None:
    docs = render("namespaced")
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRoleBinding"] == [
        "kc-kernelcache-cluster"
    ]
    assert OperatorConfig.from_env(env_of(docs)).namespaces == ("team-a", "team-b")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"prometheus": {"enabled": False, "servicemonitor": {"enabled": True}}},
            "prometheus.servicemonitor.enabled needs prometheus.enabled",
        ),
        (
            {"prometheus": {"enabled": False, "prometheusrule": {"enabled": True}}},
            "prometheus.prometheusrule.enabled needs prometheus.enabled",
        ),
        (
            {"prometheus": {"enabled": False, "podmonitor": {"enabled": True}}},
            "prometheus.podmonitor.enabled needs prometheus.enabled",
        ),
        ({"prometheus": {"podmonitor": {"portName": "kernelcache-metrics"}}}, "portName"),
        ({"replicaCount": 2, "operator": {"peering": ""}}, "needs operator.peering"),
        ({"webhook": {"port": 9090}}, "must differ"),
        (
            {"operator": {"extraEnv": {"KERNELCACHE_OPERATOR_WEBHOOK_PORT": "1"}}},
            "set by a dedicated value",
        ),
        ({"serviceAccount": {"create": False}}, "serviceAccount.name is required"),
        ({"unknown": 1}, "additional properties 'unknown' not allowed"),
        ({"webhook": {"failurePolicy": "Maybe"}}, "failurePolicy"),
    ],
)
def test_contradictory_or_unknown_values_fail_the_render(
    values: dict[str, Any], message: str
) -> None:
    done = render_text("defaults", json.dumps(values))
    assert done.returncode != 0
    assert message in done.stderr


def commented_keys(text: str) -> dict[str, bool]:
    """Each key of a values file, by its dotted path -> whether a comment line is above it."""
    found: dict[str, bool] = {}
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in text.splitlines():
        if key := re.match(r"( *)([A-Za-z]\w*):", line):
            indent = len(key[1])
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, key[2])]
            found[".".join(k for _, k in stack)] = previous.lstrip().startswith("#")
        if line.strip():
            previous = line
    return found


def test_every_value_has_a_comment_and_the_schema_knows_exactly_the_values() -> None:
    text = (CHART / "values.yaml").read_text()
    commented = commented_keys(text)
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(values: dict[str, Any], node: dict[str, Any], path: str) -> None:
        assert node.get("additionalProperties") is False, f"{path or 'the root'} takes any key"
        assert set(values) == set(node["properties"]), f"{path}: values and schema differ"
        for key, value in values.items():
            child, where = node["properties"][key], f"{path}{key}"
            if isinstance(value, dict) and "properties" in child:
                walk(value, child, f"{where}.")
            else:  # a value, or a free-form object: said what it is for
                assert commented[where], f"{where}: no comment above it"

    walk(yaml.safe_load(text), schema, "")


# --- validity of what is rendered -------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VALUES))
def test_rendered_manifests_are_valid_kubernetes(name: str) -> None:
    """Built-in kinds: kubernetes-validate's strict schemas for 1.35 (unknown fields fail).
    Custom resources have no schema there: only their group, name and spec shape are checked
    here (PrometheusRule's groups get promtool below)."""
    utils = pytest.importorskip(
        "kubernetes_validate.utils",
        reason="kubernetes-validate is not installed (add it to the dev extra)",
    )
    for doc in render(name):
        what = f"{doc['kind']} {doc['metadata'].get('name')}"
        if doc["kind"] in CUSTOM_KINDS:
            assert doc["apiVersion"].split("/")[0] == CUSTOM_KINDS[doc["kind"]], what
            assert doc["metadata"]["name"] and isinstance(doc["spec"], dict), what
            continue
        try:
            utils.validate(doc, KUBERNETES_VERSION, strict=True)
        except utils.ValidationError as exc:
            pytest.fail(f"{what}: {exc.message} at {list(exc.path)}")


def _metadata_free(obj: dict[str, Any]) -> dict[str, Any]:
    obj = json.loads(json.dumps(obj))
    obj["metadata"] = {"name": obj["metadata"]["name"]}
    return obj


def test_chart_crd_is_the_generated_crd() -> None:
    """files/ holds a copy of crds/ (helm reads no file outside the chart); both must be
    exactly what kernelcache.crd generates, and the rendered CRD its body."""
    copy = CHART / "files" / "kernelcache.dev_kernelcaches.yaml"
    assert copy.read_text(encoding="utf-8") == crd_yaml(), (
        f"regenerate with: python -m kernelcache.crd > {copy.relative_to(REPO)}"
    )
    rendered = one(render("defaults"), "CustomResourceDefinition", "kernelcaches.kernelcache.dev")
    assert _metadata_free(rendered) == _metadata_free(crd_manifest())


def test_chart_peering_crds_are_the_operators() -> None:
    rendered = [
        _metadata_free(d)
        for d in render("defaults")
        if d["kind"] == "CustomResourceDefinition" and d["spec"]["group"] == "kopf.dev"
    ]
    assert rendered == [_metadata_free(crd) for crd in peering_crds()]


def test_chart_rules_are_the_tested_rules(tmp_path: Path) -> None:
    source = REPO / "prometheus" / "kernelcache-rules.yaml"
    copy = CHART / "files" / "kernelcache-rules.yaml"
    assert copy.read_bytes() == source.read_bytes(), f"copy {source.name} into {copy.parent}"
    groups = one(render("prometheus-operator"), "PrometheusRule")["spec"]["groups"]
    assert groups == yaml.safe_load(source.read_text(encoding="utf-8"))["groups"]
    promtool = system_tool("promtool")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}), encoding="utf-8")
    done = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_example_kernelcaches_match_the_crd_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    crd = one(render("defaults"), "CustomResourceDefinition", "kernelcaches.kernelcache.dev")
    schemas = {v["name"]: v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"]}
    checked = 0
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if not doc or doc.get("kind") != "KernelCache":
                continue
            version = doc["apiVersion"].split("/")[1]
            errors = list(jsonschema.Draft7Validator(schemas[version]).iter_errors(doc))
            assert not errors, f"{path.name}: {errors[0].message} at {list(errors[0].path)}"
            checked += 1
    assert checked >= 2


# --- RBAC -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["defaults", "namespaced"])
def test_rbac_grants_exactly_what_the_code_uses(name: str) -> None:
    granted = granted_rules(render(name))
    mode = "namespaced" if name == "namespaced" else "cluster"
    wildcards = {g for g in granted if "*" in g}
    assert not wildcards, f"wildcards: {sorted(wildcards)}"
    allowed = {(group, resource, verb) for group, resource, verbs, _ in USED for verb in verbs}
    needed = {
        (group, resource, verb)
        for group, resource, verbs, when in USED
        if when in ("all", mode)
        for verb in verbs
    }
    assert granted - allowed == set(), "granted but not used by the code"
    assert needed - granted == set(), "used by the code but not granted"


# --- the Grafana dashboard --------------------------------------------------------------------

DASHBOARD = REPO / "prometheus" / "kernelcache-dashboard.json"


def test_grafana_dashboard_configmap_carries_the_tested_dashboard() -> None:
    copy = CHART / "files" / DASHBOARD.name
    assert copy.read_bytes() == DASHBOARD.read_bytes(), f"copy {DASHBOARD.name} into {copy.parent}"
    grafana = {"grafanadashboard": {"enabled": True, "labels": {"team": "gpu"}}}
    docs = render("defaults", {"prometheus": {**VALUES["defaults"], **grafana}})
    configmap = one(docs, "ConfigMap", "kc-kernelcache-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["labels"]["team"] == "gpu"
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert json.loads(configmap["data"]["kernelcache.json"]) == json.loads(DASHBOARD.read_text())
    elsewhere = {"grafanadashboard": {"enabled": True, "namespace": "monitoring"}}
    moved = one(
        render("defaults", {"prometheus": elsewhere}), "ConfigMap", "kc-kernelcache-dashboard"
    )
    assert moved["metadata"]["namespace"] == "monitoring"


def test_no_grafana_dashboard_unless_asked() -> None:
    names = [d["metadata"]["name"] for d in render("defaults") if d["kind"] == "ConfigMap"]
    assert "kc-kernelcache-dashboard" not in names
    done = render_text("defaults", json.dumps({"prometheus": {"grafanadashboard": {"on": True}}}))
    assert done.returncode != 0 and "additional properties 'on' not allowed" in done.stderr


def test_the_notes_name_the_monitors_left_out_for_want_of_their_crds() -> None:
    """helm install on a cluster without the Prometheus Operator (a client dry run serves
    the built-in APIs only): the monitors asked for are left out, and the notes say so."""
    args = ["--set", "prometheus.servicemonitor.enabled=true",
            "--set", "prometheus.prometheusrule.enabled=true"]  # fmt: skip
    done = helm("install", "kernelcache", str(CHART), "--namespace", NAMESPACE,
                "--dry-run=client", *args)  # fmt: skip
    assert done.returncode == 0, done.stderr
    notes = " ".join(done.stdout.split("NOTES:\n", 1)[1].split())
    assert "Not installed: prometheus.servicemonitor, prometheus.prometheusrule" in notes
    assert "kind: ServiceMonitor" not in done.stdout
