"""The KernelCache CRD and its API reference (``docs/api.md``), generated from the models of
``kernelcache.spec``; run ``python -m kernelcache.crd [--api-docs] [--check FILE]`` (what
``make crds`` runs, and a test fails when the committed files drift).
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import zip_longest
from pathlib import Path
from typing import Any

import yaml

from kernelcache.spec import (
    API_VERSION,
    GROUP,
    KIND,
    NAME_MAX,
    PATTERN_HINTS,
    PLURAL,
    VERSION,
    B12xWorkload,
    KernelCache,
)

CRD_PATH = "crds/kernelcache.dev_kernelcaches.yaml"
API_DOCS_PATH = "docs/api.md"


# OpenAPI keywords a structural schema may carry; anything else is a generator bug.
_STRUCTURAL_KEYS = {
    "type", "description", "properties", "required", "items", "additionalProperties",
    "enum", "pattern", "minimum", "maximum", "minLength", "maxLength", "minItems",
    "maxItems", "multipleOf", "default", "x-kubernetes-preserve-unknown-fields",
    "anyOf", "x-kubernetes-int-or-string",
}  # fmt: skip


def _without_none(value: Any) -> Any:
    """Drop null members: Kubernetes rejects a default that holds nulls."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one pydantic JSON-schema node into a Kubernetes structural schema node."""
    node = {k: v for k, v in node.items() if k != "title"}
    if ref := node.pop("$ref", None):
        return _structural({**defs[ref.rsplit("/", 1)[1]], **node}, defs)
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        # `X | None`: Kubernetes prunes nulls, so an optional X is just X.
        options = [o for o in node.pop("anyOf") if o != {"type": "null"}]
        if len(options) != 1:
            raise TypeError(f"only `X | None` unions fit a structural schema: {options}")
        return _structural({**options[0], **node}, defs)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "default" in node:
        if node["default"] is None:
            del node["default"]
        else:
            node["default"] = _without_none(node["default"])
    if "properties" in node:
        node["properties"] = {k: _structural(v, defs) for k, v in node["properties"].items()}
    if "items" in node:
        node["items"] = _structural(node["items"], defs)
    extra = node.pop("additionalProperties", False)
    if extra is True:
        node["x-kubernetes-preserve-unknown-fields"] = True
    elif isinstance(extra, dict):
        node["additionalProperties"] = _structural(extra, defs)
    if unknown := set(node) - _STRUCTURAL_KEYS:
        raise TypeError(f"keywords not supported in a structural schema: {sorted(unknown)}")
    return node


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition for KernelCache, generated from the models."""
    schema = KernelCache.model_json_schema(by_alias=True)
    root = _structural(schema, schema.pop("$defs", {}))
    # The API server owns these three; it rejects any constraint on metadata, and explains
    # metadata itself (ObjectMeta).
    props = root["properties"]
    props.update(
        apiVersion={"type": "string", "description": props["apiVersion"]["description"]},
        kind={"type": "string", "description": props["kind"]["description"]},
        metadata={"type": "object"},
    )
    root["required"] = ["spec"]
    # Only a rule at the root may constrain metadata.name (the API server allows 253).
    root["x-kubernetes-validations"] = [
        {
            "rule": f"self.metadata.name.size() <= {NAME_MAX}",
            "message": f"metadata.name: at most {NAME_MAX} characters: serving pods name "
            "their KernelCache in a label, and a label value is at most that long",
        }
    ]
    # (name, type, JSONPath, priority): 0 in `kubectl get kc`, 1 only with `-o wide`.
    columns = [
        ("Model", "string", ".spec.model", 0),
        ("Serving", "string", ".status.servingArches", 0),
        ("Ready", "string", ".status.readyArches", 0),
        ("Phase", "string", ".status.phase", 0),
        ("Age", "date", ".metadata.creationTimestamp", 0),
        ("Arches", "string", ".status.arches[*].arch", 1),
        ("Generations", "string", ".status.arches[*].generation", 1),
        ("Stamps", "string", ".status.arches[*].stampDigest", 1),
        # Degraded's message names what failed, or counts the ready arches when nothing did.
        ("Message", "string", '.status.conditions[?(@.type=="Degraded")].message', 1),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["kc"],
                "categories": ["kernelcache"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": name, "type": type_, "jsonPath": path}
                        | ({"priority": priority} if priority else {})
                        for name, type_, path, priority in columns
                    ],
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The committed CRD file's exact text."""
    header = (
        "# Generated from kernelcache.spec; do not edit. "
        f"Regenerate with: python -m kernelcache.crd > {CRD_PATH}\n"
    )
    return header + yaml.safe_dump(crd_manifest(), sort_keys=True, width=100)


