"""Which cgroup driver this host's containerd runs its pods with, asked of containerd itself, once.

A shadow's cgroup parent must be spelled the host's way (a path with cgroupfs, a slice with systemd):
the other spelling puts the shadow outside ``mesh.shadow_cgroup_parent`` (at the root of some hierarchies,
inside containerd's own cgroup in others), out of the shadows' group weight. The origin's sandbox config
says how the *origin* spells its cgroups, which is a peer's word and may differ or lie; so the host asks
its own containerd: the CRI ``RuntimeConfig`` call where containerd has it (1.7 from 1.7.x on, 2.x), else
the CRI plugin's own config in a verbose ``Status`` (every release), the ``SystemdCgroup`` option of the
default runtime, which is where the shadows' sandboxes run (they name no runtime handler).
"""

from __future__ import annotations

import enum
import json
import threading
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri

from shim import log
from shim.errors import UpstreamError

_log = log.get("weft.shadows")
RT = "/runtime.v1.RuntimeService/"


class CgroupDriver(enum.StrEnum):
    CGROUPFS = "cgroupfs"
    SYSTEMD = "systemd"


class DriverSource(enum.StrEnum):
    """Where the driver was read: what ``shadow.cgroup_driver`` logs."""

    RUNTIME_CONFIG = "runtime_config"  # the CRI RuntimeConfig call
    STATUS_CONFIG = "status_config"  # the CRI plugin's config in a verbose Status
    DEFAULT = "default"  # neither says: containerd's own default, cgroupfs


def from_cri_config(config: dict[str, Any]) -> CgroupDriver | None:
    """The default runtime's driver in the CRI plugin's config (``Status`` verbose ``info["config"]``).

    None when the config names no default runtime this can find. A runtime without ``SystemdCgroup``
    (or runc v1's ``systemdCgroup``, or the plugin-wide ``systemdCgroup`` of 1.6) runs on cgroupfs, as
    containerd does.
    """
    section = config.get("containerd")
    if not isinstance(section, dict):
        return None
    name = section.get("defaultRuntimeName") or "runc"
    runtimes = section.get("runtimes")
    runtime = runtimes.get(name) if isinstance(runtimes, dict) else None
    if not isinstance(runtime, dict):
        return None
    options = runtime.get("options")
    options = options if isinstance(options, dict) else {}
    systemd = options.get("SystemdCgroup", options.get("systemdCgroup", config.get("systemdCgroup", False)))
    return CgroupDriver.SYSTEMD if systemd is True else CgroupDriver.CGROUPFS


class HostCgroupDriver:
    """The host containerd's driver, read at first use and then kept (a driver changes only with a restart
    of containerd with another config, which kubelet does not survive either)."""

    def __init__(self, call) -> None:
        # call(path, request, response_type) -> response, raising UpstreamError (ShadowRuntime.call).
        self._call = call
        self._lock = threading.Lock()
        self._driver: CgroupDriver | None = None

    def get(self) -> CgroupDriver:
        with self._lock:
            if self._driver is None:
                self._driver, source = self._read()
                _log.info("shadow.cgroup_driver", driver=str(self._driver), source=str(source))
            return self._driver

    @property
    def systemd(self) -> bool:
        return self.get() is CgroupDriver.SYSTEMD

    def _read(self) -> tuple[CgroupDriver, DriverSource]:
        try:
            resp = self._call(RT + "RuntimeConfig", cri.RuntimeConfigRequest(), cri.RuntimeConfigResponse)
        except UpstreamError as exc:
            if exc.code is not grpc.StatusCode.UNIMPLEMENTED:
                raise
        else:
            if resp.HasField("linux"):  # SYSTEMD is the enum's zero: an answer without the field says nothing
                systemd = resp.linux.cgroup_driver == cri.SYSTEMD
                return (CgroupDriver.SYSTEMD if systemd else CgroupDriver.CGROUPFS), DriverSource.RUNTIME_CONFIG
        status = self._call(RT + "Status", cri.StatusRequest(verbose=True), cri.StatusResponse)
        try:
            config = json.loads(status.info.get("config", "{}"))
        except ValueError:
            config = None
        driver = from_cri_config(config) if isinstance(config, dict) else None
        if driver is not None:
            return driver, DriverSource.STATUS_CONFIG
        return CgroupDriver.CGROUPFS, DriverSource.DEFAULT
