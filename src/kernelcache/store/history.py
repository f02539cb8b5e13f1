"""Retention order: HISTORY.json records when each generation was last replaced as CURRENT,
so the rollback target is the generation CURRENT named before, however old its content."""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone
from pathlib import Path

from kernelcache.documents import load_json
from kernelcache.errors import KernelCacheError, ManifestError
from kernelcache.store.fs import read_regular, replace_synced
from kernelcache.store.layout import GENERATION_RE, HISTORY_NAME
from kernelcache.store.manifest import Manifest, parse_created

log = logging.getLogger(__name__)

HISTORY_FORMAT = "kernelcache.dev/history/v1"


def created_or_oldest(manifest: Manifest | None) -> datetime:
    return manifest.created_at if manifest else datetime.min.replace(tzinfo=timezone.utc)


def read_history(key_dir: Path) -> dict[str, datetime]:
    """HISTORY.json: generation id -> when it was last replaced as CURRENT.

    Only ordering depends on it, never what is served, so an unreadable or malformed history
    counts as empty (with a warning): generations then order by their creation time.
    """
    path = key_dir / HISTORY_NAME
    try:
        doc = load_json(read_regular(path), str(path), ManifestError)
        if doc.get("format") != HISTORY_FORMAT:
            raise ValueError(f"format is not {HISTORY_FORMAT!r}")
        return {
            gen: parse_created(when)
            for gen, when in doc["replaced"].items()
            if GENERATION_RE.match(gen)
        }
    except FileNotFoundError:
        return {}
    except (OSError, KernelCacheError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("%s: ignored (%s); generations order by creation time", path, exc)
        return {}


def record_replaced(key_dir: Path, outgoing: str) -> None:
    """Record that outgoing stops being CURRENT now; only a lock holder calls this, before
    the CURRENT swap (a crash in between leaves a record for a generation still current,
    which orders nothing: the current one is always kept). Entries of generations no longer
    in the key are dropped."""
    history = read_history(key_dir)
    history[outgoing] = datetime.now(timezone.utc)
    doc = {
        "format": HISTORY_FORMAT,
        "replaced": {
            gen: when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            for gen, when in sorted(history.items())
            if os.path.lexists(key_dir / gen)
        },
    }
    # On disk before CURRENT moves on.
    replace_synced(
        key_dir / HISTORY_NAME,
        (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode(),
        f".HISTORY.{os.getpid()}-",
    )


def last_current(
    generation: tuple[Path, Manifest | None], history: dict[str, datetime]
) -> datetime:
    """When a generation was last current: when it was last replaced, else (never replaced,
    or replaced before the history was kept) when it was created."""
    path, manifest = generation
    created = created_or_oldest(manifest)
    replaced = history.get(path.name)
    return max(created, replaced) if replaced is not None else created
