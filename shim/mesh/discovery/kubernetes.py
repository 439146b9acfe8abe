"""Peers from the EndpointSlices of the weft DaemonSet's headless Service: the parsing (pure) and the I/O."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import httpx2
import lightkube
from lightkube.resources.discovery_v1 import EndpointSlice

from shim import log
from shim.errors import WeftError
from shim.kube.access import KubeconfigNotYet
from shim.mesh.discovery.base import DEFAULT_PORT_NAME, SERVICE_NAME_LABEL, DiscoveryError, DiscoveryUnavailable, Peer

# Any fixed order would do when a node shows up in two slices (dual-stack); it
# only has to be the same on every re-list, so an unchanged cluster is never
# reported as a change.
_ADDRESS_TYPES = ("IPv4", "IPv6")

_log = log.get("weft.mesh.discovery")

# --- kubernetes: parsing ----------------------------------------------------


def peers_from_endpointslices(
    slices: Iterable[Any], *, port_name: str = DEFAULT_PORT_NAME, self_node: str | None = None
) -> list[Peer]:
    """Peers from ``discovery.k8s.io/v1`` EndpointSlices, one per node, sorted by node.

    Accepts dicts as in the API's JSON and lightkube model objects. Skipped:
    this node (``self_node``), endpoints without ``nodeName`` (nothing to key a
    peer by; the controller sets it for every pod-backed endpoint), slices of
    any address type but IPv4 and IPv6 (FQDN is deprecated and not a pod
    address), and slices without endpoints. A node in several slices (a pod
    being replaced, or dual-stack) keeps its ready endpoint, then IPv4.

    Raises ``DiscoveryError`` when a slice with endpoints has no port named
    ``port_name``: the Service is misconfigured and every peer would be wrong.
    """
    best: dict[str, tuple[tuple[bool, int, str], Peer]] = {}
    for raw in slices:
        es = _as_dict(raw)
        address_type = es.get("addressType")
        endpoints = es.get("endpoints") or []
        # The controller keeps a placeholder slice (no endpoints, no ports)
        # while the Service selects no pods: that is "no peers", not an error.
        if address_type not in _ADDRESS_TYPES or not endpoints:
            continue
        port = _named_port(es, port_name)
        for endpoint in endpoints:
            node = endpoint.get("nodeName")
            addresses = endpoint.get("addresses") or []
            if not node or not addresses or node == self_node:
                continue
            # A nil condition means ready (discovery.k8s.io/v1 EndpointConditions).
            ready = (endpoint.get("conditions") or {}).get("ready") is not False
            # The controller puts exactly one address on an endpoint; others have no defined meaning.
            peer = Peer(node=node, address=addresses[0], port=port, ready=ready)
            rank = (not ready, _ADDRESS_TYPES.index(address_type), peer.address)
            if node not in best or rank < best[node][0]:
                best[node] = (rank, peer)
    return [best[node][1] for node in sorted(best)]


def _as_dict(obj: Any) -> Mapping[str, Any]:
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    if isinstance(obj, Mapping):
        return obj
    raise DiscoveryError(f"expected an EndpointSlice (a mapping or a lightkube object), got {type(obj).__name__}")


def _named_port(es: Mapping[str, Any], port_name: str) -> int:
    ports = es.get("ports") or []
    for port in ports:
        if (port.get("name") or "") == port_name and port.get("port"):
            return int(port["port"])
    meta = es.get("metadata") or {}
    namespace = meta.get("namespace") or "?"
    service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL) or "?"
    names = ", ".join(repr(p.get("name") or "") for p in ports) or "none"
    raise DiscoveryError(
        f"Service {namespace}/{service} has no port named {port_name!r} "
        f"(EndpointSlice {meta.get('name') or '?'} has ports: {names}); "
        f"name the mesh port {port_name!r} in the Service's spec.ports, or set the port name weft looks for"
    )


# --- kubernetes: I/O --------------------------------------------------------


class KubeClient(Protocol):
    """The part of ``lightkube.Client`` discovery uses (same keywords, so the real client fits)."""

    def list(self, res: Any, *, namespace: str | None = None, labels: Any = None) -> Iterable[Any]: ...

    def watch(
        self, res: Any, *, namespace: str | None = None, labels: Any = None, resource_version: str | None = None
    ) -> Iterator[tuple[str, Any]]: ...


class EndpointSliceDiscovery:
    """Peers from the EndpointSlices of ``namespace/service``, listed and watched through lightkube.

    The watch re-lists on every event and reports the whole list, and only
    when it differs from the last one reported: the mesh wants "the peers
    now", and a list cannot drift the way a cache patched by events can. The
    stop event is checked between events and during backoff waits; a watch
    with no events blocks in the API read, so run ``watch`` in a daemon thread.
    """

    def __init__(
        self,
        namespace: str,
        service: str,
        *,
        client: KubeClient | None = None,
        client_factory: Callable[[], KubeClient] | None = None,
        port_name: str = DEFAULT_PORT_NAME,
        self_node: str | None = None,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
    ) -> None:
        if not namespace or not service:
            raise ValueError(f"namespace and service must be set, got {namespace!r} and {service!r}")
        self.namespace = namespace
        self.service = service
        self.port_name = port_name
        self.self_node = self_node
        self._client = client
        self._factory = client_factory
        self._owns_client = False
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max

    @property
    def _labels(self) -> dict[str, str]:
        return {SERVICE_NAME_LABEL: self.service}

    def client(self) -> KubeClient:
        """The injected client, or one built now by the factory (or from in-cluster config or KUBECONFIG).

        A factory that cannot build one yet (its kubeconfig not written) raises DiscoveryUnavailable: the
        watch waits and asks again.
        """
        if self._client is None and self._factory is not None:
            try:
                self._client = self._factory()
            except WeftError as exc:
                raise DiscoveryUnavailable(f"no Kubernetes API client yet: {exc.message}") from exc
            self._owns_client = True
        if self._client is None:
            try:
                self._client = lightkube.Client()
            # KeyError: a mounted service account token but no KUBERNETES_SERVICE_HOST
            # (lightkube reads os.environ[...] directly).
            except (lightkube.ConfigError, KeyError, OSError) as exc:
                detail = f"{exc.args[0]} is not set" if isinstance(exc, KeyError) else _describe(exc)
                raise DiscoveryError(
                    f"no Kubernetes API configuration to discover peers from Service "
                    f"{self.namespace}/{self.service} ({detail}): give the agent --kubeconfig (or "
                    f"[kubernetes] kubeconfig, or KUBECONFIG), run it in-cluster with its service account "
                    f"token mounted, or set mesh.peers to a static peers file"
                ) from exc
            self._owns_client = True
        return self._client

    def close(self) -> None:
        """Close the client if this object built it (an injected one belongs to the caller)."""
        if self._owns_client and self._client is not None:
            self._client.close()
        self._client = None
        self._owns_client = False

    def list(self) -> list[Peer]:
        slices, _ = self._list_slices()
        return self._parse(slices)

    def watch(self, on_change: Callable[[list[Peer]], None], stop: threading.Event) -> None:
        """Call ``on_change`` with the full peer list now and whenever it changes, until ``stop`` is set.

        API errors are logged (``mesh.discovery.failed``) and retried after a
        wait that doubles from ``backoff_initial`` up to ``backoff_max``, reset
        once a watch delivers an event. Without a client factory, a missing
        Kubernetes configuration is raised at once (waiting will not fix it);
        with one, a client it cannot build yet is retried like an API error.
        Exceptions from ``on_change`` propagate. A client this object built is closed when the watch ends, by
        the watch's own thread (never under a request in flight).
        """
        try:
            self._watch(on_change, stop)
        finally:
            self.close()

    def _watch(self, on_change: Callable[[list[Peer]], None], stop: threading.Event) -> None:
        last: list[Peer] | None = None
        delay = self._backoff_initial
        waiting_for_kubeconfig = False
        if self._factory is None:
            self.client()  # no way to build one later either: say so at once
        while not stop.is_set():
            had_event = False
            try:
                client = self.client()
                slices, version = self._list_slices()
                peers = self._parse(slices)
                if peers != last:
                    last = self._report(on_change, peers)
                with self._api("watch"):
                    for _event, _obj in client.watch(
                        EndpointSlice, namespace=self.namespace, labels=self._labels, resource_version=version
                    ):
                        if stop.is_set():
                            return
                        had_event = True
                        delay = self._backoff_initial
                        peers = self._parse(self._list_slices()[0])
                        if peers != last:
                            last = self._report(on_change, peers)
            except DiscoveryError as exc:
                # 410 Gone after events: the version the watch resumed from was
                # compacted away, routine on a long watch; a fresh list gives a
                # new one. Gone on a version just listed is no routine: back off.
                if isinstance(exc, _Expired) and had_event:
                    _log.info("mesh.discovery.expired", namespace=self.namespace, service=self.service)
                    continue
                if isinstance(exc.__cause__, KubeconfigNotYet):  # said once; looked for again shortly
                    if not waiting_for_kubeconfig:
                        _log.info("mesh.discovery.waiting", namespace=self.namespace, service=self.service,
                                  error=str(exc), every=self._backoff_initial)
                    waiting_for_kubeconfig = True
                    stop.wait(self._backoff_initial)
                    continue
                waiting_for_kubeconfig = False
                _log.warning(
                    "mesh.discovery.failed", namespace=self.namespace, service=self.service,
                    error=str(exc), retry_in=delay,
                )
                stop.wait(delay)
                delay = min(delay * 2, self._backoff_max)

    def _report(self, on_change: Callable[[list[Peer]], None], peers: list[Peer]) -> list[Peer]:
        _log.info(
            "mesh.discovery.changed", namespace=self.namespace, service=self.service,
            peers=len(peers), ready=sum(p.ready for p in peers),
        )
        on_change(list(peers))
        return peers

    def _parse(self, slices: Iterable[Any]) -> list[Peer]:
        return peers_from_endpointslices(slices, port_name=self.port_name, self_node=self.self_node)

    def _list_slices(self) -> tuple[list[Any], str | None]:
        client = self.client()
        with self._api("list"):
            result = client.list(EndpointSlice, namespace=self.namespace, labels=self._labels)
            slices = list(result)
        try:
            version = getattr(result, "resourceVersion", None)
        except lightkube.NotReadyError:
            version = None
        return slices, version

    @contextmanager
    def _api(self, verb: str) -> Iterator[None]:
        """Turn what lightkube and httpx raise into DiscoveryError, cause chained."""
        what = f"{verb} EndpointSlices of Service {self.namespace}/{self.service}"
        try:
            yield
        except httpx2.HTTPError as exc:
            status = _http_status(exc)
            if status == 410:
                raise _Expired(what) from exc
            if status in (401, 403):
                raise DiscoveryError(
                    f"cannot {what}: {_describe(exc)}; grant the agent's service account get, list and watch "
                    f"on endpointslices.discovery.k8s.io in namespace {self.namespace}"
                ) from exc
            raise DiscoveryUnavailable(f"cannot {what}: {_describe(exc)}") from exc
        except lightkube.ConfigError as exc:
            # Raised per request too, e.g. when the service account token file disappears.
            raise DiscoveryError(f"cannot {what}: {_describe(exc)}") from exc
        except OSError as exc:
            raise DiscoveryUnavailable(f"cannot {what}: {_describe(exc)}") from exc


class _Expired(DiscoveryUnavailable):
    """410 Gone: start again from a fresh list, without waiting."""


def _http_status(exc: httpx2.HTTPError) -> int | None:
    # lightkube raises ApiError (with a decoded Status) for ERROR events in a
    # watch stream and failed requests, but plain HTTPStatusError when a watch
    # request itself is refused.
    status = getattr(exc, "status", None)
    if status is not None and getattr(status, "code", None):
        return int(status.code)
    response = getattr(exc, "response", None) if isinstance(exc, httpx2.HTTPStatusError) else None
    if response is not None:
        return response.status_code
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


