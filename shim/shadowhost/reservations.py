"""A host's reservation pods: one per shadow, so Kubernetes counts, arbitrates and shows hosted stages.

For each shadow it runs, the host creates a Pod in weft's namespace bound to
itself (``shim.core.reservation``: the stage's requests, the origin pod's
priority) and watches the reservation pods bound to it. The shadow starts
before its reservation is admitted (a CRI start is not held up by an API
round trip and kubelet's admission), and lives only as long as it: a
reservation kubelet refuses, or that is deleted, evicted or preempted, stops
its shadow at once (``on_lost``); one still not admitted after ``grace`` stops
it too. Both ways round, nothing is left: a reservation whose shadow is gone
is deleted, at start and every ``RECONCILE_S``.

The origin pod is read from the API before anything is made: a peer can ask
for a reservation only for a pod bound to itself (the pod's ``nodeName`` is
the calling origin), and the reservation takes that pod's priority and its
container's memory request.

API server unreachable (``ApiUnreachable``): running shadows run on (nothing
is judged without the API), and a new one is made as it was before
reservations, at the lowest CPU weight, UNRESERVED; once the API answers,
reconciliation checks its origin pod and makes its reservation (or stops it,
if the origin did not own the pod).

What decides what the host does next with a shadow (its reservation's
state, when it was made and the grace it has, the stage an UNRESERVED one
waits to reserve) is kept in the agent's state store as it changes, and read
back at start: an agent killed at any step of a reservation's life goes on
from that step. A reservation it had seen lost is acted on again: a shadow the loss was
stopping when the agent died is stopped, with the same reason.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Protocol

import grpc
import httpx2
import lightkube
from lightkube.resources.core_v1 import Node, Pod

from shim import failpoint, log
from shim.core.quantity import AnnotationError, parse_memory
from shim.core.reservation import (
    ROLE,
    ROLE_LABEL,
    STOP_TOKEN_HEADER,
    LossReason,
    ReservationState,
    Stage,
    StopHook,
    Verdict,
    name_of,
    pod_manifest,
    verdict,
)
from shim.errors import WeftError
from shim.kube.access import ApiAccess
from shim.kube.watch import PodWatch
from shim.periodic import Periodic
from shim.shadowhost.budgets import StageBudgets
from shim.state.agent import ReservationRecord

_log = log.get("weft.reservations")
RECONCILE_S = 5.0
WATCH_S = 5
# A reservation made once the API is back after an outage: the host's kubelet sees it only when its pod watch
# reconnects, and client-go's reflector retries with a backoff capped at 30 s plus up to as much again of
# jitter, then lists; the shadow has been running all along, so it is not judged before two such retries.
AFTER_OUTAGE_GRACE_S = 150.0


class ReservationRefused(WeftError):
    """The API server would not make the reservation (quota, admission webhook, Pod Security), or the origin
    does not own the pod it asked for."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ApiUnreachable(WeftError):
    """The Kubernetes API server did not answer: no reservation can be made or checked now."""

    code = grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True)
class OriginPod:
    priority_class: str
    memory_request: int  # of the container, bytes; 0 when it declares none


@dataclass
class Held:
    key: str
    name: str
    created: float  # monotonic
    state: ReservationState = ReservationState.PENDING
    lost: Verdict | None = None
    stage: Stage | None = None  # UNRESERVED: what to reserve once the API is back
    grace: float | None = None  # the admission grace, when not the host's own
    replay: bool = False  # lost before a restart: its loss is acted on again (reconcile)


class ReservationStore(Protocol):
    """Where the host keeps its reservations' records (``shim.state.agent.AgentStore``)."""

    def put_reservation(self, rec: ReservationRecord) -> None: ...

    def drop_reservation(self, key: str) -> None: ...

    def reservations(self) -> list[ReservationRecord]: ...


def _record(held: Held) -> ReservationRecord:
    created_at = time.time() - (time.monotonic() - held.created)
    stage = json.dumps(asdict(held.stage)) if held.stage is not None else ""
    lost = held.lost
    return ReservationRecord(held.key, held.name, created_at, held.state.value, stage, held.grace,
                             lost.reason.value if lost is not None and lost.reason else "",
                             lost.detail if lost is not None else "")


