"""The seccomp profile a host gives a rerouted container that asked for none.

A host never runs a tenant's container unconfined: one that asks for no
profile gets the runtime's default all the same (``shim.crishared.baseline``). That
default lists the node's own architecture and its 32-bit ones (x86 and x32
beside x86_64), and runc compiles the filter for each of them at every
start: the larger part of what a rerouted start paid over an unconfined one
(benchmarks.md, "start steps"). So for such a container the host uses the
runtime's own default profile narrowed to its native architecture: the same
allowed calls and arguments, and no 32-bit system calls at all (a process
that makes one is killed by SIGSYS). A container that asks for ``RuntimeDefault`` itself
gets it as it is, 32-bit calls and all.

The profile is the runtime's, never written here: the first such container
on a host (for its capability set, on which the default depends) is made
under ``RuntimeDefault``, its OCI spec read back from containerd, and the
narrowed profile written under the agent's state directory for the next
ones (``Localhost``). Anything unexpected (an architecture the profile does
not list, a spec without one, a file gone) leaves ``RuntimeDefault``. The
profile is learnt once per agent process: an agent restarted with its node's
containerd (an upgrade) learns the new runtime's default.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import threading
import time
from pathlib import Path

from cri_api.v1 import api_pb2 as cri

from shim import log
from shim.errors import WeftError
from shim.shadowhost.runtime import RT, ShadowRuntime

_log = log.get("weft.shadows")
RELEARN_S = 600.0  # a capability set whose profile could not be learnt is tried again after this long

# The machine's name for its architecture (platform.machine()) to libseccomp's.
NATIVE_ARCH = {
    "x86_64": "SCMP_ARCH_X86_64", "amd64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64",
    "arm64": "SCMP_ARCH_AARCH64", "ppc64le": "SCMP_ARCH_PPC64LE", "s390x": "SCMP_ARCH_S390X",
    "riscv64": "SCMP_ARCH_RISCV64",
}


def asked_none(sc: cri.LinuxContainerSecurityContext) -> bool:
    """Whether a container asked for no seccomp profile (kubelet sends Unconfined for a pod that names none)."""
    if sc.HasField("seccomp"):
        return sc.seccomp.profile_type == cri.SecurityProfile.Unconfined
    return sc.seccomp_profile_path in ("", "unconfined")


def caps_key(sc: cri.LinuxContainerSecurityContext) -> str:
    """What the runtime's default profile depends on, of what a host keeps of a container: its capabilities."""
    caps = sc.capabilities
    return hashlib.sha256(json.dumps([sorted(caps.add_capabilities), sorted(caps.drop_capabilities),
                                      sorted(caps.add_ambient_capabilities)]).encode()).hexdigest()[:16]


def native_only(profile: dict, arch: str) -> dict | None:
    """The profile with its architectures narrowed to ``arch``; None where it does not list it."""
    arches = profile.get("architectures")
    if not isinstance(arches, list) or arch not in arches or not isinstance(profile.get("syscalls"), list):
        return None
    return {**profile, "architectures": [arch]}


class HostProfiles:
    """The narrowed profiles this host has learnt, one file per capability set, under ``directory``."""

    def __init__(self, directory: Path, machine: str | None = None) -> None:
        self.directory = directory
        self.arch = NATIVE_ARCH.get(machine if machine is not None else platform.machine())
        self._learnt: dict[str, Path] = {}
        self._failed: dict[str, float] = {}  # capability set -> when learning it last failed (monotonic)
        self._lock = threading.Lock()

    def profile_for(self, sc: cri.LinuxContainerSecurityContext) -> cri.SecurityProfile:
        """The profile a container that asked for none runs with here: the narrowed one once learnt."""
        with self._lock:
            path = self._learnt.get(caps_key(sc))
        if path is not None and path.is_file():
            return cri.SecurityProfile(profile_type=cri.SecurityProfile.Localhost, localhost_ref=str(path))
        return cri.SecurityProfile(profile_type=cri.SecurityProfile.RuntimeDefault)

    def wants(self, sc: cri.LinuxContainerSecurityContext) -> bool:
        """Whether a container made under RuntimeDefault with this context would teach a profile not yet known."""
        if self.arch is None:
            return False
        key = caps_key(sc)
        with self._lock:
            path = self._learnt.get(key)
            if time.monotonic() - self._failed.get(key, -RELEARN_S) < RELEARN_S:
                return False  # not a verbose status under the creation lock at every RunShadow
        return path is None or not path.is_file()

    def learn(self, rt: ShadowRuntime, container_id: str, sc: cri.LinuxContainerSecurityContext) -> Path | None:
        """Read the profile containerd gave ``container_id`` (made under RuntimeDefault with ``sc``) and keep it
        narrowed; None (and RuntimeDefault goes on) where it cannot be."""
        if self.arch is None:
            return None
        key = caps_key(sc)
        path = self._learn(rt, container_id, key)
        with self._lock:
            if path is None:
                self._failed[key] = time.monotonic()
            else:
                self._failed.pop(key, None)
                self._learnt[key] = path
        return path

    def _learn(self, rt: ShadowRuntime, container_id: str, key: str) -> Path | None:
        assert self.arch is not None
        try:
            resp = rt.call(RT + "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id,
                                                                              verbose=True),
                           cri.ContainerStatusResponse)
            profile = json.loads(resp.info.get("info", "{}")).get("runtimeSpec", {}).get("linux", {}).get("seccomp")
        except (WeftError, ValueError, AttributeError) as exc:
            _log.warning("shadow.seccomp_unlearnt", container_id=container_id, error=str(exc))
            return None
        narrowed = native_only(profile, self.arch) if isinstance(profile, dict) else None
        if narrowed is None:
            _log.warning("shadow.seccomp_unlearnt", container_id=container_id,
                         error=f"the runtime's default profile does not list {self.arch}")
            return None
        path = self.directory / f"runtime-default-{self.arch.removeprefix('SCMP_ARCH_').lower()}-{key}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp.write_text(json.dumps(narrowed))
            os.replace(tmp, path)  # containerd never reads half a profile
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            _log.warning("shadow.seccomp_unlearnt", container_id=container_id, error=str(exc))
            return None
        _log.info("shadow.seccomp_learnt", path=str(path), arch=self.arch, syscalls=len(narrowed["syscalls"]))
        return path
