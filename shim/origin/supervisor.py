"""The origin's background work for its remote containers: status, loss, logs and volumes.

* **Watch**: one stream per CPU host this origin deals with (every one in a
  small fleet; its candidates and the hosts of its shadows in a large one,
  see shim/core/tracking.py), over which the host pushes its shadows' states
  as they change, its own state (room, health) when it moves, and a
  heartbeat only after ``WATCH_IDLE_S`` without another message. Each
  message is contact with the host, and so is the open stream itself once the
  host has shown it knows this (its first heartbeat carries its state): the
  mesh's keepalive ends a stream over a dead link within seconds, and a
  stream quiet past ``WATCH_QUIET_S`` (an agent wedged while its gRPC core
  answers pings) is ended here. Such a host is not said Hello to while its
  Watch is open. A host of an older weft heartbeats every interval, is said
  Hello to, and only its messages count. The request lists the keys this
  origin owns, so the host removes shadows it no longer should run.
* **Loss**: a remote container whose host has not been heard from (Hello or
  Watch) for ``loss_timeout`` is reported exited with reason ``WeftPeerLost``.
  The host fences (kills) it after its shorter ``fence_timeout``, so by the
  time kubelet starts another copy the first is dead: at most one live copy.
  A lost container whose host comes back still running is killed there.
* **Logs**: per started container, the shadow's log is streamed from the
  host and appended to the file kubelet gave, in the CRI format containerd
  wrote it in. The host offset and the local file size are recorded after
  each chunk; after a crash, a tail written but not recorded is cut off and
  streamed again, so nothing is lost or written twice.
* **Volumes**: every ``volume_interval`` the read-only volumes of running
  containers are read again, and a change is sent to the host
  (SyncVolumes), which replaces the files in place.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim.config import WATCH_IDLE_S, WATCH_QUIET_S
from shim.core.reroute import classify_mounts
from shim.crishared.remote import HostStream, Remote
from shim.crishared.sides import OriginFabric
from shim.errors import WeftError
from shim.origin.context import Origin
from shim.origin.place import read_volumes
from shim.periodic import Periodic

_log = log.get("weft.remote")

# How often the supervisor reads which hosts its placement records name (a shadow may be on one of them).
PLACED_EVERY_S = 5.0


class LogCopy(HostStream):
    """Copies one remote container's log into kubelet's file; one thread, restartable after a crash."""

    def __init__(self, sup: RemoteSupervisor, r: Remote) -> None:
        super().__init__()
        self.sup, self.r = sup, r
        self._lock = threading.Lock()
        self._file = None
        rec = sup.fabric.store.placement(r.id)
        self.offset = rec.log_offset if rec else 0
        self.size = rec.log_size if rec else 0
        self.thread = threading.Thread(target=self._run, name=f"weft-log-{r.id[:12]}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _open(self) -> None:
        path = self.r.log_path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        actual = os.path.getsize(path) if os.path.exists(path) else 0
        if actual > self.size:
            # Written before a crash but never recorded: it will be streamed again.
            with open(path, "r+b") as f:
                f.truncate(self.size)
        elif actual < self.size:
            self.size = actual  # kubelet rotated the file while the agent was down
        self._file = open(path, "ab")  # noqa: SIM115 - held across chunks, closed in _close

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def reopen(self) -> None:
        """kubelet renamed the file: continue in a new one at its path."""
        with self._lock:
            self._close()
            self.size = 0
            self._open()
            self.sup.fabric.store.set_log_progress(self.r.id, self.offset, self.size)

    def _write(self, chunk) -> None:
        data = chunk.data
        if chunk.offset < self.offset:  # overlap after a reconnect: skip what is written
            data = data[self.offset - chunk.offset:]
        elif chunk.offset > self.offset:
            _log.warning("remote.log_gap", container_id=self.r.id, expected=self.offset, got=chunk.offset)
            self.offset = chunk.offset
        if not data:
            return
        with self._lock:
            self._file.write(data)
            self._file.flush()
            self.offset += len(data)
            self.size += len(data)
            self.sup.fabric.store.set_log_progress(self.r.id, self.offset, self.size)

    def _run(self) -> None:
        r = self.r
        _log.debug("remote.log_copy", container_id=r.id, node=r.node, path=r.log_path, offset=self.offset)
        try:
            with self._lock:
                self._open()
        except OSError as exc:
            _log.warning("remote.log_unwritable", container_id=r.id, path=r.log_path, error=str(exc))
            return
        try:
            while not self._stop.is_set() and not r.lost:
                client = self.sup.mesh.client(r.node)
                if client is None:
                    self._stop.wait(1.0)
                    continue
                try:
                    self._call = client.stream_log(self.sup.mesh.node, r.key, self.offset)
                    for chunk in self._call:
                        self._write(chunk)
                except grpc.RpcError as exc:
                    if self._stop.is_set() or exc.code() is grpc.StatusCode.CANCELLED:
                        return
                    if exc.code() is grpc.StatusCode.NOT_FOUND:
                        return  # the shadow is gone; Watch reports what that means
                    _log.debug("remote.log_retry", container_id=r.id, node=r.node, code=exc.code().name,
                               error=exc.details())
                    self._stop.wait(1.0)
                    continue
                except OSError as exc:
                    _log.warning("remote.log_unwritable", container_id=r.id, path=r.log_path, error=str(exc))
                    return
                _log.debug("remote.log_copied", container_id=r.id, node=r.node, offset=self.offset)
                return  # the stream ended: the container exited and everything was copied
        finally:
            with self._lock:
                self._close()
            self.sup.logs.pop(r.id, None)


class RemoteSupervisor:
    def __init__(self, fabric: OriginFabric, origin: Origin, *, loss_timeout: float, heartbeat: float,
                 volume_interval: float = 5.0, tick: float = 0.5) -> None:
        self.fabric, self.origin, self.mesh = fabric, origin, origin.mesh
        self.loss_timeout = loss_timeout
        self.heartbeat = heartbeat
        self.volume_interval = volume_interval
        self.tick = tick
        self.logs: dict[str, LogCopy] = {}
        self._watches: dict[str, threading.Thread] = {}
        self._calls: dict[str, Any] = {}
        self._last_msg: dict[str, float] = {}
        self._pushing: set[str] = set()  # hosts whose open Watch pushes their state: the stream is contact
        self._wanted: set[str] = set()
        self._placed: set[str] = set()
        self._placed_at = -PLACED_EVERY_S
        self._volume_digest: dict[str, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._loops = [Periodic("weft-remote", tick, self._round, failed="remote.supervisor_failed"),
                       Periodic("weft-remote-volumes", volume_interval, self._volumes, failed="remote.volumes_failed")]
        origin.events.started.append(self.started)
        origin.events.reopened.append(self.reopen)
        origin.events.removed.append(self.removed)

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        for r in self.fabric.remotes.all():
            if r.status is not None and r.status.started_at and not r.lost:
                self.started(r)
        for loop in self._loops:
            loop.start()

    def stop(self) -> None:
        self._stop.set()
        for call in list(self._calls.values()):
            call.cancel()
        for copy in list(self.logs.values()):
            copy.stop()
        for loop in self._loops:
            loop.stop()

    # -- hooks from the CRI verbs ----------------------------------------------------------
    def started(self, r: Remote) -> None:
        if not r.log_path:
            return
        with self._lock:
            if r.id in self.logs or self._stop.is_set():
                return
            copy = self.logs[r.id] = LogCopy(self, r)
        copy.start()

    def reopen(self, r: Remote) -> None:
        copy = self.logs.get(r.id)
        if copy is not None:
            copy.reopen()

    def removed(self, r: Remote) -> None:
        copy = self.logs.pop(r.id, None)
        if copy is not None:
            copy.stop()
        self._volume_digest.pop(r.id, None)

    # -- watch and loss ----------------------------------------------------------------------
    def _round(self) -> None:
        self._ensure_watches()
        self._check_losses()
        self.fabric.metrics.remote_containers.set(len(self.fabric.remotes.all()))

    def _ensure_watches(self) -> None:
        mesh = self.mesh
        # The hosts this node deals with (every one in a small fleet), and wherever it has or had a shadow.
        nodes = set(mesh.hosts()) | {r.node for r in self.fabric.remotes.all()} | self._placed_on()
        self._wanted = nodes
        now = time.monotonic()
        for node, call in list(self._calls.items()):
            if node not in nodes:
                call.cancel()  # no longer a host of ours: the stream ends, its thread with it
        for node in nodes:
            t = self._watches.get(node)
            if t is None or not t.is_alive():
                t = self._watches[node] = threading.Thread(target=self._watch, args=(node,),
                                                           name=f"weft-watch-{node}", daemon=True)
                t.start()
            call = self._calls.get(node)
            # A stream that went quiet (a cut link TCP has not noticed, a wedged agent) is ended, and opened again.
            pushing = node in self._pushing
            quiet = WATCH_QUIET_S if pushing else max(3 * self.heartbeat, 5.0)
            if call is not None and now - self._last_msg.get(node, now) > quiet:
                call.cancel()
            elif call is not None and pushing and call.is_active():
                mesh.heard(node)  # open, so alive: keepalive ends it within seconds of a cut link

    def _placed_on(self) -> set[str]:
        """The hosts of this origin's placement records (pending ones too), read again every few seconds."""
        now = time.monotonic()
        if now - self._placed_at > PLACED_EVERY_S:
            self._placed = {p.remote_node for p in self.fabric.store.remote_placements() if p.remote_node}
            self._placed_at = now
        return self._placed

    def _keys_on(self, node: str) -> list[str]:
        fabric = self.fabric
        keys = {r.key for r in fabric.remotes.on_node(node)}
        keys |= {p.key for p in fabric.store.remote_placements() if p.remote_node == node}
        return sorted(keys | fabric.inflight())

    def _watch(self, node: str) -> None:
        mesh = self.mesh
        while not self._stop.is_set():
            if node not in self._wanted:
                return  # no longer a host of ours: _ensure_watches starts another if it becomes one again
            client = mesh.client(node)
            if client is None:
                return  # no longer a peer: _ensure_watches starts another if it comes back
            pause = 1.0
            try:
                call = self._calls[node] = client.watch(mesh.node, self._keys_on(node), self.heartbeat,
                                                        idle_heartbeat_s=WATCH_IDLE_S)
                self._last_msg[node] = time.monotonic()
                for state in call:
                    self._last_msg[node] = time.monotonic()
                    mesh.heard(node)
                    if state.HasField("peer"):
                        self._pushing.add(node)
                        mesh.pushed(node, state.peer)
                    if not state.heartbeat:
                        self._pushed(node, state)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED):
                    pause = 30.0  # a peer that hosts nothing (or an older weft): ask again much later
            finally:
                self._calls.pop(node, None)
                self._pushing.discard(node)
                mesh.unwatched(node)
            self._stop.wait(pause)

    def _pushed(self, node: str, state) -> None:
        remotes = self.fabric.remotes
        r = remotes.by_key(node, state.key)
        if r is None:
            return
        if state.gone:
            if remotes.mark_lost(r, self.mesh.silent_for(node), f"its shadow on {node} is gone"):
                _log.warning("remote.gone", container_id=r.id, node=node, key=r.key)
                self.fabric.metrics.remote_lost.inc()
            return
        try:
            status = cri.ContainerStatus.FromString(state.status)
        except DecodeError:
            _log.warning("remote.garbage_status", container_id=r.id, node=node, key=r.key)
            return
        if not remotes.update(r, status) and status.state == cri.CONTAINER_RUNNING:
            # Declared lost here, yet running there: the fence did not happen; make it so now.
            _log.warning("remote.kill_lost_copy", container_id=r.id, node=node, key=r.key)
            try:
                self.mesh.client(node).call(self.mesh.node, r.key, "StopContainer",
                                                   cri.StopContainerRequest(container_id=r.id).SerializeToString(),
                                                   10.0)
            except (WeftError, AttributeError) as exc:
                _log.warning("remote.kill_failed", container_id=r.id, node=node, error=str(exc))
        elif status.started_at and r.id not in self.logs and not r.lost:
            self.started(r)

    def _check_losses(self) -> None:
        mesh = self.mesh
        for r in self.fabric.remotes.all():
            if r.lost or r.exited:
                continue
            silent = mesh.silent_for(r.node)
            if silent > self.loss_timeout and self.fabric.remotes.mark_lost(r, silent):
                _log.warning("remote.lost", container_id=r.id, node=r.node, key=r.key, silent_s=round(silent, 1))
                self.fabric.metrics.remote_lost.inc()
                copy = self.logs.get(r.id)
                if copy is not None:
                    copy.stop()

    # -- volumes -------------------------------------------------------------------------------
    def _volumes(self) -> None:
        for r in self.fabric.remotes.all():
            if r.lost or r.exited or not r.config.mounts:
                continue
            try:
                self._sync_volumes(r)
            except (WeftError, OSError) as exc:
                _log.warning("remote.volumes_deferred", container_id=r.id, node=r.node,
                             error=getattr(exc, "message", str(exc)))

    def _sync_volumes(self, r: Remote) -> None:
        mounts = classify_mounts(((m.host_path, m.container_path, m.readonly) for m in r.config.mounts),
                                 self.origin.settings.pods_dir)
        volumes = read_volumes(r.config, mounts.readonly_copyable)
        digest = hashlib.sha256(b"".join(v.SerializeToString(deterministic=True) for v in volumes)).hexdigest()
        if self._volume_digest.get(r.id) == digest:
            return
        client = self.mesh.client(r.node)
        if client is None:
            return
        changed = client.sync_volumes(self.mesh.node, r.key, volumes)
        self._volume_digest[r.id] = digest
        if changed:
            _log.info("remote.volumes_synced", container_id=r.id, node=r.node, files=changed)
