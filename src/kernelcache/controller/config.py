"""The operator's one configuration object, read once from ``KERNELCACHE_OPERATOR_*``.

Every field is an environment variable named ``KERNELCACHE_OPERATOR_`` plus the field name in
upper case (``resync_seconds`` is ``KERNELCACHE_OPERATOR_RESYNC_SECONDS``). It is read when
the operator module is imported, because kopf fixes timer intervals at registration; a bad
value stops the operator at start with one line naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kernelcache.errors import ExitCode, KernelCacheError

ENV_PREFIX = "KERNELCACHE_OPERATOR_"


class ConfigError(KernelCacheError):
    code = ExitCode.USAGE


class OperatorConfig(BaseModel):
    """How the operator runs and what its compile Jobs look like."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Where to watch KernelCaches: comma-separated namespace names; empty means all.
    namespaces: tuple[str, ...] = ()

    # Name of the kopf peering object (a ClusterKopfPeering, or a KopfPeering in each watched
    # namespace) through which replicas see each other; empty runs without peering
    # (standalone), which is only safe with a single replica.
    peering: str = "kernelcache"

    # This replica's peering priority. Of the replicas that see each other, the one with the
    # highest priority works and the others pause (kopf pauses all of equal priority). Unset,
    # each start takes `kopf run --priority` if given, else draws a random one, so exactly
    # one replica of a Deployment reconciles and another takes over when it goes.
    priority: int | None = Field(default=None, ge=0)

    # How long a replica's peering record counts as alive without a keep-alive. A replica
    # that exits cleanly (SIGTERM: a rollout, a drain) withdraws its record and another takes
    # over at once; one killed (SIGKILL, OOM, a lost node) is waited for this long, since
    # until then it may still be working. kopf renews the record every 1-5 s at 10 s (the
    # lifetime less 5-10 s, at least 1 s), so a keep-alive must be late by seconds before
    # two replicas work at once (harmless: every handler is idempotent and writes status
    # conditionally). kopf's own default is 60 s: a minute with nobody reconciling.
    peering_lifetime_seconds: int = Field(default=10, ge=2)

    # kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz; empty turns it off.
    liveness: str = "http://0.0.0.0:8080/healthz"

    # Port of the Prometheus /metrics endpoint; 0 turns it off.
    metrics_port: int = Field(default=9090, ge=0, le=65535)

    # Threads that run handlers, and the API connections they pool (calls block).
    workers: int = Field(default=16, ge=1)

    # Threads that answer admission (pod injection, KernelCache validation), apart from the
    # handler threads: admission never waits behind reconcile work.
    admission_workers: int = Field(default=4, ge=1)

    # How long `kernelcache operator` waits at start for an API server that does not answer
    # (one line says so, then it retries quietly every 2 s); past it, one line and exit 10.
    startup_seconds: float = Field(default=300.0, gt=0)

    # Every KernelCache is reconciled at least this often: the safety net for missed watch
    # events, and the clock that starts a retry once its backoff has passed.
    resync_seconds: float = Field(default=30.0, gt=0)

    # Each resync reads what the KernelCache's ready serving pods compiled (controller.learning),
    # all of them at once, within this one deadline for the whole read (connect, headers and
    # body: a pod that trickles bytes is cut off at it); a pod that has not answered a whole
    # record by then is skipped. 0: no learning.
    learn_timeout_seconds: float = Field(default=2.0, ge=0, le=30)

    # A learned key whose pods are all gone ages out of status.learned this long after the
    # last of them went (unless a pod reports it again): long enough to bridge a rollout.
    learn_forget_seconds: float = Field(default=3600.0, ge=0)

    # Where compile Jobs mount the cache volume (passed to `kernelcache warm --store`).
    store_mount_path: str = "/var/lib/kernelcache"

    # UID, GID and fsGroup the compile and cleanup pods run as (never root).
    run_as_user: int = Field(default=1000, ge=1)
    run_as_group: int = Field(default=1000, ge=1)
    fs_group: int = Field(default=1000, ge=1)

    # Compile Jobs first give the KernelCache's store directories (<store>/<namespace> and
    # <store>/<namespace>/<name>) to run_as_user:run_as_group, in an init-container that runs
    # as root with CAP_CHOWN alone (the cleanup image). For volumes whose CSI driver ignores
    # fsGroup (NFS-style exports, root-owned 0755), where the Job's user cannot create them.
    fix_store_ownership: bool = False

    # Pod retries inside one compile Job before the Job counts as failed.
    job_backoff_limit: int = Field(default=1, ge=0)

    # A compile Job may run for the sum of its warmers' timeoutSeconds plus this margin
    # (image pull, start-up, sealing and publishing).
    job_deadline_margin_seconds: int = Field(default=900, ge=0)

    # Finished Jobs are deleted by Kubernetes after this long. It must outlast the longest
    # retry backoff: a failed Job is the operator's record of its attempts.
    job_ttl_seconds: int = Field(default=86400, ge=1)

    # Compile attempts per arch and spec (each a new Job) before the arch stays Failed; a
    # spec change starts over.
    max_attempts: int = Field(default=3, ge=1)

    # Delay before retry n (n = 1, 2, ...): retry_backoff_seconds * 2**(n-1), capped.
    retry_backoff_seconds: float = Field(default=60.0, ge=0)
    retry_backoff_max_seconds: float = Field(default=3600.0, ge=0)

    # Image of the Job that deletes a KernelCache's data from an existing claim when
    # spec.retention.deleteDataOnDelete is set, and of the store-ownership init-container (they
    # run `rm -rf`, `sh`, `mkdir` and `chown`; no GPU). Empty: the init-container image, which
    # has them and which the cluster pulls anyway (from wherever init_image is mirrored), so
    # nothing comes from Docker Hub unasked.
    cleanup_image: str = ""

    # How often the finalizer re-checks a running cleanup Job.
    cleanup_poll_seconds: float = Field(default=10.0, gt=0)

    # Image of the init-container the mutating webhook adds to labelled serving pods (its
    # entrypoint is `kernelcache verify`; see initcontainer/Dockerfile).
    init_image: str = Field(default="ghcr.io/kernelcache/kernelcache-init:0.1.0", min_length=1)

    # HTTPS port of the admission webhooks (pod injection, KernelCache validation); 0 serves
    # none, and then the webhook configurations must not point at this operator.
    webhook_port: int = Field(default=0, ge=0, le=65535)

    # Directory holding the webhook's serving certificate as tls.crt and tls.key (a
    # kubernetes.io/tls Secret mounted there); empty: kopf generates a self-signed one,
    # which needs kopf's certificate extra (certbuilder).
    webhook_tls_dir: str = "/etc/kernelcache/webhook-tls"

    # How serving pods get their generation (docs/distribution.md, "Cluster modes"):
    # volume: the KernelCache's claim, read-only (a KernelCache consuming spec.source is
    # pulled instead: it has no claim); image: each arch's artifact as a read-only image
    # volume (Kubernetes 1.35+); pull: the init-container pulls it by digest.
    distribution_mode: Literal["volume", "image", "pull"] = "volume"

    # A ConfigMap (key ca.crt) in each KernelCache's namespace holding the CA that the
    # registry's certificate chains to, for registries with a private CA; empty: the
    # image's system CAs.
    registry_ca: str = ""

    # Node-local prefetch: a hostPath root on every GPU node where a DaemonSet per GPU class
    # keeps each KernelCache's current generation; empty turns prefetch off.
    prefetch_root: str = ""

    # Bytes of that root the prefetch may fill; past it, the oldest generations no pod uses
    # and no KernelCache names are evicted first, and a generation that cannot fit is not
    # fetched (its pods fall back or wait, below).
    prefetch_limit_bytes: int = Field(default=50 * 2**30, ge=1)

    # How long a serving pod's init-container waits for its node's local copy (a node that
    # joined a moment ago), and what it does then: fall back to the mode's own source
    # (true), or refuse the pod (false: the local disk is the only source allowed).
    prefetch_wait_seconds: int = Field(default=300, ge=0)
    prefetch_fallback: bool = True

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(n.strip() for n in value.split(",") if n.strip())
        return value

    @model_validator(mode="after")
    def _cleanup_in_the_init_image(self) -> OperatorConfig:
        if not self.cleanup_image:
            object.__setattr__(self, "cleanup_image", self.init_image)  # frozen: set once here
        return self

    @model_validator(mode="after")
    def _ttl_outlasts_backoff(self) -> OperatorConfig:
        if self.max_attempts > 1 and self.job_ttl_seconds <= self.retry_backoff_max_seconds:
            raise ValueError(
                "job_ttl_seconds must exceed retry_backoff_max_seconds: "
                "a failed Job must still exist when its retry is due"
            )
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        """Read every ``KERNELCACHE_OPERATOR_*`` variable; unknown ones are an error."""
        environ = os.environ if environ is None else environ
        values = {
            name.removeprefix(ENV_PREFIX).lower(): value
            for name, value in environ.items()
            if name.startswith(ENV_PREFIX)
        }
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            error = exc.errors()[0]
            field = ".".join(str(part) for part in error["loc"][:1])
            where = f"{ENV_PREFIX}{field.upper()}: " if field else ""
            what = "not a setting" if error["type"] == "extra_forbidden" else error["msg"]
            raise ConfigError(f"{where}{what}") from None
