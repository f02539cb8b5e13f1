"""The names kernelcache's components share, each spelled once.

The operator labels what it creates and the webhook reads pod labels and annotations; the
webhook and the init-container hand a pod its generation through environment variables and
the env file; the runtime reads them back. Every such name is here, and every
``KERNELCACHE_*`` variable is declared once (name, type, default, one line of doc) and read
into one typed ``Settings`` object, the way Triton's ``knobs`` reads ``TRITON_*``: a
malformed value is one ``SpecError`` line naming the variable. The generation's own layout
(``files/``, ``MANIFEST.json``) is the store's (``kernelcache.store``).

Nothing here imports beyond the standard library and ``errors``: every component, the slim
init-container image included, reads it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar, get_type_hints

from kernelcache.errors import SpecError

__all__ = [
    "ANNOTATION_CACHE",
    "ANNOTATION_CONTAINERS",
    "ANNOTATION_IMAGE_POLICY",
    "ENV_FILE",
    "LABEL_ARCH",
    "LABEL_ATTEMPT",
    "LABEL_CACHE",
    "LABEL_CACHE_UID",
    "LABEL_COMPONENT",
    "LABEL_DIGEST",
    "LABEL_MANAGED_BY",
    "MANAGED_BY",
    "OCI_ANNOTATION_GENERATION",
    "OCI_ANNOTATION_KEY",
    "OCI_ANNOTATION_LAYER",
    "OCI_ANNOTATION_STAMP",
    "POLICIES",
    "PORT_METRICS",
    "REPORT_FILE",
    "VARIABLES",
    "CacheKey",
    "Settings",
    "Variable",
    "image_reference",
]

# --------------------------------------------------------------------------- labels

MANAGED_BY = "kernelcache-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
# What an operator-made object is for: "spec" (the spec ConfigMap), "compile" (a Job), ...
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_CACHE_UID = "kernelcache.dev/cache-uid"
LABEL_ARCH = "kernelcache.dev/arch"
LABEL_DIGEST = "kernelcache.dev/spec-digest"
LABEL_ATTEMPT = "kernelcache.dev/attempt"
# Names can be longer than a label value may be (63), so the owner's name is an annotation.
ANNOTATION_CACHE = "kernelcache.dev/cache"
# On a serving pod: the KernelCache it serves from; the webhook mutates only such pods.
LABEL_CACHE = "kernelcache.dev/cache"
ANNOTATION_IMAGE_POLICY = "kernelcache.dev/image-policy"
ANNOTATION_CONTAINERS = "kernelcache.dev/containers"
# A serving container's port of KERNELCACHE_METRICS_PORT: scraped by the chart's PodMonitor,
# and where the operator reads what the pod learned (``learned.PATH``).
PORT_METRICS = "kc-metrics"

# --------------------------------------------------------------------------- OCI artifacts

# On a generation's OCI image manifest (``kernelcache.distribution``), in the reverse-domain
# form OCI annotations use: what it holds, readable before any layer is fetched (a puller
# checks each against the generation's own MANIFEST.json, never trusts it alone).
OCI_ANNOTATION_KEY = "dev.kernelcache.key"
OCI_ANNOTATION_GENERATION = "dev.kernelcache.generation"
OCI_ANNOTATION_STAMP = "dev.kernelcache.stamp"
# On each layer: the part of the generation it holds (MANIFEST.json, or files/<toolchain>).
OCI_ANNOTATION_LAYER = "dev.kernelcache.layer"

# --------------------------------------------------------------------------- the pod's files

# Written by the init-container into the pod's cache volume; the env file last, as the
# sign that the generation is ready (``kernelcache.envfile``).
ENV_FILE = "kernelcache.env"
REPORT_FILE = "kernelcache-verify.json"
# ``kernelcache verify --policy``: strict refuses what permissive drops or only counts.
POLICIES = ("strict", "permissive")


# --------------------------------------------------------------------------- the cache key


@dataclass(frozen=True)
class CacheKey:
    """``<namespace>/<name>/<arch>``: one KernelCache's generations for one arch."""

    namespace: str
    name: str
    arch: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}/{self.arch}"

    @property
    def cache(self) -> str:
        """``<namespace>/<name>``: the KernelCache, whatever the arch."""
        return f"{self.namespace}/{self.name}"

    @classmethod
    def parse(cls, text: str) -> CacheKey:
        """The key's three parts; the store checks what each may hold."""
        parts = text.split("/")
        if len(parts) != 3 or not all(parts):
            raise SpecError(f"key {text!r}: must be namespace/name/arch")
        return cls(*parts)


