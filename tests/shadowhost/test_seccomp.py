"""The runtime's default seccomp profile, learnt from containerd and narrowed to the host's architecture."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.errors import UpstreamError
from shim.shadowhost import seccomp

PROFILE = {
    "defaultAction": "SCMP_ACT_ERRNO",
    "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "syscalls": [{"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"},
                 {"names": ["personality"], "action": "SCMP_ACT_ALLOW",
                  "args": [{"index": 0, "value": 0, "op": "SCMP_CMP_EQ"}]}],
}


class FakeRuntime:
    def __init__(self, spec: object = None, fail: bool = False) -> None:
        self.spec, self.fail, self.asked = spec, fail, []

    def call(self, path: str, request, response_type, timeout: float | None = 120.0):
        assert path.endswith("/ContainerStatus") and request.verbose
        self.asked.append(request.container_id)
        if self.fail:
            raise UpstreamError(grpc.StatusCode.NOT_FOUND, "container gone")
        info = {"runtimeSpec": {"linux": {"seccomp": self.spec}}} if self.spec is not None else {}
        return cri.ContainerStatusResponse(info={"info": json.dumps(info)})


def _sc(*add: str) -> cri.LinuxContainerSecurityContext:
    sc = cri.LinuxContainerSecurityContext()
    sc.capabilities.add_capabilities.extend(add)
    return sc


@pytest.mark.parametrize(("build", "none"), [
    (lambda sc: None, True),  # nothing said: containerd runs it unconfined
    (lambda sc: setattr(sc, "seccomp_profile_path", "unconfined"), True),
    (lambda sc: sc.seccomp.CopyFrom(cri.SecurityProfile(profile_type=cri.SecurityProfile.Unconfined)), True),
    (lambda sc: sc.seccomp.CopyFrom(cri.SecurityProfile(profile_type=cri.SecurityProfile.RuntimeDefault)), False),
    (lambda sc: sc.seccomp.CopyFrom(cri.SecurityProfile(profile_type=cri.SecurityProfile.Localhost,
                                                        localhost_ref="/p.json")), False),
    (lambda sc: setattr(sc, "seccomp_profile_path", "runtime/default"), False),
])
def test_what_counts_as_asking_for_no_profile(build, none: bool) -> None:
    sc = cri.LinuxContainerSecurityContext()
    build(sc)
    assert seccomp.asked_none(sc) is none


def test_the_profile_is_narrowed_to_one_architecture_and_nothing_else_changes() -> None:
    narrowed = seccomp.native_only(PROFILE, "SCMP_ARCH_X86_64")
    assert narrowed == {**PROFILE, "architectures": ["SCMP_ARCH_X86_64"]}
    assert PROFILE["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    assert seccomp.native_only(PROFILE, "SCMP_ARCH_AARCH64") is None
    assert seccomp.native_only({"architectures": ["SCMP_ARCH_X86_64"]}, "SCMP_ARCH_X86_64") is None  # no syscalls


def test_a_container_runs_under_runtime_default_until_the_narrowed_profile_is_learnt(tmp_path: Path) -> None:
    profiles = seccomp.HostProfiles(tmp_path / "seccomp", machine="x86_64")
    sc = _sc()
    assert profiles.profile_for(sc).profile_type == cri.SecurityProfile.RuntimeDefault
    assert profiles.wants(sc)

    path = profiles.learn(FakeRuntime(PROFILE), "c1", sc)
    assert path is not None and path.parent == tmp_path / "seccomp"
    assert json.loads(path.read_text())["architectures"] == ["SCMP_ARCH_X86_64"]
    assert json.loads(path.read_text())["syscalls"] == PROFILE["syscalls"]
    assert not profiles.wants(sc)
    got = profiles.profile_for(sc)
    assert (got.profile_type, got.localhost_ref) == (cri.SecurityProfile.Localhost, str(path))
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left

    # The default depends on the capabilities: another set is learnt on its own.
    assert profiles.profile_for(_sc("NET_RAW")).profile_type == cri.SecurityProfile.RuntimeDefault
    # A file gone (a state directory wiped): RuntimeDefault again, and learnt again.
    path.unlink()
    assert profiles.profile_for(sc).profile_type == cri.SecurityProfile.RuntimeDefault
    assert profiles.wants(sc)


@pytest.mark.parametrize(("rt", "machine"), [
    (FakeRuntime(fail=True), "x86_64"),                                           # containerd did not answer
    (FakeRuntime(spec=None), "x86_64"),                                           # a spec without a profile
    (FakeRuntime({**PROFILE, "architectures": ["SCMP_ARCH_AARCH64"]}), "x86_64"),  # not this machine's
    (FakeRuntime(PROFILE), "mips"),                                               # a machine not known here
])
def test_what_cannot_be_learnt_leaves_runtime_default(tmp_path: Path, rt: FakeRuntime, machine: str) -> None:
    profiles = seccomp.HostProfiles(tmp_path / "seccomp", machine=machine)
    assert profiles.learn(rt, "c1", _sc()) is None
    assert profiles.profile_for(_sc()).profile_type == cri.SecurityProfile.RuntimeDefault
    assert not (tmp_path / "seccomp").exists() or not list((tmp_path / "seccomp").iterdir())


def test_a_failed_learning_is_not_tried_again_at_every_container_and_leaves_no_file(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    profiles = seccomp.HostProfiles(tmp_path / "seccomp", machine="x86_64")
    rt = FakeRuntime(fail=True)
    assert profiles.wants(_sc()) and profiles.learn(rt, "c1", _sc()) is None
    assert not profiles.wants(_sc())  # RuntimeDefault meanwhile, without a verbose status each time
    clock = seccomp.time.monotonic() + seccomp.RELEARN_S + 1
    monkeypatch.setattr(seccomp.time, "monotonic", lambda: clock)
    assert profiles.wants(_sc())

    (tmp_path / "seccomp").write_text("a file where the directory should be")
    assert profiles.learn(FakeRuntime(PROFILE), "c2", _sc()) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seccomp"]
