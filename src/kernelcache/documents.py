"""The one loader of JSON and YAML documents that come from outside: specs, manifests, the
node map, a store's history.

The parsers recurse: 100,000 ``[`` in a MANIFEST.json or a workload 20,000 levels deep is
a ``RecursionError`` deep inside json or yaml, then again in pydantic or ``json.dumps``.
Here both the parse and every document it returns are held to ``MAX_DEPTH`` levels, and a
deeper one is refused as the failure class of that file (``error``), naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kernelcache.errors import KernelCacheError

# Far above any real spec, manifest or node map (a workload is a few levels deep), and far
# below Python's recursion limit, which pydantic and json.dumps also meet on the way.
MAX_DEPTH = 64

ErrorClass = Callable[..., KernelCacheError]


def too_deep(source: str, where: str = "") -> str:
    """The line; ``where``: the field path at which the document got too deep, when known."""
    return f"{source}: {where + ': ' if where else ''}nested deeper than {MAX_DEPTH} levels"


# A field's place as a linked trail (key, parent trail): built for every node without
# formatting, spelled out only for the one that is too deep.
Trail = tuple[Any, Any] | None


# Of a path 64 levels deep, the first fields say where: the rest is the nesting itself.
PATH_SHOWN = 4


def field_path(trail: Trail) -> str:
    """``spec.gpuClasses[0].nodeSelector…``, as the spec errors spell a field (keys as
    ``repr`` where they are not plain names), its first ``PATH_SHOWN`` steps."""
    parts: list[str] = []
    while trail is not None:
        key, trail = trail
        plain = isinstance(key, str) and key.isidentifier()
        parts.append(f"[{key!r}]" if not plain else f".{key}")
    shown = "".join(reversed(parts[-PATH_SHOWN:])).removeprefix(".")
    return shown + ("…" if len(parts) > PATH_SHOWN else "")


@contextmanager
def depth_guard(source: str, error: ErrorClass) -> Iterator[None]:
    """A parse inside runs out of stack as ``error`` naming ``source``, not a RecursionError."""
    try:
        yield
    except RecursionError:
        raise error(too_deep(source), path=source) from None


def check_depth(obj: Any, source: str, error: ErrorClass) -> Any:
    """``obj`` when no list or mapping in it is nested deeper than ``MAX_DEPTH`` (counted
    without recursion, so a document parsed elsewhere is checked the same)."""
    stack: list[tuple[Any, int, Trail]] = [(obj, 1, None)]
    while stack:
        node, depth, trail = stack.pop()
        if isinstance(node, dict):
            children: Any = node.items()
        elif isinstance(node, list | tuple):
            children = enumerate(node)
        else:
            continue
        if depth > MAX_DEPTH:
            raise error(too_deep(source, field_path(trail)), path=source)
        stack.extend((child, depth + 1, (key, trail)) for key, child in children)
    return obj


def load_json(text: str | bytes, source: str, error: ErrorClass, **options: Any) -> Any:
    """``json.loads(text, **options)``, depth-checked; syntax errors propagate as ``ValueError``
    (each caller words them for its file)."""
    with depth_guard(source, error):
        obj = json.loads(text, **options)
    return check_depth(obj, source, error)
