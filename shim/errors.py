"""weft's typed errors, each carrying the gRPC status code it maps to.

Handlers raise these; only the CRI instrumentation wrapper turns them into a
gRPC status, so the mapping lives here and nowhere else::

    WeftError                      (UNKNOWN)
    ├── ConfigError                configuration file or flag is invalid (INVALID_ARGUMENT)
    │   └── KubeconfigNotYet       the agent's kubeconfig is named but not written yet (shim.kube.access;
    │                              INVALID_ARGUMENT)
    ├── BadAnnotation              a weft.io/ annotation holds a bad value (INVALID_ARGUMENT)
    │   └── UnsafeShadow           a host refuses a shadow it may not run (shim.shadowhost.lifecycle; PERMISSION_DENIED)
    ├── NotAdmitted                a host would not admit RunShadow now (shim.shadowhost.lifecycle; RESOURCE_EXHAUSTED)
    ├── MalformedRequest           a request weft must read does not parse (INVALID_ARGUMENT)
    ├── SocketInUse                another process serves the socket (ALREADY_EXISTS)
    ├── StateError                 the state database cannot be used (shim.state.db; INTERNAL)
    │   └── StateStoreFull         its disk is full: no new opted-in work (shim.state.db; RESOURCE_EXHAUSTED)
    ├── BrokerUnavailable          the GPU broker cannot be reached (UNAVAILABLE)
    ├── LeaseRefused               the broker has no room for the GPU ask (RESOURCE_EXHAUSTED)
    ├── LeaseNotFound              no such lease (NOT_FOUND)
    ├── LeaseConflictError         the lease is bound to another container (FAILED_PRECONDITION)
    ├── MpsError                   a lease's MPS daemon cannot start or take its limits (shim.broker.mps; UNAVAILABLE)
    ├── UnknownContainer           weft placed no such container (NOT_FOUND)
    ├── CreateInProgress           the same CreateContainer is already being served (ABORTED)
    ├── HostUnavailable            a remote container's host is not a peer now (UNAVAILABLE)
    ├── CannotStart                a remote container was lost with its host (FAILED_PRECONDITION)
    ├── NoStreamServer             no streaming relay for a remote container's session (UNKNOWN)
    ├── RemoteStopFailed           a pod's remote containers could not all be stopped (UNAVAILABLE)
    ├── PeerRefused                a peer's identity or claim is refused (shim.mesh.identity; PERMISSION_DENIED)
    ├── PeerUnavailable            a peer cannot be reached (shim.mesh.client; UNAVAILABLE)
    ├── PeerTooOld                 a peer's weft predates what a call needs, and it cannot be sent the old way
    │                              (shim.mesh.client; FAILED_PRECONDITION)
    ├── PeerBusy                   a peer has as many calls of a kind open as it may (shim.mesh.quotas;
    │                              RESOURCE_EXHAUSTED)
    ├── MessageTooLarge            a mesh request over its method's limit (shim.mesh.wire; RESOURCE_EXHAUSTED)
    ├── UploadRefused              a stream of copied volumes out of order (shim.mesh.upload; INVALID_ARGUMENT)
    │   └── UploadTooLarge         past a cap as it arrives (shim.mesh.upload; RESOURCE_EXHAUSTED)
    ├── TunnelError                a tunnel cannot be opened or broke (shim.mesh.tunnel.ends; UNAVAILABLE)
    ├── TunnelRefused              a tunnel token is refused (shim.shadowhost.tunnel; PERMISSION_DENIED)
    ├── RefusedCall                a peer asks for a shadow call that is not allowed (shim.shadowhost.calls;
    │                              PERMISSION_DENIED)
    ├── NoLog                      a shadow has no log file to follow (shim.shadowhost.watch; FAILED_PRECONDITION)
    ├── BadVolume                  a copied volume is refused (shim.shadowhost.volumes; INVALID_ARGUMENT)
    │   ├── VolumesTooLarge        over the per-container cap (shim.shadowhost.volumes; RESOURCE_EXHAUSTED)
    │   └── VolumesChanged         changed while being copied (shim.shadowhost.volumes; FAILED_PRECONDITION)
    ├── VolumesUnwritable          no tmpfs can be made for a copied volume (shim.shadowhost.volumes; UNAVAILABLE)
    ├── NetnsError                 a pod's network namespace cannot be entered (shim.crishared.netns; UNKNOWN)
    ├── DiscoveryError             peers cannot be found through Kubernetes (shim.mesh.discovery.base;
    │   │                          FAILED_PRECONDITION)
    │   └── DiscoveryUnavailable   the API server cannot be reached now (shim.mesh.discovery.base;
    │                              UNAVAILABLE)
    ├── ReportError                weft report cannot give a verdict (shim.report.errors; UNKNOWN)
    │   ├── UsageError             a flag's value cannot be used (shim.report.errors; UNKNOWN)
    │   ├── UnknownWorkload        no such workload in Prometheus (shim.report.errors; UNKNOWN)
    │   ├── NoOptInRecord          no opt-in time is known (shim.report.errors; UNKNOWN)
    │   └── PrometheusError        Prometheus answered an error (shim.report.errors; UNKNOWN)
    ├── CredentialsError           no token from the API now; the keeper retries (shim.kube.credentials; UNKNOWN)
    ├── EnrollError                no mesh certificate from the API now; the keeper retries (shim.mesh.enroll; UNKNOWN)
    │   └── CertificateDenied      the mesh signer refused this node's request, with its reason (shim.mesh.enroll;
    │                              UNKNOWN)
    ├── WatchError                 a watch of Pods failed (shim.kube.watch; UNKNOWN)
    ├── ReservationRefused         the API would not make a shadow's reservation pod, or the origin does not own
    │                              the pod (shim.shadowhost.reservations; FAILED_PRECONDITION)
    ├── ApiUnreachable             the API server did not answer: a shadow's reservation waits for it
    │                              (shim.shadowhost.reservations; UNAVAILABLE)
    ├── InstallError               install/uninstall stopped; the message says what was undone (FAILED_PRECONDITION)
    │   └── UnrecognisedHost       a containerd/kubelet file it cannot parse or does not know; nothing changed
    │       └── UntestedContainerd the node's containerd is not a version the tests run; nothing changed
    └── UpstreamError              containerd answered with a status (any code)
        ├── UpstreamUnavailable    containerd's socket is missing or dead (UNAVAILABLE)
        └── LimitNotSet            containerd refused a started shadow's CPU quota; the host stopped it
                                   (shim.shadowhost.cpu_limit; any code)

Errors that belong to one subsystem live in its module (named in brackets);
the rest live here. ``tests/test_errors.py`` checks that this tree lists every
subclass of :class:`WeftError` under its real base.

Causes are chained (``raise ... from exc``) so the log shows what went wrong
underneath.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc


class WeftError(Exception):
    """Base of every error weft raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(WeftError):
    """The configuration names a bad value; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class BadAnnotation(WeftError):
    """A ``weft.io/`` annotation the agent must read holds a bad value; the message names both."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class MalformedRequest(WeftError):
    """A request weft must read (a container of an opted-in pod) does not parse."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class BrokerUnavailable(WeftError):
    """The GPU broker did not answer; only GPU containers of opted-in pods see this."""

    code = grpc.StatusCode.UNAVAILABLE


class LeaseRefused(WeftError):
    """No device (in the pod's packing domain) has room for the ask."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class LeaseNotFound(WeftError):
    code = grpc.StatusCode.NOT_FOUND


class LeaseConflictError(WeftError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class CreateInProgress(WeftError):
    """kubelet retried a CreateContainer while the first one is still running; it will retry again."""

    code = grpc.StatusCode.ABORTED


class UnknownContainer(WeftError):
    code = grpc.StatusCode.NOT_FOUND


class SocketInUse(WeftError):
    """Another live process already serves the socket we were asked to serve."""

    code = grpc.StatusCode.ALREADY_EXISTS


class InstallError(WeftError):
    """``weft install``/``uninstall`` stopped; the message says what failed and what state the host is in."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class UnrecognisedHost(InstallError):
    """A host file the installer cannot parse or does not recognise; the message names it. Nothing was changed."""


class UntestedContainerd(UnrecognisedHost):
    """The node's containerd is not a line weft is tested with (1.6, 1.7, 2.x); the message says where it was read."""


class HostUnavailable(WeftError):
    """The host of a remote container is not a peer any more (its calls cannot be made)."""

    code = grpc.StatusCode.UNAVAILABLE


class CannotStart(WeftError):
    """A remote container was lost with its host: nothing runs in it, and it cannot be started or changed."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NoStreamServer(WeftError):
    """This agent runs no streaming relay, so a remote container's session has nowhere to go."""


class RemoteStopFailed(WeftError):
    """StopPodSandbox could not stop some of the pod's remote containers on their hosts; kubelet retries."""

    code = grpc.StatusCode.UNAVAILABLE


class UpstreamError(WeftError):
    """containerd answered with a status: passed on to the client unchanged."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        trailing_metadata: Sequence[tuple[str, str | bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.trailing_metadata = tuple(trailing_metadata or ())


class UpstreamUnavailable(UpstreamError):
    """containerd could not be reached; the message names its socket."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, socket: str, detail: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            f"weft: containerd is unavailable at {socket}: {detail}",
        )
        self.socket = socket
