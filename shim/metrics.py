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

# Opt-in timestamps kept per agent: far more than a node runs pods at once.
_OPT_IN_SERIES = 1024


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
        self.cri_upstream = Histogram(
            "weft_cri_upstream_duration_seconds",
            "Of an intercepted CRI request's wall time, what it spent waiting on containerd, by method and code.",
            ["method", "code"],
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
        # When each opted-in sandbox was recorded: `weft report` splits its
        # windows at a workload's earliest. Prometheus keeps the history, so
        # only the newest _OPT_IN_SERIES pods stay exported (bounded memory
        # without hooking sandbox removal).
        self.sandbox_opted_in_at = Gauge(
            "weft_sandbox_opted_in_timestamp_seconds",
            "Unix time the agent recorded each opted-in pod sandbox (runtimeClassName: weft).",
            ["namespace", "pod"], registry=self.registry)
        self._opted_in_pods: dict[tuple[str, str], None] = {}
        self.remote_lost = Counter(
            "weft_remote_lost",
            "Remote containers reported exited with reason WeftPeerLost (their host silent past the loss timeout).",
            registry=self.registry)
        self.remote_containers = Gauge(
            "weft_remote_containers", "Containers this origin runs on peers now.", registry=self.registry)
        self.mesh_peer_up = Gauge("weft_mesh_peer_up", "1 while a mesh peer answers Hello and says it is healthy.",
                                  ["peer"], registry=self.registry)
        self.mesh_tracked_peers = Gauge("weft_mesh_tracked_peers", "Peers said Hello to in the last round, by why "
                                        "(fleet, business, candidate, probe, refresh).", ["reason"],
                                        registry=self.registry)
        self.mesh_connections = Gauge("weft_mesh_connections", "Mesh connections this node holds open to peers.",
                                      registry=self.registry)
        self.mesh_cert_expiry = Gauge("weft_mesh_cert_expiry_timestamp_seconds", "When this node's mesh "
                                      "certificate in use expires (Unix time): alert well before it, as renewal "
                                      "should have replaced it long before.", registry=self.registry)
        self.mesh_refreshes = Counter("weft_mesh_refreshes", "On-demand refreshes (placement needed more room than "
                                      "the candidates had), by result (found, none).", ["result"],
                                      registry=self.registry)
        self.shadows_fenced = Counter("weft_shadows_fenced", "Shadows this host killed because their origin "
                                      "was silent for the fence timeout, by origin.", ["peer"],
                                      registry=self.registry)
        self.shadows_hosted = Gauge("weft_shadows_hosted", "Shadows (other nodes' containers) running on this host.",
                                    registry=self.registry)
        self.reservations = Gauge("weft_reservations", "This host's reservation pods for its shadows, by state "
                                  "(pending, admitted, lost).", ["state"], registry=self.registry)
        self.shadows_stopped = Counter("weft_shadows_stopped_reservation", "Shadows this host stopped because "
                                       "their reservation was refused, evicted, preempted, deleted or never "
                                       "admitted, by reason.", ["reason"], registry=self.registry)
        self._children: dict[tuple[str, str, str], tuple[object, object]] = {}

    def sandbox_opted_in(self, namespace: str, pod: str, at: float) -> None:
        key = (namespace, pod)
        self._opted_in_pods.pop(key, None)
        self._opted_in_pods[key] = None
        self.sandbox_opted_in_at.labels(namespace, pod).set(at)
        while len(self._opted_in_pods) > _OPT_IN_SERIES:
            oldest = next(iter(self._opted_in_pods))
            del self._opted_in_pods[oldest]
            self.sandbox_opted_in_at.remove(*oldest)

    def observe_cri_upstream(self, method: str, code: str, seconds: float) -> None:
        self.cri_upstream.labels(method, code).observe(seconds)

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
