"""Every Prometheus metric weft exports, in one place, all prefixed ``weft_``.

Label names follow dcgm-exporter's where they overlap (``gpu``, ``UUID``,
``pod``, ``namespace``, ``container``) so dashboards can join the series.
The CRI metrics carry ``kind`` (intercepted or passthrough) as in nri-plugins'
relay, so the cost of weft's own work and of plain forwarding stay apart.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Buckets sized for a local unix-socket hop: most calls are sub-millisecond,
# pod starts and image operations take seconds.
_CRI_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The agent's metrics, on a registry of its own (tests make fresh ones)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.cri_requests = Counter(
            "weft_cri_requests",
            "CRI requests served by the agent, by method, status code and kind.",
            ["method", "code", "kind"],
            registry=self.registry,
        )
        self.cri_latency = Histogram(
            "weft_cri_request_duration_seconds",
            "Wall time of CRI requests through the agent, by method, status code and kind.",
            ["method", "code", "kind"],
            buckets=_CRI_BUCKETS,
            registry=self.registry,
        )
        self.cri_streams = Gauge(
            "weft_cri_open_streams",
            "Server-streaming CRI calls (GetContainerEvents) open now.",
            ["method"],
            registry=self.registry,
        )
        self.upstream_up = Gauge(
            "weft_upstream_up",
            "1 when the agent's last call reached containerd, 0 when containerd was unreachable.",
            registry=self.registry,
        )
        self.placements = Counter(
            "weft_placements",
            "Containers of opted-in pods placed, by stage, placement and reason.",
            ["stage", "placement", "reason"],
            registry=self.registry,
        )
        self.opted_in = Gauge("weft_opted_in_sandboxes", "Opted-in pod sandboxes this agent knows.",
                              registry=self.registry)
        self.mesh_peer_up = Gauge("weft_mesh_peer_up", "1 while a mesh peer answers Hello and says it is healthy.",
                                  ["peer"], registry=self.registry)
        self._children: dict[tuple[str, str, str], tuple[object, object]] = {}

    def observe_cri(self, method: str, code: str, kind: str, seconds: float) -> None:
        # labels() takes a lock and builds a tuple on every call; the hot path
        # reuses the children instead.
        key = (method, code, kind)
        pair = self._children.get(key)
        if pair is None:
            pair = (self.cri_requests.labels(*key), self.cri_latency.labels(*key))
            self._children[key] = pair
        pair[0].inc()  # type: ignore[attr-defined]
        pair[1].observe(seconds)  # type: ignore[attr-defined]