def _type_of(node: dict[str, Any]) -> str:
    """A schema node's type as the reference shows it: ``[]GpuClass``-like, with constraints."""
    if node.get("x-kubernetes-int-or-string"):
        kind = "integer or string"
    else:
        kind = node.get("type", "any")
    if kind == "array":
        kind = f"[]{_type_of(node['items']).split(' (', 1)[0]}"
    elif kind == "object" and isinstance(node.get("additionalProperties"), dict):
        kind = f"map[string]{_type_of(node['additionalProperties']).split(' (', 1)[0]}"
    notes = []
    if "enum" in node:
        notes.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    if node.get("pattern") in PATTERN_HINTS:
        notes.append(PATTERN_HINTS[node["pattern"]])
    for key, shown in (("minimum", ">="), ("maximum", "<="), ("multipleOf", "multiple of"),
                       ("minItems", "items >="),
                       ("minLength", "length >="), ("maxLength", "length <=")):  # fmt: skip
        if key in node:
            notes.append(f"{shown} {node[key]}")
    return f"{kind} ({'; '.join(notes)})" if notes else kind


def _reference_sections(
    node: dict[str, Any], path: str, sections: list[tuple[str, dict[str, Any]]]
) -> None:
    """Depth first: every object with properties becomes one section, named by its path."""
    sections.append((path, node))
    for name, child in node.get("properties", {}).items():
        while child.get("type") == "array":
            child, name = child["items"], name + "[]"
        if "properties" in child:
            _reference_sections(child, f"{path}.{name}", sections)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def api_reference() -> str:
    """``docs/api.md``: every field of the CRD with its type, default and description."""
    root = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    lines = [
        "<!-- Generated from kernelcache.spec; do not edit. Regenerate with: make crds -->",
        f"# API reference: {KIND} ({API_VERSION})",
        "",
        _cell(root.get("description", "")),
        "Short name `kc`; `kubectl explain kc.spec` shows the same descriptions.",
        "",
    ]
    sections: list[tuple[str, dict[str, Any]]] = []
    _reference_sections(root, KIND, sections)
    b12x = B12xWorkload.model_json_schema(by_alias=True)
    sections.append(
        ("b12x workload (spec.warmers[].workload of a b12x warmer)", _structural(b12x, {}))
    )
    for title, node in sections:
        lines += [f"## `{title}`", "", _cell(node.get("description", "")), ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        required = set(node.get("required", []))
        for name, child in node["properties"].items():
            shown = f"`{name}`" + (" (required)" if name in required else "")
            default = f"`{json.dumps(child['default'])}`" if "default" in child else ""
            description = _cell(child.get("description", ""))
            lines.append(f"| {shown} | {_cell(_type_of(child))} | {default} | {description} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernelcache.crd",
        description="Print the KernelCache CRD (or its API reference) generated from the models.",
    )
    parser.add_argument(
        "--api-docs", action="store_true", help=f"the API reference ({API_DOCS_PATH})"
    )
    parser.add_argument("--check", metavar="FILE", help="exit 1 if FILE is not what is generated")
    args = parser.parse_args(argv)
    expected = api_reference() if args.api_docs else crd_yaml()
    if args.check is None:
        sys.stdout.write(expected)
        return 0
    try:
        actual = Path(args.check).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"{args.check}: cannot read: {exc}", file=sys.stderr)
        return 1
    if actual == expected:
        return 0
    pairs = zip_longest(actual.splitlines(keepends=True), expected.splitlines(keepends=True))
    line = next(i for i, (a, b) in enumerate(pairs, 1) if a != b)
    what, flag = ("API reference", " --api-docs") if args.api_docs else ("CRD", "")
    print(
        f"{args.check}: line {line} differs from the generated {what}; "
        f"regenerate with: python -m kernelcache.crd{flag} > {args.check}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
