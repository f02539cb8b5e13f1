"""Whether the serving engine has said it is ready: strict mode refuses compiles until then.

Strict mode makes a cache that lacks what the engine's configuration can ask for a setup
failure: the start fails before the engine is ready, and the pod never takes traffic. After
ready, refusing a compile would kill an engine with requests in flight, and its restart would
meet the same gap: there a compile is served, counted (``kernelcache_cold_compiles_total``,
whose alert fires) and recorded for the next build. An engine toolchain that knows when its
engine is ready (vLLM: when its JIT monitor arms) calls ``mark_ready``; a process that never
does refuses for its whole life, as strict mode did before.
"""

from __future__ import annotations

_ready = False


def mark_ready() -> None:
    global _ready
    _ready = True


def refusing(strict: bool) -> bool:
    """Whether a compile is refused now: strict mode, before the engine is ready."""
    return strict and not _ready
