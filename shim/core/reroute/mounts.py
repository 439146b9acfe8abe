"""A rerouted container's mounts, sorted: what the host cannot give it, what is copied, what is shared."""

from __future__ import annotations

import enum
import posixpath
from collections.abc import Iterable, Sequence
from pathlib import PurePosixPath
from typing import NamedTuple

KUBELET_PODS_DIR = "/var/lib/kubelet/pods"

_COPYABLE_VOLUMES = frozenset(
    {"kubernetes.io~configmap", "kubernetes.io~secret", "kubernetes.io~projected", "kubernetes.io~downward-api"}
)
_EMPTY_DIR = "kubernetes.io~empty-dir"


class MountSort(NamedTuple):
    host_path_mounts: tuple[str, ...]
    readonly_copyable: tuple[str, ...]
    pod_volumes: tuple[str, ...]  # emptyDirs: the caller checks which a local container also mounts


def classify_mounts(
    mounts: Iterable[tuple[str, str, bool]],
    kubelet_pods_dir: str = KUBELET_PODS_DIR,
    *,
    pod_uid: str | None = None,
) -> MountSort:
    """Sort CRI mounts, given as ``(host_path, container_path, readonly)``, by what rerouting can do with them.

    kubelet lays a pod's files out as::

        <pods dir>/<pod uid>/
            etc-hosts                                 kubelet's /etc/hosts: ignored, the peer writes its own
            containers/<container>/<id>               the termination-log file: ignored, likewise
            volumes/kubernetes.io~configmap/<vol>     \\
            volumes/kubernetes.io~secret/<vol>         | read-only: copied to the peer
            volumes/kubernetes.io~projected/<vol>      | (writable: stays on this node)
            volumes/kubernetes.io~downward-api/<vol>  /
            volumes/kubernetes.io~empty-dir/<vol>     a pod volume: the peer makes an empty one
            volumes/<other plugin>/<vol>              PVC, CSI, local volume: attached to this node
            volume-subpaths/<vol>/<container>/<n>     a subPath bind: the plugin is not in the path
        anything else                                 a hostPath volume

    Whatever cannot follow the container (hostPath, attached storage, subPath
    binds whose source is unknown) is a host path mount. An emptyDir is a pod
    volume even when mounted read-only here: an init or sidecar container
    that stays local may be what fills it. Paths are normalised first, so
    ``..`` cannot make a host path look like a pod's volume; with
    ``pod_uid``, another pod's directory is a host path too.
    """
    pods = PurePosixPath(posixpath.normpath(kubelet_pods_dir))
    host: list[str] = []
    copyable: list[str] = []
    volumes: list[str] = []
    for host_path, _container_path, readonly in mounts:
        path = PurePosixPath(posixpath.normpath(host_path)) if host_path else PurePosixPath()
        try:
            parts = path.relative_to(pods).parts
        except ValueError:
            host.append(str(path))
            continue
        kind = _pod_file_kind(parts, readonly, pod_uid)
        if kind is _Kind.COPYABLE:
            copyable.append(str(path))
        elif kind is _Kind.VOLUME:
            volumes.append(str(path))
        elif kind is _Kind.HOST:
            host.append(str(path))
    return MountSort(tuple(host), tuple(copyable), tuple(volumes))


class _Kind(enum.Enum):
    HOST = "host"
    COPYABLE = "copyable"
    VOLUME = "volume"
    KUBELET = "kubelet"


def _pod_file_kind(parts: Sequence[str], readonly: bool, pod_uid: str | None) -> _Kind:
    if len(parts) < 2 or (pod_uid is not None and parts[0] != pod_uid):
        return _Kind.HOST
    rest = parts[1:]
    if rest == ("etc-hosts",) or (len(rest) == 3 and rest[0] == "containers"):
        return _Kind.KUBELET
    if len(rest) >= 3 and rest[0] == "volumes":
        plugin = rest[1]
        if plugin in _COPYABLE_VOLUMES and readonly:
            return _Kind.COPYABLE
        if plugin == _EMPTY_DIR:
            return _Kind.VOLUME
    return _Kind.HOST
