"""Peer discovery: which other weft agents this node's mesh can dial.

Peers come from one of two places, and both give the same value, a list of
``Peer``, so the mesh never knows which one was used:

- **static**: ``[[mesh.peers]]`` tables in the config file, for tests and the
  local demo (``parse_static_peers``, ``StaticDiscovery``);
- **kubernetes**: the EndpointSlices of the weft DaemonSet's headless Service.
  The EndpointSlice controller already tracks which weft pod runs on which node
  and whether it is ready, so weft reads that instead of keeping a registry.

The Kubernetes side is split in two. ``peers_from_endpointslices`` is a pure
function over EndpointSlice objects as the API returns them (JSON dicts, or
lightkube's model objects), tested on recorded responses. ``EndpointSliceDiscovery``
is the I/O: it lists and watches through a lightkube client that is injected,
so tests hand it a fake, and is built lazily, so an agent configured for static
peers never needs a kubeconfig.

A peer that is not ready is still reported (``ready=False``): whether to dial
it is the mesh's decision, and running locally is always the fallback.
"""

from __future__ import annotations

import ipaddress
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import httpx2
import lightkube
from lightkube.resources.discovery_v1 import EndpointSlice

from shim import log
from shim.errors import ConfigError, WeftError
from shim.kube.access import KubeconfigNotYet

_log = log.get("weft.mesh.discovery")

DEFAULT_PORT = 7443
DEFAULT_PORT_NAME = "mesh"
# Set by the EndpointSlice controller on every slice it makes for a Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

# Node names end up in certificate SANs (shim.mesh.certs), so they must be what
# Kubernetes allows for a node: a lowercase DNS name.
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_HOST_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*")
_STATIC_KEYS = ("node", "address", "port")
# Any fixed order would do when a node shows up in two slices (dual-stack); it
# only has to be the same on every re-list, so an unchanged cluster is never
# reported as a change.
_ADDRESS_TYPES = ("IPv4", "IPv6")


class DiscoveryError(WeftError):
    """Peers cannot be discovered until someone fixes something: the message says what.

    No Kubernetes configuration, no RBAC to read EndpointSlices, or a Service
    without the mesh port.
    """

    code = grpc.StatusCode.FAILED_PRECONDITION


class DiscoveryUnavailable(DiscoveryError):
    """The Kubernetes API did not answer, or answered with an error that may pass."""

    code = grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True)