def image_reference(image: str, digest: str | None) -> str:
    """The engine image as pulled: ``image@digest`` when the spec pins a digest."""
    return f"{image}@{digest}" if digest else image


# --------------------------------------------------------------------------- variables

T = TypeVar("T")


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable: its name, its value when unset or empty, what it means."""

    name: str
    default: T
    doc: str
    parse: Callable[[str, str], T]  # (name, text) -> value; SpecError naming the variable

    def read(self, env: Mapping[str, str]) -> T:
        text = env.get(self.name, "")
        return self.default if not text.strip() else self.parse(self.name, text)


def _text(name: str, text: str) -> str:
    return text


def _path(name: str, text: str) -> Path | None:
    return Path(text)


def _flag(name: str, text: str) -> bool:
    # Exactly "1" or "0": "true" must not mean one thing here and another elsewhere.
    if text not in ("0", "1"):
        raise SpecError(f"{name}={text!r}: expected 1 or 0")
    return text == "1"


def _count(kind: type[int] | type[float], least: int) -> Callable[[str, str], Any]:
    what = "an integer" if kind is int else "a number"

    def parse(name: str, text: str) -> Any:
        try:
            value = kind(text.strip())
        except ValueError:
            value = None
        if value is None or value < least:
            raise SpecError(f"{name}={text!r}: expected {what} >= {least}")
        return value

    return parse


def _sm_count(name: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise SpecError(f"{name}={text!r} is not a positive SM count")
    return int(text)


DIR = Variable[Path | None](
    "KERNELCACHE_DIR",
    None,
    "the materialized generation (MANIFEST.json, files/); unset: count compiles only",
    _path,
)
IN_PLACE_DIR = Variable[Path | None](
    "KERNELCACHE_IN_PLACE_DIR",
    None,
    "the verified generation on a read-only mount, which toolchains that only read their "
    "files use in place (``Toolchain.reads_in_place``); unset: all from KERNELCACHE_DIR",
    _path,
)
STRICT = Variable(
    "KERNELCACHE_STRICT",
    False,
    "1: a compile in serving raises, and a stamp mismatch or missing generation refuses",
    _flag,
)
ENV_FILE_PATH = Variable[Path | None](
    "KERNELCACHE_ENV_FILE",
    None,
    "the init-container's env file, read as defaults for these variables at install()",
    _path,
)
RUNTIME = Variable(
    "KERNELCACHE_RUNTIME", False, "1: the .pth hook calls runtime.install() at start", _flag
)
METRICS_PORT = Variable(
    "KERNELCACHE_METRICS_PORT", 0, "port for /metrics; 0 or unset: none", _count(int, 0)
)
METRICS_ADDRESS = Variable(
    "KERNELCACHE_METRICS_ADDRESS", "0.0.0.0", "the address /metrics binds", _text
)
NAME = Variable[str | None](
    "KERNELCACHE_NAME", None, "the name label (namespace/name); default: the manifest's", _text
)
ARCH = Variable[str | None](
    "KERNELCACHE_ARCH", None, "this node's SM arch (sm_90a): an override of discovery", _text
)
GPU_PRODUCT = Variable[str | None](
    "KERNELCACHE_GPU_PRODUCT", None, "this node's GPU product: an override of discovery", _text
)
NODE_NAME = Variable[str | None](
    "KERNELCACHE_NODE_NAME", None, "this pod's node (downward API), to read its labels", _text
)
NODE_MAP = Variable[Path | None](
    "KERNELCACHE_NODE_MAP", None, "the operator's node map, mounted; default its mount", _path
)
FLASHINFER_BUILD_LOG = Variable[Path | None](
    "FLASHINFER_JIT_BUILD_LOG",
    None,
    "FlashInfer's build log (its own variable); set to a temp file when unset",
    _path,
)
FLASHINFER_MIN_BUILD_S = Variable(
    "KERNELCACHE_FLASHINFER_MIN_BUILD_S",
    0.5,
    "a FlashInfer build-log entry this long counts as a build (ninja no-ops take ~0.01 s)",
    _count(float, 0),
)
POLL_S = Variable(
    "KERNELCACHE_POLL_S",
    1.0,
    "seconds between reads of FlashInfer's build log and Triton's cache directory",
    _count(float, 0),
)
PROGRESS = Variable("KERNELCACHE_PROGRESS", False, "1: print each compile to stderr", _flag)
LEARNED = Variable[Path | None](
    "KERNELCACHE_LEARNED",
    None,
    "a learned record (JSON) whose keys the warm adds (the compile Job's; warm --learned)",
    _path,
)


def _sizes(name: str, text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SpecError(f"{name}={text!r}: expected token counts like 16,512")
    return tuple(sorted({int(p) for p in parts}))


VLLM_SIZES = Variable[tuple[int, ...] | None](
    "KERNELCACHE_VLLM_SIZES",
    None,
    "token counts run before vLLM's JIT monitor arms, instead of the generation's (the warm)",
    _sizes,
)
VLLM_COVERAGE = Variable[str | None](
    "KERNELCACHE_VLLM_COVERAGE",
    None,
    "a fused-MoE coverage file replayed before vLLM's JIT monitor arms instead of the "
    "generation's (the warm's later passes), or `enumerate` (the warm's first pass)",
    _text,
)
VLLM_MOE_TUNING = Variable[str | None](
    "KERNELCACHE_VLLM_MOE_TUNING",
    None,
    "the warm's first pass: tune the fused-MoE configs before vLLM's warm-up, as JSON "
    "(`mode`, `budget_seconds` of spec.warmers[].workload.moeTuning)",
    _text,
)
# How a vLLM release outside the vllm toolchain's supported range is met: refused (the warm
# and a serving start stop, naming the version and the range) or warned about (tried anyway).
VLLM_VERSION_CHECKS = ("refuse", "warn")


def _vllm_version_check(name: str, text: str) -> str:
    if text not in VLLM_VERSION_CHECKS:
        raise SpecError(f"{name}={text!r}: expected one of {', '.join(VLLM_VERSION_CHECKS)}")
    return text


VLLM_VERSION_CHECK = Variable[str](
    "KERNELCACHE_VLLM_VERSION_CHECK",
    "refuse",
    "`warn`: a serving start on a vLLM outside the supported range warns and tries (the "
    "webhook sets it from spec.warmers[].workload.vllmVersionCheck); `refuse` (the default) "
    "stops it",
    _vllm_version_check,
)
VLLM_STATE_DIR = Variable[Path | None](
    "KERNELCACHE_VLLM_STATE_DIR",
    None,
    "where each vLLM process writes what kernelcache's hooks saw in it (the warm reads it)",
    _path,
)


SM_COUNT = Variable[int | None](
    "KERNELCACHE_SM_COUNT", None, "this node's GPU SM count, else the driver's", _sm_count
)
CUTE_DSL_DIR = Variable[Path | None](
    "KERNELCACHE_CUTE_DSL_DIR",
    None,
    "the CuTe-DSL disk layer's cache; default ~/.cache/kernelcache/cute-dsl",
    _path,
)
STARTED_AT = Variable[float | None](
    "KERNELCACHE_STARTED_AT",
    None,
    "when the measured process started (seconds since the epoch), for start-up timings",
    _count(float, 0),
)


_LABEL = r"[a-z0-9]([a-z0-9-]*[a-z0-9])?"
_HOST = re.compile(rf"(\[[0-9a-f:.]+\]|{_LABEL}(\.{_LABEL})*)(:[0-9]{{1,5}})?")


def _hosts(name: str, text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip().lower() for h in text.split(",") if h.strip())
    if not all(_HOST.fullmatch(h) for h in hosts):
        raise SpecError(f"{name}={text!r}: expected registry hosts like registry.local:5000")
    return hosts


REGISTRY_CONNECT_S = Variable(
    "KERNELCACHE_REGISTRY_CONNECT_S",
    10.0,
    "seconds a registry (or its token service, or where it redirects) has to accept a "
    "connection and finish TLS",
    _count(float, 0),
)
REGISTRY_READ_S = Variable(
    "KERNELCACHE_REGISTRY_READ_S",
    30.0,
    "seconds a registry may stay silent: before its response headers, or within a blob",
    _count(float, 0),
)
REGISTRY_TRIES = Variable(
    "KERNELCACHE_REGISTRY_TRIES",
    3,
    "tries of each registry step (a connection, a request, a blob resumed where it broke) "
    "before it fails",
    _count(int, 1),
)
REGISTRY_MIN_BYTES_S = Variable(
    "KERNELCACHE_REGISTRY_MIN_BYTES_S",
    10240,
    "the slowest a body (a manifest, a blob) may arrive, in bytes per second averaged over "
    "each KERNELCACHE_REGISTRY_READ_S; 0: no floor",
    _count(int, 0),
)
PLAIN_HTTP_HOSTS = Variable[tuple[str, ...]](
    "KERNELCACHE_PLAIN_HTTP_HOSTS",
    (),
    "registries (host[:port], comma-separated) that --plain-http may speak to besides "
    "loopback ones",
    _hosts,
)


# Given to a command warmer's process (``toolchains.command``), never read by kernelcache itself;
# the arch is ``ARCH``'s name.
WARM_FILES = Variable[str | None](
    "KERNELCACHE_FILES", None, "the generation's files/, for a command warmer", _text
)
WARM_WORKLOAD = Variable[str | None](
    "KERNELCACHE_WORKLOAD", None, "the spec's workload as JSON, for a command warmer", _text
)


@dataclass(frozen=True)
class Settings:
    """Every ``KERNELCACHE_*`` setting, typed; ``from_env`` reads them all at once."""

    generation_dir: Annotated[Path | None, DIR] = DIR.default
    in_place_dir: Annotated[Path | None, IN_PLACE_DIR] = IN_PLACE_DIR.default
    strict: Annotated[bool, STRICT] = STRICT.default
    env_file: Annotated[Path | None, ENV_FILE_PATH] = ENV_FILE_PATH.default
    runtime: Annotated[bool, RUNTIME] = RUNTIME.default
    metrics_port: Annotated[int, METRICS_PORT] = METRICS_PORT.default
    metrics_address: Annotated[str, METRICS_ADDRESS] = METRICS_ADDRESS.default
    name: Annotated[str | None, NAME] = NAME.default
    arch: Annotated[str | None, ARCH] = ARCH.default
    gpu_product: Annotated[str | None, GPU_PRODUCT] = GPU_PRODUCT.default
    node_name: Annotated[str | None, NODE_NAME] = NODE_NAME.default
    node_map: Annotated[Path | None, NODE_MAP] = NODE_MAP.default
    flashinfer_build_log: Annotated[Path | None, FLASHINFER_BUILD_LOG] = (
        FLASHINFER_BUILD_LOG.default
    )
    flashinfer_min_build_seconds: Annotated[float, FLASHINFER_MIN_BUILD_S] = (
        FLASHINFER_MIN_BUILD_S.default
    )
    poll_seconds: Annotated[float, POLL_S] = POLL_S.default
    progress: Annotated[bool, PROGRESS] = PROGRESS.default
    learned: Annotated[Path | None, LEARNED] = LEARNED.default
    vllm_sizes: Annotated[tuple[int, ...] | None, VLLM_SIZES] = VLLM_SIZES.default
    vllm_state_dir: Annotated[Path | None, VLLM_STATE_DIR] = VLLM_STATE_DIR.default
    vllm_coverage: Annotated[str | None, VLLM_COVERAGE] = VLLM_COVERAGE.default
    vllm_moe_tuning: Annotated[str | None, VLLM_MOE_TUNING] = VLLM_MOE_TUNING.default
    vllm_version_check: Annotated[str, VLLM_VERSION_CHECK] = VLLM_VERSION_CHECK.default
    sm_count: Annotated[int | None, SM_COUNT] = SM_COUNT.default
    cute_dsl_dir: Annotated[Path | None, CUTE_DSL_DIR] = CUTE_DSL_DIR.default
    started_at: Annotated[float | None, STARTED_AT] = STARTED_AT.default
    registry_connect_s: Annotated[float, REGISTRY_CONNECT_S] = REGISTRY_CONNECT_S.default
    registry_read_s: Annotated[float, REGISTRY_READ_S] = REGISTRY_READ_S.default
    registry_tries: Annotated[int, REGISTRY_TRIES] = REGISTRY_TRIES.default
    registry_min_bytes_s: Annotated[int, REGISTRY_MIN_BYTES_S] = REGISTRY_MIN_BYTES_S.default
    plain_http_hosts: Annotated[tuple[str, ...], PLAIN_HTTP_HOSTS] = PLAIN_HTTP_HOSTS.default

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read every setting; a malformed value is a SpecError naming its variable."""
        env = os.environ if environ is None else environ
        return cls(**{field: variable.read(env) for field, variable in _FIELDS.items()})


# Each field's variable, from its annotation.
_FIELDS: dict[str, Variable[Any]] = {
    name: hint.__metadata__[0]
    for name, hint in get_type_hints(Settings, include_extras=True).items()
}
# Every variable kernelcache reads, then those it only sets for a warmer's command.
VARIABLES = (*_FIELDS.values(), WARM_FILES, WARM_WORKLOAD)


# A serving pod's init-container that passed over its node's prefetched copy (it did not
# verify) and started from the copy's source says so in its termination log, after the key;
# the operator reads it into that node's entry of status.nodes.
LOCAL_DAMAGED = "this node's prefetched copy did not verify"