def _from_record(rec: ReservationRecord) -> Held:
    created = time.monotonic() - max(0.0, time.time() - rec.created_at)
    stage = Stage(**json.loads(rec.stage)) if rec.stage else None
    state = ReservationState(rec.state)
    held = Held(rec.key, rec.name, created, state, stage=stage, grace=rec.grace)
    if state is ReservationState.LOST:
        # Lost before the restart: its shadow may not have stopped yet; reconciliation stops it again.
        held.lost = Verdict(state, LossReason(rec.reason) if rec.reason else None, rec.detail)
        held.replay = True
    return held


class Reservations:
    def __init__(self, api: ApiAccess, node: str, namespace: str, pause_image: str | Callable[[], str],
                 on_lost: Callable[[str, Verdict], None], live_keys: Callable[[], Iterable[str]],
                 *, grace: float = 10.0, metrics=None, store: ReservationStore | None = None) -> None:
        self.api, self.node, self.namespace = api, node, namespace
        # The node's own pause image: given, or asked of containerd when first needed (shim.shadowhost.sandbox_image).
        self._pause_image = pause_image if callable(pause_image) else (lambda: pause_image)
        self.on_lost, self.live_keys, self.grace, self.metrics = on_lost, live_keys, grace, metrics
        self.store = store
        # Where kubelet reaches this agent's HTTP endpoint, and the token of a reservation's name (the host's
        # mark): set by the agent, reservations carry a preStop hook there (``stop_for_kubelet``). None: none.
        self.stop_endpoint: tuple[str, int] | None = None
        self.stop_token: Callable[[str], str] | None = None
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}  # by shadow key
        # This host's Node, read at each reconciliation and each RunShadow: its UID (the reservation pods'
        # controller) and whether it is cordoned, which ``on_cordon`` passes to the mesh's admission.
        self.node_uid = ""
        self.cordoned = False
        self.on_cordon: Callable[[bool], None] | None = None
        self._client: lightkube.Client | None = None
        self._client_lock = threading.Lock()
        labels, fields = self._selectors()
        self._watch = PodWatch(lambda read: api.http(read_timeout=read), namespace, labels, fields,
                               on_list=lambda pods: [self.seen(p) for p in pods],
                               on_event=lambda kind, pod: self.seen(pod, deleted=kind == "DELETED"),
                               name="weft-reservations-watch", failed_event="reservation.watch_failed",
                               watch_s=WATCH_S)
        # The workloads' PodDisruptionBudgets, kept for the reservations (a drain respects them).
        self.budgets = StageBudgets(self.client, node, namespace)
        self._reconciler = Periodic("weft-reservations", RECONCILE_S, self.reconcile,
                                    failed="reservation.reconcile_failed", first=True)

    # -- the records -----------------------------------------------------------------------
    def _keep(self, held: Held) -> None:
        """Write ``held`` through to the store; call with the lock held, so writes land in the order made."""
        if self.store is not None:
            self.store.put_reservation(_record(held))

    def _forget(self, key: str) -> None:
        """Call with the lock held."""
        if self.store is not None:
            self.store.drop_reservation(key)

    def load(self) -> None:
        """The records an earlier run of the agent kept (``start`` reads them before it watches)."""
        if self.store is None:
            return
        with self._lock:
            for rec in self.store.reservations():
                self._held.setdefault(rec.key, _from_record(rec))

    # -- the API -------------------------------------------------------------------------
    def client(self) -> lightkube.Client:
        with self._client_lock:  # one client, however many threads ask first
            if self._client is None:
                self._client = self.api.client()
            return self._client

    def read_node(self) -> None:
        """This host's Node, as the API has it now; where the API does not answer, what was read last."""
        try:
            node = self.client().get(Node, self.node)
        except (lightkube.ApiError, httpx2.TransportError) as exc:
            _log.debug("reservation.node_unread", node=self.node, error=str(exc))
            return
        cordoned = bool(node.spec is not None and node.spec.unschedulable)
        with self._lock:
            self.node_uid = (node.metadata.uid if node.metadata else None) or self.node_uid
            was, self.cordoned = self.cordoned, cordoned
        if was != cordoned:
            _log.info("reservation.node_cordoned" if cordoned else "reservation.node_uncordoned", node=self.node)
        if self.on_cordon is not None:
            self.on_cordon(cordoned)

    def origin_pod(self, origin: str, namespace: str, pod: str, container: str) -> OriginPod:
        """The origin's pod, checked to be bound to the origin: a peer reserves only for its own pods. This
        host's Node is read again too (``cordoned``: the caller takes no new stage then), once the API has
        answered for the pod."""
        try:
            obj = self.client().get(Pod, pod, namespace=namespace)
        except lightkube.ApiError as exc:
            raise ReservationRefused(f"pod {namespace}/{pod} of {origin}: {exc.status.message}") from exc
        except httpx2.TransportError as exc:
            raise ApiUnreachable(f"reading pod {namespace}/{pod} of {origin}: the API server did not answer "
                                 f"({exc!r})") from exc
        if obj.spec is None or obj.spec.nodeName != origin:
            raise ReservationRefused(f"pod {namespace}/{pod} is not bound to {origin} (it is on "
                                     f"{getattr(obj.spec, 'nodeName', None) or 'no node'}): a peer reserves only "
                                     "for its own pods")
        self.read_node()
        memory = 0
        for c in obj.spec.containers or []:
            if c.name == container and c.resources is not None and c.resources.requests:
                try:
                    memory = parse_memory("requests.memory", str(c.resources.requests.get("memory", "0")))
                except AnnotationError:
                    memory = 0
        return OriginPod(obj.spec.priorityClassName or "", memory)

    def reserve(self, stage: Stage) -> None:
        """Create the stage's reservation (idempotent: the same key's one may already be there)."""
        hook = None
        if self.stop_endpoint is not None and self.stop_token is not None:
            hook = StopHook(*self.stop_endpoint, token=self.stop_token(name_of(stage.key)),
                            grace_s=max(2, round(self.grace)))
        if not self.node_uid:
            self.read_node()
        manifest = pod_manifest(stage, namespace=self.namespace, pause_image=self._pause_image(), stop_hook=hook,
                                node_uid=self.node_uid)
        with self._lock:
            if stage.key not in self._held:
                self._held[stage.key] = Held(stage.key, manifest["metadata"]["name"], time.monotonic())
                self._keep(self._held[stage.key])
        try:
            self.client().create(Pod.from_dict(manifest), namespace=self.namespace)
        except lightkube.ApiError as exc:
            if exc.status.code == 409:  # the origin retried: ours is there already
                return
            with self._lock:
                if self._held.pop(stage.key, None) is not None:
                    self._forget(stage.key)
            raise ReservationRefused(f"reservation for {stage.namespace}/{stage.pod}/{stage.container}: "
                                     f"{exc.status.message}") from exc
        except httpx2.TransportError as exc:
            # Whether it was made is unknown: reconciliation finds it on the API, or makes it (UNRESERVED).
            self.defer(stage, f"creating it: the API server did not answer ({exc!r})")
            raise ApiUnreachable(f"reservation for {stage.namespace}/{stage.pod}/{stage.container}: the API "
                                 f"server did not answer ({exc!r})") from exc
        _log.info("reservation.created", key=stage.key, name=manifest["metadata"]["name"], pod=stage.pod,
                  namespace=stage.namespace, container=stage.container, cpu_m=stage.cpu_millis,
                  memory=stage.memory_bytes)

    def defer(self, stage: Stage, why: str) -> None:
        """The stage's shadow runs without its reservation until the API answers (reconciliation makes it)."""
        with self._lock:
            self._held[stage.key] = Held(stage.key, name_of(stage.key), time.monotonic(),
                                         ReservationState.UNRESERVED, stage=stage)
            self._keep(self._held[stage.key])
        _log.warning("reservation.deferred", key=stage.key, pod=stage.pod, namespace=stage.namespace,
                     container=stage.container, why=why)

    def _reserve_deferred(self, held: Held) -> None:
        """The API is back: the origin must still own the pod, then the reservation is made (PENDING)."""
        stage = held.stage
        assert stage is not None
        try:
            origin = self.origin_pod(stage.origin_node, stage.namespace, stage.pod, stage.container)
            if origin.priority_class != stage.priority_class:
                stage = replace(stage, priority_class=origin.priority_class)
            with self._lock:
                if self._held.get(held.key) is held:
                    del self._held[held.key]  # its record stays until reserve writes the new one
            self.reserve(stage)
            with self._lock:
                made = self._held.get(held.key)
                if made is not None and made.state is ReservationState.PENDING:
                    made.grace = max(self.grace, AFTER_OUTAGE_GRACE_S)
                    self._keep(made)
        except ReservationRefused as exc:
            with self._lock:
                self._held.setdefault(held.key, held)
            self._give_up(held, Verdict(ReservationState.LOST, LossReason.REJECTED, exc.message))
        except ApiUnreachable:
            pass  # still away: the next round tries again

    def release(self, key: str) -> None:
        """Delete the shadow's reservation (the shadow is gone); a missing one is fine."""
        with self._lock:
            held = self._held.pop(key, None)
            self._forget(key)  # the API's orphan, if the delete below fails, is reconciliation's
        name = held.name if held else name_of(key)
        try:
            self.client().delete(Pod, name, namespace=self.namespace, grace_period=0)
        except lightkube.ApiError as exc:
            if exc.status.code != 404:
                _log.warning("reservation.delete_failed", key=key, name=name, error=exc.status.message)
                return
        except httpx2.TransportError as exc:  # reconciliation deletes it as an orphan once the API answers
            _log.warning("reservation.delete_failed", key=key, name=name, error=repr(exc))
            return
        _log.info("reservation.deleted", key=key, name=name)

    def stop_for_kubelet(self, name: str, token: str) -> tuple[int, str]:
        """kubelet is ending reservation ``name`` (its preStop hook): stop its shadow, and answer only once it
        has stopped, so that Kubernetes frees the stage's CPU after the shadow, never before. (HTTP status,
        what is said.)"""
        if self.stop_token is None or not hmac.compare_digest(token.encode(), self.stop_token(name).encode()):
            return 403, f"reservation {name}: no or wrong {STOP_TOKEN_HEADER}\n"
        with self._lock:
            held = next((h for h in self._held.values() if h.name == name), None)
        if held is None:  # released by this host (its shadow gone), or a stranger's name with a valid token: none
            return 200, f"reservation {name}: no shadow of it runs on this host\n"
        v = held.lost or self._ending(name)
        if not self._give_up(held, v):
            v = held.lost or v
            self.on_lost(held.key, v)  # the watch's loss: its stop may still be under way, and this answer waits
        _log.info("reservation.stop_hook", key=held.key, name=name, reason=v.reason.value if v.reason else "")
        return 200, f"reservation {name}: its shadow stopped ({v.reason.value if v.reason else 'lost'})\n"

    def _ending(self, name: str) -> Verdict:
        """Why the reservation is ending, as the API says (preempted, evicted, deleted)."""
        try:
            pod = self.client().get(Pod, name, namespace=self.namespace).to_dict()
        except (lightkube.ApiError, httpx2.TransportError):
            pod = None
        v = verdict(pod) if pod is not None else None
        if v is None or v.state is not ReservationState.LOST:
            return Verdict(ReservationState.LOST, LossReason.DELETED, "kubelet is ending the reservation pod")
        return v

    def state(self, key: str) -> dict | None:
        """For ``weft status``: the reservation's name and state."""
        with self._lock:
            held = self._held.get(key)
        if held is None:
            return None
        out = {"name": held.name, "state": held.state.value}
        if held.lost is not None and held.lost.reason is not None:
            out["reason"] = held.lost.reason.value
        elif held.state is ReservationState.UNRESERVED:
            out["reason"] = "ApiUnreachable"  # made by the rules from before reservations, until the API answers
        return out

    # -- watching --------------------------------------------------------------------------
    def start(self) -> None:
        self.load()
        self._watch.start()
        self._reconciler.start()

    def stop(self) -> None:
        self._reconciler.stop()
        self._watch.stop()
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def _selectors(self) -> tuple[dict[str, str], dict[str, str]]:
        return {ROLE_LABEL: ROLE}, {"spec.nodeName": self.node}

    def seen(self, pod: dict, *, deleted: bool = False) -> None:
        """What the API shows of one reservation: its shadow stops if it is lost."""
        key = (pod.get("metadata", {}).get("annotations") or {}).get("weft.io/origin-key-full", "")
        v = verdict(pod, deleted=deleted)
        if v.state is ReservationState.LOST:
            failpoint.pause("reservation.lost_seen")  # a host slow to see it (tests)
        with self._lock:
            held = self._held.get(key)
            if held is None or held.lost is not None:
                return
            changed = held.state is not v.state
            held.state = v.state
            if v.state is ReservationState.LOST:
                held.lost = v
            if changed:
                self._keep(held)
        if v.state is ReservationState.LOST:
            self._lost(key, v)

    def _give_up(self, held: Held, v: Verdict) -> bool:
        """Mark ``held`` lost by ``v`` and act on it; False, doing nothing, if it was lost already."""
        with self._lock:
            if held.lost is not None:
                return False
            held.lost, held.state = v, ReservationState.LOST
            if self._held.get(held.key) is held:
                self._keep(held)
        self._lost(held.key, v)
        return True

    def _lost(self, key: str, v: Verdict) -> None:
        if self.metrics is not None:
            self.metrics.shadows_stopped.labels(v.reason.value if v.reason else "").inc()
        _log.warning("reservation.lost", key=key, reason=v.reason.value if v.reason else "", detail=v.detail)
        try:
            self.on_lost(key, v)
        except WeftError as exc:
            _log.warning("reservation.stop_failed", key=key, error=exc.message)

    def reconcile(self) -> None:
        """No reservation without its shadow, no shadow past the grace without an admitted reservation."""
        self.read_node()
        # The API's list first, then the shadows: a reservation made between the two belongs to a shadow that
        # the second look sees (the other order would take a fresh reservation for an orphan).
        labels, fields = self._selectors()
        pods = list(self.client().list(Pod, namespace=self.namespace, labels=labels, fields=fields))
        live = set(self.live_keys())
        on_api = {(p.metadata.annotations or {}).get("weft.io/origin-key-full", ""): p for p in pods}
        for key, p in on_api.items():
            with self._lock:
                held = self._held.get(key)
            if key not in live and (held is None or held.lost is not None
                                    or time.monotonic() - held.created > self.grace):  # not one being made now
                _log.info("reservation.orphan", key=key, name=p.metadata.name)
                with self._lock:
                    self._held.setdefault(key, Held(key, p.metadata.name, time.monotonic()))
                self.release(key)  # forgets its record too
        now = time.monotonic()
        with self._lock:  # neither shadow nor reservation left (a loss acted on): nothing to remember
            for key, held in list(self._held.items()):
                if key not in live and key not in on_api and (held.lost is not None or now - held.created > self.grace):
                    del self._held[key]
                    self._forget(key)
        for key in live:
            with self._lock:
                held = self._held.get(key)
                if held is None:  # a shadow no record names (from before records were kept): adopt it
                    p = on_api.get(key)
                    held = self._held[key] = Held(key, p.metadata.name if p else name_of(key), now)
                    self._keep(held)
            if held.replay:
                held.replay = False
                self._lost(key, held.lost)
                continue
            p = on_api.get(key)
            if p is None and held.state is ReservationState.UNRESERVED and held.lost is None:
                self._reserve_deferred(held)  # made while the API was away; it answers again
                continue
            if p is not None:
                self.seen(p.to_dict())
            elif held.lost is None and now - held.created > self.grace:
                self._give_up(held, Verdict(ReservationState.LOST, LossReason.DELETED, "its reservation pod is gone"))
            grace = held.grace or self.grace
            if held.lost is None and held.state is ReservationState.PENDING and now - held.created > grace:
                self._give_up(held, Verdict(ReservationState.LOST, LossReason.NOT_ADMITTED,
                                            f"not admitted by kubelet within {grace:g} s"))
        self.budgets.sync((p for key, p in on_api.items() if key in live), self.node_uid)
        if self.metrics is not None:
            with self._lock:
                counts: dict[str, int] = {}
                for h in self._held.values():
                    counts[h.state.value] = counts.get(h.state.value, 0) + 1
            for state in ReservationState:
                self.metrics.reservations.labels(state.value).set(counts.get(state.value, 0))
