"""A shadow's life on its host: run (pull, sandbox, volumes, create, start), start, status, remove.

The origin asks over the mesh (``RunShadow``); this node runs the container
through its own containerd: one shadow sandbox per origin sandbox (made on
first use), the image pulled with the credentials kubelet gave the origin
(held in memory for the pull only), the container created and started at low
CPU weight so the node's own pods are never starved. Every shadow carries
``weft.io/origin-node`` and ``weft.io/origin-key`` (a digest of the key),
which is how this node finds them again after a restart; the full key and
the limits it was admitted by ride along as annotations. A host never runs
what is unsafe to reroute (privileged, host namespaces, host paths,
devices) or what a baseline pod may not run (``shim.core.baseline``),
whatever the origin asks, and it builds the configs it gives containerd from
an allowlist of fields (``shim.crishared.baseline``), never by passing the
origin's through. The pod's read-only volumes come copied (``volumes``), in
parts (``RunShadowChunked``): ``receiving`` reads them under the caps as they
arrive, and nothing is written before the last part is in.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import failpoint, log
from shim._pb import mesh_pb2 as pb
from shim.core.reservation import Stage
from shim.crishared import baseline
from shim.crishared.labels import (
    CPU_LIMIT_ANNOTATION,
    CPU_SHARES_ANNOTATION,
    KEY_ANNOTATION,
    KEY_LABEL,
    MEMORY_LIMIT_ANNOTATION,
    ORIGIN_LABEL,
    POD_LABEL,
    SANDBOX_LABEL,
)
from shim.crishared.mark import MARK_LABEL
from shim.errors import BadAnnotation, UpstreamError, WeftError
from shim.mesh import upload
from shim.shadowhost import cpu_limit
from shim.shadowhost import seccomp as host_seccomp
from shim.shadowhost import volumes as shadow_volumes
from shim.shadowhost.capacity import HostedCapacity, limits
from shim.shadowhost.cgroup_driver import HostCgroupDriver
from shim.shadowhost.context import HostContext
from shim.shadowhost.reservations import ApiUnreachable, ReservationRefused, Reservations
from shim.shadowhost.runtime import IMG, RT, ShadowRuntime, label

_log = log.get("weft.shadows")

# cpu.shares of a hosted container: the floor, so any of the node's own pods outweighs it.
HOSTED_CPU_SHARES = 2
# Under memory pressure on the whole host, a hosted container is the first the kernel kills, as a guest.
HOSTED_OOM_SCORE_ADJ = 1000


# A pod UID as an origin may send it: Kubernetes' are UUIDs; no '/', no '..', nothing a cgroup path would read.
_UID = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class NotAdmitted(WeftError):
    """RunShadow of a container this host would not admit now (its limits against its free capacity)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnsafeShadow(BadAnnotation):
    """The origin asked this host to run something that must never be rerouted."""

    code = grpc.StatusCode.PERMISSION_DENIED


def _unsafe(sandbox: cri.PodSandboxConfig, config: cri.ContainerConfig) -> str:
    sc = config.linux.security_context
    if sc.privileged or sandbox.linux.security_context.privileged:
        return "privileged"
    for opts in (sc.namespace_options, sandbox.linux.security_context.namespace_options):
        if opts.network == cri.NODE or opts.pid == cri.NODE or opts.ipc == cri.NODE:
            return "host namespaces"
    if config.mounts:
        return f"mounts ({config.mounts[0].host_path})"  # volumes are copied by the origin, never bound
    if config.devices or config.CDI_devices:
        return "devices"
    # containerd writes the log at <sandbox log directory>/<log_path>: it must stay inside.
    if config.log_path.startswith("/") or ".." in PurePosixPath(config.log_path).parts or "\0" in config.log_path:
        return f"a log path outside the pod's log directory ({config.log_path})"
    decision = baseline.check(config, sandbox)
    if not decision.allowed:
        return f"what a baseline pod may not do ({decision.reason.value}: {decision.detail})"
    return ""


def sandbox_to_use(existing: Iterable[cri.PodSandbox], attempt: int) -> tuple[str | None, int]:
    """A ready shadow sandbox of the pod to reuse, else None and the attempt a new one takes (``attempt``, the
    origin's, unless a dead one holds it).

    A sandbox that is no longer ready (its host rebooted, its pause process
    was killed) keeps its name reserved in containerd until it is removed,
    which happens with its last shadow; a new one with the same metadata would
    be refused, so it is the next attempt, as kubelet makes one.
    """
    existing = list(existing)
    ready = [s for s in existing if s.state == cri.SANDBOX_READY]
    if ready:
        return ready[0].id, ready[0].metadata.attempt
    return None, max([attempt, *(s.metadata.attempt + 1 for s in existing)])


