"""The cluster's options (plain dataclass: the CLI, the tests and the benchmark build it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.cluster.routing import DEFAULT_PREFIX_CHARS, DEFAULT_PREFIX_TOKENS, AffinityConfig

ROUTERS = ("affinity", "power-of-two")
# Settings fields replicas must not get: their own address, and the secret files (the secrets
# are read here, once; a replica given both the secret and its file refuses to start, and the
# file may not exist where the replica runs).
REPLICA_SETTINGS_EXCLUDE = frozenset({"host", "port", "api_key_file", "admin_token_file"})


@dataclass(slots=True)
class ClusterConfig:
    """One Greenlane application on Ray Serve: N replicas (one engine and one GPU each) behind
    an OpenAI-compatible ingress.

    `replica_settings` are `app.settings.Settings` fields for every replica's server (model,
    engine and server options); host and port are chosen per replica (loopback, free port).
    """

    replica_settings: dict[str, Any] = field(default_factory=dict)
    app_name: str = "greenlane"
    route_prefix: str = "/"
    # Replicas: a fixed count, or autoscaling between min and max replicas on ongoing requests.
    num_replicas: int | None = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    replica_num_cpus: float = 1.0
    replica_num_gpus: float = 0.0
    # Routing: "affinity" (ours, app/cluster/router.py) or "power-of-two" (Ray's default).
    router: str = "affinity"
    max_queue_gap: int = 8
    max_backlog_gap_s: float | None = 2.0
    route_prefix_tokens: int = DEFAULT_PREFIX_TOKENS
    route_prefix_chars: int = DEFAULT_PREFIX_CHARS
    routing_stats_period_s: float = 1.0
    # Admission: Ray sends a replica at most this many requests at once (None: the replica's
    # own admission limit, max_num_seqs + max_queue); requests waiting for a replica beyond
    # max_queued_requests get 429 with Retry-After.
    max_ongoing_requests: int | None = None
    max_queued_requests: int = 256
    retry_after_s: int = 1
    # Replica health: Ray calls check_health every period and replaces a replica that fails.
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.0

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        autoscale = self.min_replicas is not None or self.max_replicas is not None
        if autoscale:
            if self.min_replicas is None or self.max_replicas is None:
                raise ValueError("autoscaling needs both min_replicas and max_replicas")
            if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
                raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
            self.num_replicas = None
        elif self.num_replicas is None or self.num_replicas < 1:
            raise ValueError("num_replicas must be >= 1 (or give min_replicas and max_replicas)")
        if self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be >= 1")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be >= 1")
        self.affinity()  # validates the affinity knobs

    def affinity(self) -> AffinityConfig:
        return AffinityConfig(
            max_queue_gap=self.max_queue_gap,
            max_backlog_gap_s=self.max_backlog_gap_s,
            prefix_tokens=self.route_prefix_tokens,
            prefix_chars=self.route_prefix_chars,
        )

    def replica_admission_limit(self) -> int:
        """What one replica's server admits before it answers 429 itself."""
        from app.settings import Settings

        s = Settings(**self.replica_settings)
        return int(s.max_num_seqs) + int(s.max_queue)
