"""A KernelCache from a file or the API server: size, encoding, YAML as the API server
reads it, one document, then the models; every problem one line naming the field."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kernelcache.documents import check_depth, depth_guard
from kernelcache.errors import SpecError, and_more
from kernelcache.spec.describe import describe, first_error, one_line
from kernelcache.spec.resource import KernelCache

# The API server refuses bodies near this size (etcd's request limit): refuse such a file
# before parsing it, rather than after minutes of YAML.
MAX_SPEC_BYTES = 1536 * 1024


class _SpecLoader(yaml.SafeLoader):
    """YAML as the API server reads JSON: a key given twice is an error, not "last wins"."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first at line {seen[key]})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def parse_kernelcache(obj: Any, source: str) -> KernelCache:
    """Validate a KernelCache object (from a file or the API server) or raise SpecError."""
    if not isinstance(obj, dict):
        raise SpecError(
            f"{source}: expected a KernelCache mapping, got {type(obj).__name__}", path=source
        )
    check_depth(obj, source, SpecError)
    try:
        return KernelCache.model_validate(obj, by_alias=True, by_name=False)
    except ValidationError as exc:
        errors = exc.errors()
        first = first_error(errors)
        path, what = describe(first, KernelCache)
        others = [describe(e, KernelCache) for e in errors if e is not first]
        more = and_more([p or w for p, w in others])
        where = f"{path}: " if path else ""
        details = [
            f"{source}: {p}: {w}" if p else f"{source}: {w}" for p, w in [(path, what), *others]
        ]
        raise SpecError(
            one_line(f"{source}: {where}{what}{more}"),
            path=source,
            field=path or None,
            details=details,
        ) from None


def load_kernelcache(path: str | Path) -> KernelCache:
    """Read a one-document KernelCache YAML file; any problem becomes a one-line SpecError."""
    source = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"{source}: cannot read: {exc.strerror or exc}", path=source) from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(
            f"{source}: larger than {MAX_SPEC_BYTES // 1024} KiB, more than the API server "
            "accepts for one object",
            path=source,
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{source}: not UTF-8 text", path=source) from None
    try:
        with depth_guard(source, SpecError):
            docs = [doc for doc in yaml.load_all(text, Loader=_SpecLoader) if doc is not None]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        message = f"{source}: {where}YAML syntax error: {exc.problem or exc.context}"
        raise SpecError(one_line(message), path=source) from None
    except yaml.YAMLError as exc:
        raise SpecError(one_line(f"{source}: YAML error: {exc}"), path=source) from None
    if len(docs) != 1:
        raise SpecError(
            f"{source}: expected exactly one YAML document, found {len(docs)}", path=source
        )
    return parse_kernelcache(docs[0], source)