def _safe_component(value: str, what: str) -> str:
    if not value or "/" in value or "\0" in value or value in (".", ".."):
        raise BadAnnotation(f"{what} {value!r} cannot name a directory")
    return value


def admitted_with(req: pb.RunShadowRequest, config: cri.ContainerConfig) -> tuple[float, int]:
    """(CPU cores, memory bytes) the origin was admitted with: the container's limits, or the requests from the
    pod spec the origin sent for one without limits."""
    if req.HasField("admitted") and (req.admitted.cpu_cores > 0 or req.admitted.memory_bytes > 0):
        return req.admitted.cpu_cores, int(req.admitted.memory_bytes)
    return limits(config.linux.resources)


def _empty_dir(volumes: Path, i: int, e: pb.EmptyDir) -> Path:
    if not e.container_path.startswith("/"):
        raise BadAnnotation(f"emptyDir at {e.container_path!r}: a container path must be absolute")
    path = volumes / f"empty-{i}"
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)  # as kubelet makes an emptyDir: any user of the container may write it
    if e.size_limit:  # kept beside it, for the host's check (HostSide.check_empty_dirs), as kubelet's eviction
        (volumes / f"empty-{i}.limit").write_text(json.dumps({"bytes": e.size_limit, "path": e.container_path}))
    return path


