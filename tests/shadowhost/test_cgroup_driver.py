"""The host spells its shadows' cgroups the way its own containerd runs them, whatever the origin sends."""

import json

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.errors import UpstreamError
from shim.shadowhost.cgroup_driver import CgroupDriver, HostCgroupDriver, from_cri_config
from shim.shadowhost.lifecycle import shadow_cgroup


# The CRI plugin's config as a verbose Status gives it, cut to what matters: 1.6/1.7 and 2.x alike.
def _config(options: dict, name: str = "runc", **top) -> dict:
    return {"containerd": {"defaultRuntimeName": name, "runtimes": {name: {"runtimeType": "io.containerd.runc.v2",
                                                                           "options": options}}}, **top}


@pytest.mark.parametrize(("config", "expected"), [
    (_config({"SystemdCgroup": True}), CgroupDriver.SYSTEMD),
    (_config({"SystemdCgroup": False}), CgroupDriver.CGROUPFS),
    (_config({}), CgroupDriver.CGROUPFS),
    (_config({"SystemdCgroup": True}, name="crun"), CgroupDriver.SYSTEMD),
    (_config({"systemdCgroup": True}), CgroupDriver.SYSTEMD),
    (_config({}, systemdCgroup=True), CgroupDriver.SYSTEMD),
    (_config({"SystemdCgroup": "true"}), CgroupDriver.CGROUPFS),
    ({"containerd": {"defaultRuntimeName": "missing", "runtimes": {}}}, None),
    ({}, None),
], ids=["systemd", "cgroupfs", "unset-is-cgroupfs", "another-default-runtime", "runc-v1-option",
        "plugin-wide-1.6", "not-a-bool", "default-runtime-missing", "no-containerd-section"])
def test_the_default_runtimes_driver_is_read_from_the_cri_plugins_config(config, expected) -> None:
    assert from_cri_config(config) == expected


class _Containerd:
    """Answers RuntimeConfig and Status as a containerd would; counts what it was asked."""

    def __init__(self, runtime_config: cri.RuntimeConfigResponse | grpc.StatusCode, status_config: str) -> None:
        self.runtime_config, self.status_config = runtime_config, status_config
        self.asked: list[str] = []

    def __call__(self, path: str, request, response_type):
        self.asked.append(path.rsplit("/", 1)[1])
        if path.endswith("RuntimeConfig"):
            if isinstance(self.runtime_config, grpc.StatusCode):
                raise UpstreamError(self.runtime_config, "not here")
            return self.runtime_config
        assert request.verbose
        return cri.StatusResponse(info={"config": self.status_config})


def _runtime_config(driver: int) -> cri.RuntimeConfigResponse:
    resp = cri.RuntimeConfigResponse()
    resp.linux.cgroup_driver = driver
    return resp


@pytest.mark.parametrize(("containerd", "expected"), [
    (_Containerd(_runtime_config(cri.SYSTEMD), ""), CgroupDriver.SYSTEMD),
    (_Containerd(_runtime_config(cri.CGROUPFS), ""), CgroupDriver.CGROUPFS),
    (_Containerd(grpc.StatusCode.UNIMPLEMENTED, json.dumps(_config({"SystemdCgroup": True}))), CgroupDriver.SYSTEMD),
    (_Containerd(cri.RuntimeConfigResponse(), json.dumps(_config({}))), CgroupDriver.CGROUPFS),
    (_Containerd(grpc.StatusCode.UNIMPLEMENTED, "not json"), CgroupDriver.CGROUPFS),
], ids=["runtime-config-systemd", "runtime-config-cgroupfs", "1.6-status-config", "no-linux-answer-asks-status",
        "unreadable-is-containerds-default"])
def test_the_driver_is_asked_of_containerd_once(containerd: _Containerd, expected: CgroupDriver) -> None:
    driver = HostCgroupDriver(containerd)
    assert driver.get() is expected
    asked = list(containerd.asked)
    assert driver.get() is expected and containerd.asked == asked  # kept: asked once


def test_containerd_unreachable_is_an_error_and_asked_again_next_time() -> None:
    containerd = _Containerd(grpc.StatusCode.UNAVAILABLE, "")
    driver = HostCgroupDriver(containerd)
    with pytest.raises(UpstreamError):
        driver.get()
    containerd.runtime_config = _runtime_config(cri.SYSTEMD)
    assert driver.systemd


@pytest.mark.parametrize(("systemd", "expected"), [
    (False, "/weft-shadows/podu-1-shadow"),
    (True, "weft_shadows-podu_1_shadow.slice"),
])
def test_the_shadow_cgroup_is_spelled_by_the_hosts_driver(systemd: bool, expected: str) -> None:
    assert shadow_cgroup("/weft-shadows", "u-1-shadow", systemd=systemd) == expected