class Peer:
    """Another weft agent: the node it runs on and where its mesh listens."""

    node: str
    address: str
    port: int
    ready: bool = True

    @property
    def target(self) -> str:
        """``host:port`` as gRPC dials it (IPv6 addresses bracketed)."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


class Discovery(Protocol):
    """What the mesh needs from a source of peers."""

    def list(self) -> list[Peer]: ...

    def watch(self, on_change: Callable[[list[Peer]], None], stop: threading.Event) -> None: ...


# --- static ---------------------------------------------------------------


def parse_static_peers(
    entries: Sequence[Mapping[str, Any]], *, field: str = "mesh.peers", self_node: str | None = None
) -> list[Peer]:
    """Peers from config tables such as ``{node = "cpu-1", address = "10.0.0.5", port = 7443}``.

    ``port`` defaults to 7443. Errors are ``ConfigError`` (the config loader
    already reports those) and name the entry and key: ``mesh.peers[2].address: missing``.
    ``self_node`` is validated like the others and then left out, so one list
    can be shared by every node.
    """
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
        raise ConfigError(f"{field}: expected a list of tables, got {entries!r}")
    peers: list[Peer] = []
    seen_nodes: dict[str, int] = {}
    seen_targets: dict[tuple[str, int], int] = {}
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: expected a table like {{node = ..., address = ...}}, got {entry!r}")
        for key in entry:
            if key not in _STATIC_KEYS:
                raise ConfigError(f"{where}.{key}: unknown setting (known: {', '.join(_STATIC_KEYS)})")
        node = _static_node(entry, where)
        address = _static_address(entry, where)
        port = _static_port(entry, where)
        if node in seen_nodes:
            raise ConfigError(f"{where}.node: {node!r} is already listed at {field}[{seen_nodes[node]}]")
        if (address, port) in seen_targets:
            raise ConfigError(
                f"{where}: {address} port {port} is already listed at {field}[{seen_targets[address, port]}]"
            )
        seen_nodes[node] = i
        seen_targets[address, port] = i
        if node != self_node:
            peers.append(Peer(node=node, address=address, port=port))
    return peers


def _static_node(entry: Mapping[str, Any], where: str) -> str:
    if "node" not in entry:
        raise ConfigError(f"{where}.node: missing")
    node = entry["node"]
    if not isinstance(node, str):
        raise ConfigError(f"{where}.node: expected a string, got {node!r}")
    if not node:
        raise ConfigError(f"{where}.node: empty")
    if len(node) > 253 or not _NODE_NAME.fullmatch(node):
        raise ConfigError(f"{where}.node: {node!r} is not a lowercase DNS name (a Kubernetes node name)")
    return node


def _static_address(entry: Mapping[str, Any], where: str) -> str:
    if "address" not in entry:
        raise ConfigError(f"{where}.address: missing")
    address = entry["address"]
    if not isinstance(address, str):
        raise ConfigError(f"{where}.address: expected a string, got {address!r}")
    if not address:
        raise ConfigError(f"{where}.address: empty")
    try:
        return str(ipaddress.ip_address(address.strip("[]")))
    except ValueError:
        pass
    if ":" in address:
        raise ConfigError(f"{where}.address: {address!r} is not an IP address or host name (give the port as port)")
    if len(address) > 253 or not _HOST_NAME.fullmatch(address):
        raise ConfigError(f"{where}.address: {address!r} is not an IP address or host name")
    return address


def _static_port(entry: Mapping[str, Any], where: str) -> int:
    port = entry.get("port", DEFAULT_PORT)
    if not isinstance(port, int) or isinstance(port, bool):
        raise ConfigError(f"{where}.port: expected an integer, got {port!r}")
    if not 1 <= port <= 65535:
        raise ConfigError(f"{where}.port: {port} is out of range (1-65535)")
    return port


class StaticDiscovery:
    """The configured list, behind the same interface as the Kubernetes source."""

    def __init__(self, peers: Iterable[Peer]) -> None:
        self._peers = list(peers)

    def list(self) -> list[Peer]:
        return list(self._peers)

    def watch(self, on_change: Callable[[list[Peer]], None], stop: threading.Event) -> None:
        """Report the list once; it only changes when the agent restarts with a new file."""
        on_change(self.list())
        stop.wait()


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


PEER_ROLES = {"gpu": "gpu", "cpu": "cpu", "both": "gpu,cpu", "gpu,cpu": "gpu,cpu"}


def load_peers_file(path: Path, *, self_node: str | None = None) -> tuple[list[Peer], dict[str, str]]:
    """A static peers file (``--peers FILE``): TOML, one ``[[peer]]`` table per node.

    Each table has ``name``, ``address`` (``HOST:PORT`` of its mesh) and
    ``role`` (gpu, cpu or both). Returns the peers (this node left out) and
    each peer's declared role. Errors name the file, the entry and the key.
    """
    import tomllib

    try:
        doc = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"peers file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"peers file {path}: {exc}") from exc
    unknown = set(doc) - {"peer"}
    if unknown:
        raise ConfigError(f"peers file {path}: unknown top-level keys {sorted(unknown)} (expected [[peer]] tables)")
    tables = doc.get("peer", [])
    entries, roles = [], {}
    for i, table in enumerate(tables):
        where = f"{path}: peer[{i}]"
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}: expected a table")
        extra = set(table) - {"name", "address", "role"}
        if extra:
            raise ConfigError(f"{where}: unknown keys {sorted(extra)} (name, address, role)")
        address = str(table.get("address", ""))
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"{where}.address: {address!r} is not HOST:PORT")
        role = str(table.get("role", "both"))
        if role not in PEER_ROLES:
            raise ConfigError(f"{where}.role: {role!r} is not gpu, cpu or both")
        entries.append({"node": table.get("name", ""), "address": host.strip("[]"), "port": int(port)})
        roles[str(table.get("name", ""))] = PEER_ROLES[role]
    peers = parse_static_peers(entries, field=f"{path}: peer", self_node=self_node)
    return peers, {p.node: roles[p.node] for p in peers}