class Lifecycle:
    def __init__(self, rt: ShadowRuntime, ctx: HostContext, capacity: HostedCapacity, state_dir: Path,
                 cgroup_parent: str) -> None:
        self.rt, self.ctx, self.capacity = rt, ctx, capacity
        # Shadows live under a cgroup of this host's choosing: the origin's pod cgroup path means
        # nothing here, and one under kubelet's own tree would be cleaned up by it as an orphaned pod.
        self.cgroup_parent = cgroup_parent
        # Spelled the way this host's containerd runs cgroups, asked of it: never from the origin's request.
        self.cgroup_driver = HostCgroupDriver(rt.call)
        self.log_root = state_dir / "shadow-logs"
        # What marks a sandbox or container as one this host made (the list verbs hide only those).
        self.mark = ctx.mark
        self.volume_root = state_dir / "shadow-volumes"
        # Creating and removing shadows (and their sandboxes) one at a time: sandbox reuse stays simple.
        self.lock = threading.Lock()
        # Reservation pods (shim.shadowhost.reservations), where the agent has the Kubernetes API; None: none,
        # and shadows run at the lowest CPU weight, off Kubernetes' books.
        self.reservations: Reservations | None = None
        # The mesh server's Admit rule (AdmitRequest -> AdmitResponse), asked again by RunShadow itself: an
        # origin that skipped Admit, or asks for more than it was admitted with, is refused. None: no mesh.
        self.admit: Callable[[pb.AdmitRequest], pb.AdmitResponse] | None = None
        self._volume_lock = threading.Lock()
        self.arriving = shadow_volumes.Arriving()
        # Each started shadow's CPU quota, set once it runs (shim.shadowhost.cpu_limit).
        self.limiter = cpu_limit.Limiter(rt)
        # The runtime's default seccomp profile narrowed to this machine's architecture, for containers that
        # asked for none (shim.shadowhost.seccomp).
        self.profiles = host_seccomp.HostProfiles(state_dir / "seccomp")

    @contextlib.contextmanager
    def receiving(self, origin: str, key: str, stream: Iterator[pb.VolumeUpload], into) -> Iterator[None]:
        """Read a volume stream's parts into ``into`` (the request's volumes) under a container's caps and the
        origin's, part by part; the bytes count against the origin's until the call is done (they are in memory
        until then)."""
        root = self._volume_dir(origin, key)
        with self.arriving.counting(root.parent, root) as take:
            upload.receive(stream, into, shadow_volumes.UPLOAD_CAPS, take)
            yield

    def _volume_dir(self, origin: str, key: str) -> Path:
        return self.volume_root / _safe_component(origin, "origin node") / label(key)

    def run(self, origin: str, req: pb.RunShadowRequest) -> pb.ShadowState:
        began = time.perf_counter()
        try:
            sandbox = cri.PodSandboxConfig.FromString(req.sandbox_config)
            config = cri.ContainerConfig.FromString(req.container_config)
            auth = cri.AuthConfig.FromString(req.auth) if req.auth else None
        except DecodeError as exc:
            raise BadAnnotation(f"RunShadow {req.key}: malformed CRI config from {origin}: {exc}") from None
        unsafe = _unsafe(sandbox, config)
        if unsafe:
            raise UnsafeShadow(f"RunShadow {req.key}: this host never runs a rerouted container with {unsafe}")
        asked_shares = config.linux.resources.cpu_shares  # kubelet's, from the container's CPU request
        unconfined = host_seccomp.asked_none(config.linux.security_context)
        config = baseline.hosted_container(config, HOSTED_OOM_SCORE_ADJ)
        sc = config.linux.security_context
        if unconfined:  # confined all the same: the runtime's default, narrowed once learnt (shim.shadowhost.seccomp)
            sc.seccomp.CopyFrom(self.profiles.profile_for(sc))
        learn = unconfined and sc.seccomp.profile_type == cri.SecurityProfile.RuntimeDefault and \
            self.profiles.wants(sc)
        plans = shadow_volumes.plan(req.volumes)
        volumes = self._volume_dir(origin, req.key)
        origin_labels = {ORIGIN_LABEL: origin, SANDBOX_LABEL: req.origin_sandbox_id,
                         POD_LABEL: label(f"{sandbox.metadata.uid}/{sandbox.metadata.attempt}")}
        # A reservation is made only for a pod bound to the calling origin (asked of the API, before anything).
        # The API unreachable: the shadow is made as before reservations, and reserved once it answers.
        priority_class, unreachable = "", None
        if self.reservations is not None:
            try:
                priority_class = self.reservations.origin_pod(
                    origin, sandbox.metadata.namespace, sandbox.metadata.name, config.metadata.name).priority_class
            except ApiUnreachable as exc:
                unreachable = exc.message
        reserved = self.reservations is not None and unreachable is None
        # The pull may take minutes: outside the lock, so Watch, RemoveShadow and other RunShadows go on.
        self._pull(config.image, auth)
        pulled = time.perf_counter()
        with self.lock:
            locked = time.perf_counter()
            existing = self.rt.find({ORIGIN_LABEL: origin, KEY_LABEL: label(req.key)}, containers=True)
            if existing:  # idempotent: the origin retried
                return self.rt.state(req.key, existing[0].pod_sandbox_id, existing[0].id)
            if self.reservations is not None and self.reservations.cordoned:  # kubectl cordon or drain
                raise NotAdmitted(f"RunShadow {req.key}: this host's Node {self.reservations.node} is cordoned "
                                  "(unschedulable): it takes no new containers")
            cpu, memory = admitted_with(req, config)
            found = time.perf_counter()
            self._admitted(origin, req.key, cpu, memory)
            admitted = time.perf_counter()
            try:
                if plans or req.empty_dirs:
                    shadow_volumes.remove(volumes)  # a leftover of a RunShadow that failed half-way
                if plans:
                    shadow_volumes.check_origin_cap(volumes.parent, plans)
                    shadow_volumes.write(volumes, plans, tmpfs=True)  # a Secret's files never on the disk
                for i, p in enumerate(plans):
                    config.mounts.append(cri.Mount(container_path=p.container_path, readonly=True,
                                                   host_path=str(shadow_volumes.host_path(volumes, i, p))))
                for i, e in enumerate(req.empty_dirs):  # fresh and empty, writable, as kubelet makes one
                    config.mounts.append(cri.Mount(container_path=e.container_path, readonly=False,
                                                   host_path=str(_empty_dir(volumes, i, e))))
                shadow_sandbox = self._shadow_sandbox(origin, req, sandbox, origin_labels)
                checked = time.perf_counter()
                sandbox_id = self._sandbox(shadow_sandbox, origin_labels)
                sandboxed = time.perf_counter()
                # A prepared sandbox was made before the origin's sandbox ID, and so this directory, was known.
                Path(shadow_sandbox.log_directory).mkdir(parents=True, exist_ok=True)
                config.labels.update({**origin_labels, KEY_LABEL: label(req.key),
                                      MARK_LABEL: self.mark.container(origin, label(req.key))})
                config.annotations.update({KEY_ANNOTATION: req.key, CPU_LIMIT_ANNOTATION: repr(cpu),
                                           MEMORY_LIMIT_ANNOTATION: str(memory)})
                # With a reservation on the host's books, the weight of its request, as a local container of
                # that request has; without one, the floor, so that the host's own pods always win.
                config.linux.resources.cpu_shares = (max(HOSTED_CPU_SHARES, asked_shares) if reserved
                                                     else HOSTED_CPU_SHARES)
                config.annotations[CPU_SHARES_ANNOTATION] = str(config.linux.resources.cpu_shares)
                cpu_limit.defer(config)  # set once it runs: runc's setup is not the tenant's to be throttled for
                self.ctx.shadows.making()  # this host's kubelet must never list it
                created = self.rt.call(RT + "CreateContainer", cri.CreateContainerRequest(
                    pod_sandbox_id=sandbox_id, config=config, sandbox_config=shadow_sandbox),
                    cri.CreateContainerResponse)
                made = time.perf_counter()
                if learn:
                    self.profiles.learn(self.rt, created.container_id, sc)
                failpoint.hit("run_shadow.created")
                if self.reservations is not None:
                    self._reserve(origin, req.key, sandbox, config, cpu, memory, priority_class,
                                  created.container_id, unreachable)
                    failpoint.hit("run_shadow.reserved")
                if req.start:
                    self.rt.call(RT + "StartContainer", cri.StartContainerRequest(container_id=created.container_id),
                               cri.StartContainerResponse)
                    self.limiter.later(created.container_id, config.annotations, f"RunShadow {req.key}")
            except BaseException:
                with contextlib.suppress(WeftError):  # the original error is the one to report
                    if (plans or req.empty_dirs) and not self.rt.find({ORIGIN_LABEL: origin,
                                                                       KEY_LABEL: label(req.key)}, containers=True):
                        shadow_volumes.remove(volumes)
                raise
        self.capacity.forget()  # what it holds counts from now
        if req.start:
            self.limiter.after(self.capacity.reweigh)
        done = time.perf_counter()
        _log.info("shadow.created", origin=origin, key=req.key, sandbox_id=sandbox_id,
                  container_id=created.container_id, image=config.image.image, started=req.start,
                  volumes=len(plans), unreserved=unreachable is not None,
                  **_ms(pull_ms=(began, pulled), wait_ms=(pulled, locked), find_ms=(locked, found),
                        admit_ms=(found, admitted),
                        check_ms=(admitted, checked), sandbox_ms=(checked, sandboxed),
                        create_ms=(sandboxed, made), total_ms=(began, done)))
        state = self.rt.state(req.key, sandbox_id, created.container_id)
        if unreachable is not None:
            state.note = ("made without its reservation, the Kubernetes API did not answer: by the rules from before "
                          "reservations (the lowest CPU weight); the reservation follows once the API answers")
        return state

    def _reserve(self, origin: str, key: str, sandbox: cri.PodSandboxConfig, config: cri.ContainerConfig,
                 cpu: float, memory: int, priority_class: str, container_id: str, unreachable: str | None) -> None:
        """The shadow's reservation pod, with the limits it was admitted by; the API refusing it undoes the
        shadow (the origin then runs the container itself, with the reason). The API unreachable: the shadow
        runs UNRESERVED until it answers."""
        assert self.reservations is not None
        meta = sandbox.metadata
        stage = Stage(host=self.reservations.node, origin_node=origin, namespace=meta.namespace, pod=meta.name,
                      container=config.metadata.name, key=key, cpu_millis=round(cpu * 1000), memory_bytes=memory,
                      priority_class=priority_class)
        if unreachable is not None:
            self.reservations.defer(stage, unreachable)
            return
        try:
            self.reservations.reserve(stage)
        except ApiUnreachable:
            pass  # deferred by reserve: made once the API answers
        except ReservationRefused:
            with contextlib.suppress(WeftError):
                self.rt.call(RT + "RemoveContainer", cri.RemoveContainerRequest(container_id=container_id),
                             cri.RemoveContainerResponse)
            raise

    def _admitted(self, origin: str, key: str, cpu: float, memory: int) -> None:
        """Admission again, under the lock every creation holds: what fits now, limits (or requests) required."""
        if self.admit is None:
            return
        # Measured afresh: a cached sample (a Hello's, taken while the last RunShadow was making its shadow) would
        # leave that shadow out; under this lock nothing else is being made.
        self.capacity.forget()
        answer = self.admit(pb.AdmitRequest(origin_node=origin, key=key,
                                            limits=pb.Resources(cpu_cores=cpu, memory_bytes=memory)))
        if not answer.admitted:
            raise NotAdmitted(f"RunShadow {key}: this host does not admit it now ({answer.reason}: {answer.detail})")

    def start(self, origin: str, key: str) -> pb.ShadowState:
        t0 = time.perf_counter()
        c = self.rt.one(origin, key)
        t1 = time.perf_counter()
        if c.state == cri.CONTAINER_CREATED:
            held = self.reservations.state(key) if self.reservations is not None else None
            if held is not None and held["state"] == "lost":  # StopContainer leaves a made shadow as it is
                raise NotAdmitted(f"StartShadow {key}: its reservation was lost ({held.get('reason', '')}): this "
                                  "host does not run it")
            self.rt.call(RT + "StartContainer", cri.StartContainerRequest(container_id=c.id),
                       cri.StartContainerResponse)
            t2 = time.perf_counter()
            self.limiter.later(c.id, c.annotations, f"StartShadow {key}")  # not after a resize: that one wins
            # The running set changed: measured afresh, and the group weighed again after the answer.
            self.capacity.forget()
            self.limiter.after(self.capacity.reweigh)
            state = self.rt.state(key, c.pod_sandbox_id, c.id)
            t3 = time.perf_counter()
            _log.info("shadow.started", origin=origin, key=key, container_id=c.id,
                      **_ms(find_ms=(t0, t1), start_ms=(t1, t2), status_ms=(t2, t3)))
            return state
        return self.rt.state(key, c.pod_sandbox_id, c.id)

    def _shadow_sandbox(self, origin: str, req: pb.RunShadowRequest, sandbox: cri.PodSandboxConfig,
                        origin_labels: dict[str, str]) -> cri.PodSandboxConfig:
        """The origin's sandbox config as this host runs it: its own log directory, cgroup and labels.

        CreateContainer must be given this one too: containerd takes a
        container's log directory and cgroup from the request's sandbox config.
        """
        if not _UID.fullmatch(sandbox.metadata.uid):
            # It names the shadow's cgroup: "../../x" would put the shadow outside this host's cgroup parent.
            raise UnsafeShadow(f"RunShadow {req.key}: pod UID {sandbox.metadata.uid[:80]!r} from {origin} is not a "
                               "UID (letters, digits, '-', '_' and '.', at most 128, no '..')")
        shadow = baseline.hosted_sandbox(sandbox)
        shadow.metadata.uid = f"{sandbox.metadata.uid}-shadow"
        shadow.labels.update(origin_labels)
        shadow.labels[MARK_LABEL] = self.mark.sandbox(origin, shadow.metadata.uid)
        # A prepared sandbox (no origin sandbox ID yet) holds no log: it gets the origin's directory.
        shadow.log_directory = str(self._sandbox_logs(origin, req.origin_sandbox_id) if req.origin_sandbox_id
                                   else self.log_root / _safe_component(origin, "origin node"))
        shadow.linux.cgroup_parent = shadow_cgroup(self.cgroup_parent, shadow.metadata.uid,
                                                   systemd=self.cgroup_driver.systemd)
        # No port mappings: the pod's ports are the origin's; the mesh stitches what is needed.
        return shadow

    def _sandbox(self, shadow: cri.PodSandboxConfig, origin_labels: dict[str, str]) -> str:
        """The pod's ready shadow sandbox, or a new one (``shadow``'s attempt set to follow any dead one).

        Found by the origin's sandbox ID, or by the pod (``POD_LABEL``): one the
        origin had prepared before its sandbox ID was known
        (``shim.shadowhost.prepare``).
        """
        self.ctx.shadows.making()  # this host's kubelet must never list it
        found: dict[str, cri.PodSandbox] = {}
        for key in (SANDBOX_LABEL, POD_LABEL):
            if origin_labels.get(key):
                for s in self.rt.find({ORIGIN_LABEL: origin_labels[ORIGIN_LABEL], key: origin_labels[key]},
                                      containers=False):
                    found.setdefault(s.id, s)
        ready, shadow.metadata.attempt = sandbox_to_use(found.values(), shadow.metadata.attempt)
        if ready:
            return ready
        return self.rt.call(RT + "RunPodSandbox", cri.RunPodSandboxRequest(config=shadow),
                          cri.RunPodSandboxResponse).pod_sandbox_id

    def _sandbox_logs(self, origin: str, origin_sandbox_id: str) -> Path:
        return self.log_root / _safe_component(origin, "origin node") / label(origin_sandbox_id)

    def _pull(self, image: cri.ImageSpec, auth: cri.AuthConfig | None) -> None:
        present = self.rt.call(IMG + "ImageStatus", cri.ImageStatusRequest(image=image), cri.ImageStatusResponse)
        if not present.image.id:
            self.rt.call(IMG + "PullImage", cri.PullImageRequest(image=image, auth=auth), cri.PullImageResponse)

    def status(self, origin: str, key: str) -> pb.ShadowState:
        c = self.rt.one(origin, key)
        return self.rt.state(key, c.pod_sandbox_id, c.id)

    def remove(self, origin: str, key: str) -> bool:
        with self.lock:
            found = self.rt.find({ORIGIN_LABEL: origin, KEY_LABEL: label(key)}, containers=True)
            if not found:
                shadow_volumes.remove(self._volume_dir(origin, key))
                return False
            self.remove_locked(origin, key, found[0])
        return True

    def remove_locked(self, origin: str, key: str, c: cri.Container, why: str = "removed") -> None:
        """Stop and remove a shadow, its sandbox with its last container, its volumes and its logs (lock held)."""
        status = self.rt.status(c.id)
        self.limiter.drop(c.id)  # no deferred quota lands on a container being removed
        try:
            # At once, as containerd's RemoveContainer does: the origin's kubelet gave the grace period when
            # it stopped the container; waiting here would hold the lock every other shadow call needs.
            self.rt.stop(c.id)
            self.rt.call(RT + "RemoveContainer", cri.RemoveContainerRequest(container_id=c.id),
                       cri.RemoveContainerResponse)
            rest = self.rt.find({ORIGIN_LABEL: origin}, containers=True)
            last = not [x for x in rest if x.pod_sandbox_id == c.pod_sandbox_id]
            if last:
                self.rt.remove_sandbox(c.pod_sandbox_id)
        except UpstreamError as exc:
            if exc.code is not grpc.StatusCode.NOT_FOUND:
                raise
            last = False
        shadow_volumes.remove(self._volume_dir(origin, key) if key else
                              self.volume_root / _safe_component(origin, "origin node") / c.labels[KEY_LABEL])
        if status is not None and status.log_path:
            log_file = Path(status.log_path)
            log_file.unlink(missing_ok=True)
            _rmdir_up(log_file.parent, self.log_root)
        if last and c.labels.get(SANDBOX_LABEL) is not None:
            _rmtree_quietly(self._sandbox_logs(origin, c.labels[SANDBOX_LABEL]))
            _rmdir_up(self.log_root / origin, self.log_root)
        self.capacity.updated.pop(c.id, None)
        failpoint.hit("remove_shadow.removed")
        if self.reservations is not None:
            self.reservations.release(key or c.annotations.get(KEY_ANNOTATION, ""))
        self.capacity.reweigh()
        _log.info(f"shadow.{why}", origin=origin, key=key, container_id=c.id)

    def sync_volumes(self, origin: str, req: pb.SyncVolumesRequest) -> pb.SyncVolumesResponse:
        plans = shadow_volumes.plan(req.volumes)
        c = self.rt.one(origin, req.key)
        with self._volume_lock:
            where = self._volume_dir(origin, req.key)
            shadow_volumes.check_origin_cap(where.parent, plans, replacing=where)
            changed = shadow_volumes.sync(where, plans)
        _log.info("shadow.volumes_synced", origin=origin, key=req.key, container_id=c.id, changed=changed)
        return pb.SyncVolumesResponse(changed=changed)


def _rmdir_up(path: Path, stop: Path) -> None:
    """Remove ``path`` and its parents while they are empty, up to (not including) ``stop``."""
    while path != stop and stop in path.parents:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


def _rmtree_quietly(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _ms(**spans: tuple[float, float]) -> dict[str, float]:
    """Each span (start, end of ``time.perf_counter``) in milliseconds, for a log event."""
    return {name: round((end - start) * 1e3, 2) for name, (start, end) in spans.items()}


def shadow_cgroup(parent: str, uid: str, *, systemd: bool) -> str:
    """The shadow sandbox's cgroup parent under ``parent``, in the cgroup driver's own spelling."""
    if systemd:  # a slice: "weft_shadows-pod<uid>.slice" nests under weft_shadows.slice
        base = parent.strip("/").removesuffix(".slice").replace("-", "_") or "weft_shadows"
        return f"{base}-pod{uid.replace('-', '_')}.slice"
    return f"{parent.rstrip('/')}/pod{uid}"
