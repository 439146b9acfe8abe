"""LeaseService on a simulated 2x80GiB node: acquire, bind, release, reconcile, and restart; and on the fake
NVML with MIG on, whose instances are leased by their UUIDs and whose MIG-enabled GPU never is."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from shim.broker.mps import MpsError, MpsLimits
from shim.broker.nvml import NvmlBackend
from shim.broker.service import MPS_DEFAULT_PIPE, MPS_PIPE_IN_CONTAINER, LeaseService
from shim.broker.simulated import SimulatedBackend, simulated_uuid
from shim.core.leases import LeaseState
from shim.errors import BadAnnotation, LeaseConflictError, LeaseNotFound, LeaseRefused
from shim.state.db import StateStoreFull
from shim.state.leases import LeaseRecord, LeaseStore, new_lease_id
from tests.broker.fakes import A100, MIG_A, MIG_B, T4, FakeNvml, dead_pid, two_instances, write_mig_caps
from tests.cgroups import own_cgroup

GI = 2**30
U0, U1 = simulated_uuid(0), simulated_uuid(1)


@dataclass(frozen=True)
class FakeDaemon:
    key: str
    pipe_dir: Path
    shm_dir: Path


@dataclass
class FakeMps:
    """Records what the service asks of the MPS supervisor."""

    root: Path
    private_shm: bool = True
    calls: list[tuple] = field(default_factory=list)
    broken: bool = False
    pooled: list[str] = field(default_factory=list)  # the device of each idle daemon it says it has

    def ensure(self, key: str, device_uuid: str, limits: MpsLimits | None = None) -> FakeDaemon:
        self.calls.append(("ensure", key, device_uuid, limits))
        if self.broken:
            raise MpsError(f"MPS daemon for lease {key} on {device_uuid} refused 'set_default_...'")
        return FakeDaemon(key, self.root / key / "pipe", self.root / key / "shm")

    def take(self, device_uuid: str, limits: MpsLimits) -> FakeDaemon:
        key = new_lease_id()
        self.calls.append(("take", key, device_uuid, limits))
        if self.broken:
            raise MpsError(f"MPS daemon for lease {key} on {device_uuid} refused 'set_default_...'")
        return FakeDaemon(key, self.root / key / "pipe", self.root / key / "shm")

    def warm(self, device_uuids) -> None:
        self.calls.append(("warm", tuple(device_uuids)))

    def idle(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(device_uuid=u) for u in self.pooled]

    def stop(self, key: str) -> None:
        self.calls.append(("stop", key))


@pytest.fixture
def mps(tmp_path: Path) -> FakeMps:
    return FakeMps(tmp_path / "mps")


def make(state: Path, mps: FakeMps | None, spec: str = "2x80GiB") -> LeaseService:
    return LeaseService(SimulatedBackend(spec), LeaseStore(state), mps)


@pytest.fixture
def svc(tmp_path: Path, mps: FakeMps) -> Iterator[LeaseService]:
    s = make(tmp_path / "state", mps)
    yield s
    s.store.close()


def acquire(svc: LeaseService, key: str, memory: int = 0, compute: int = 0, count: int = 0,
            allowed: tuple[str, ...] = ()) -> LeaseRecord:
    return svc.acquire(key=key, namespace="ns", pod="pod", pod_uid="uid", container=key.split("/")[1],
                       sandbox_id=key.split("/")[0], memory_bytes=memory, compute_percent=compute, count=count,
                       allowed=allowed)


# -- acquire ----------------------------------------------------------------------------
def test_shared_ask_gets_mps_env_and_the_device(svc: LeaseService, mps: FakeMps) -> None:
    rec = acquire(svc, "sb/app/0", memory=20 * GI, compute=50)
    assert rec.state is LeaseState.ACQUIRED
    assert rec.shared
    assert (rec.memory_bytes, rec.compute_percent) == (20 * GI, 50)
    assert len(rec.device_uuids) == 1 and rec.device_uuids[0] in (U0, U1)
    uuid = rec.device_uuids[0]
    assert rec.env == {
        "NVIDIA_VISIBLE_DEVICES": uuid, "CUDA_VISIBLE_DEVICES": uuid,
        "CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE_IN_CONTAINER,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
    }
    # Its own daemon, its limits set there; its pipes where the env says and where MPS looks without it.
    assert mps.calls == [("take", rec.lease_id, uuid, MpsLimits(20 * GI, 50))], "the lease is named by its daemon"
    pipe, shm = str(mps.root / rec.lease_id / "pipe"), str(mps.root / rec.lease_id / "shm")
    assert rec.mounts == ((pipe, MPS_PIPE_IN_CONTAINER, False), (pipe, MPS_DEFAULT_PIPE, False),
                          (shm, "/dev/shm", False))
    assert svc.store.get(rec.lease_id) == rec, "stored before acquire returned"


def test_same_key_again_is_the_same_lease(svc: LeaseService, mps: FakeMps) -> None:
    first = acquire(svc, "sb/app/0", memory=20 * GI, compute=50)
    again = acquire(svc, "sb/app/0", memory=20 * GI, compute=50)
    assert again.lease_id == first.lease_id
    assert [r.lease_id for r in svc.leases()] == [first.lease_id]
    assert [c[:2] for c in mps.calls] == [("take", first.lease_id)], "no second daemon for a retried create"


def test_whole_device_ask_is_exclusive_with_all_its_memory(svc: LeaseService, mps: FakeMps) -> None:
    rec = acquire(svc, "sb/app/0")
    assert not rec.shared
    assert (rec.memory_bytes, rec.compute_percent) == (80 * GI, 100)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in rec.env
    assert rec.env["NVIDIA_VISIBLE_DEVICES"] == rec.device_uuids[0]
    assert rec.mounts == ()
    assert mps.calls == []


def test_two_whole_devices_in_one_lease(svc: LeaseService) -> None:
    rec = acquire(svc, "sb/app/0", count=2)
    assert sorted(rec.device_uuids) == [U0, U1]
    assert rec.memory_bytes == 160 * GI
    assert rec.env["NVIDIA_VISIBLE_DEVICES"] == ",".join(rec.device_uuids)


def test_third_whole_device_on_two_devices_is_refused(svc: LeaseService) -> None:
    a, b = acquire(svc, "sb/a/0"), acquire(svc, "sb/b/0")
    assert {a.device_uuids[0], b.device_uuids[0]} == {U0, U1}
    with pytest.raises(LeaseRefused) as err:
        acquire(svc, "sb/c/0")
    assert "ns/pod/c" in err.value.message
    assert len(svc.leases()) == 2


def test_whole_device_avoids_the_device_with_a_share(svc: LeaseService) -> None:
    shared = acquire(svc, "sb/a/0", memory=10 * GI, compute=10)
    whole = acquire(svc, "sb/b/0")
    assert whole.device_uuids != shared.device_uuids


def test_compute_over_100_on_a_device_is_refused(tmp_path: Path, mps: FakeMps) -> None:
    svc = make(tmp_path, mps, "1x80GiB")
    try:
        acquire(svc, "sb/a/0", memory=10 * GI, compute=60)
        with pytest.raises(LeaseRefused):
            acquire(svc, "sb/b/0", memory=10 * GI, compute=50)
        assert acquire(svc, "sb/c/0", memory=10 * GI, compute=40).compute_percent == 40, "exactly 100% fits"
    finally:
        svc.store.close()


def test_compute_over_100_in_the_allowed_domain_is_refused(svc: LeaseService) -> None:
    acquire(svc, "sb/a/0", memory=10 * GI, compute=60, allowed=(U1,))
    with pytest.raises(LeaseRefused):
        acquire(svc, "sb/b/0", memory=10 * GI, compute=50, allowed=(U1,))


@pytest.mark.parametrize("target", [pytest.param(U0, id="first-device"), pytest.param(U1, id="second-device")])
def test_allowed_domain_is_respected(svc: LeaseService, target: str) -> None:
    # Without a domain best fit would consolidate both shares onto one device; the domain decides instead.
    other = U1 if target == U0 else U0
    assert acquire(svc, "sb/a/0", memory=10 * GI, compute=10, allowed=(other,)).device_uuids == (other,)
    assert acquire(svc, "sb/b/0", memory=10 * GI, compute=10, allowed=(target,)).device_uuids == (target,)


def test_whole_device_in_a_full_domain_is_refused_though_another_device_is_free(svc: LeaseService) -> None:
    acquire(svc, "sb/a/0", allowed=(U1,))
    with pytest.raises(LeaseRefused):
        acquire(svc, "sb/b/0", allowed=(U1,))
    assert acquire(svc, "sb/c/0").device_uuids == (U0,)


@pytest.mark.parametrize(
    ("kwargs", "mentions"),
    [
        pytest.param({"memory": 81 * GI, "compute": 10}, "larger than any device", id="memory-larger-than-any-device"),
        pytest.param({"memory": GI, "compute": 101}, "compute_percent 101", id="compute-over-100"),
        pytest.param({"allowed": ("GPU-not-here",)}, "GPU-not-here", id="allowed-device-not-on-this-node"),
    ],
)
def test_impossible_asks_are_bad_annotations(svc: LeaseService, kwargs: dict, mentions: str) -> None:
    with pytest.raises(BadAnnotation) as err:
        acquire(svc, "sb/a/0", **kwargs)
    assert mentions in err.value.message
    assert svc.leases() == []


def test_acquire_without_key_is_refused(svc: LeaseService) -> None:
    with pytest.raises(BadAnnotation, match="key is required"):
        svc.acquire(key="", namespace="ns", pod="p", pod_uid="u", container="c", sandbox_id="s", memory_bytes=GI,
                    compute_percent=10, count=1, allowed=())


# -- bind ---------------------------------------------------------------------------------
def test_bind_records_pid_cgroup_and_container(svc: LeaseService) -> None:
    rec = acquire(svc, "sb/app/0", memory=GI, compute=10)
    bound = svc.bind(rec.lease_id, "c" * 64, 4242, "/kubepods/c")
    assert (bound.state, bound.container_id, bound.pid, bound.cgroup) == (LeaseState.BOUND, "c" * 64, 4242,
                                                                            "/kubepods/c")
    assert bound.bound_at > 0
    assert svc.store.get(rec.lease_id) == bound


def test_bind_again_by_the_same_container_keeps_it_bound(svc: LeaseService) -> None:
    rec = acquire(svc, "sb/app/0")
    svc.bind(rec.lease_id, "c" * 64, 1, "/a")
    assert svc.bind(rec.lease_id, "c" * 64, 2, "/b").state is LeaseState.BOUND


def test_bind_by_another_container_is_a_conflict(svc: LeaseService) -> None:
    rec = acquire(svc, "sb/app/0")
    svc.bind(rec.lease_id, "a" * 64, 1, "/a")
    with pytest.raises(LeaseConflictError) as err:
        svc.bind(rec.lease_id, "b" * 64, 2, "/b")
    assert rec.lease_id in err.value.message
    assert svc.store.get(rec.lease_id).container_id == "a" * 64, "the first container keeps the lease"


@pytest.mark.parametrize("released", [pytest.param(False, id="never-granted"), pytest.param(True, id="released")])
def test_bind_of_an_unknown_lease_is_not_found(svc: LeaseService, released: bool) -> None:
    lease_id = "lease-nope"
    if released:
        lease_id = acquire(svc, "sb/app/0").lease_id
        svc.release(lease_id)
    with pytest.raises(LeaseNotFound) as err:
        svc.bind(lease_id, "c" * 64, 1, "/a")
    assert lease_id in err.value.message


# -- release ---------------------------------------------------------------------------------
def test_release_twice_is_true_then_false(svc: LeaseService) -> None:
    rec = acquire(svc, "sb/app/0")
    assert svc.release(rec.lease_id) is True
    assert svc.release(rec.lease_id) is False
    assert svc.release("lease-never") is False
    assert svc.leases() == []


def test_released_capacity_is_free_again(svc: LeaseService) -> None:
    a = acquire(svc, "sb/a/0")
    acquire(svc, "sb/b/0")
    svc.release(a.lease_id)
    assert acquire(svc, "sb/c/0").device_uuids == a.device_uuids


def test_each_share_has_its_own_mps_daemon_stopped_with_its_lease(svc: LeaseService, mps: FakeMps) -> None:
    a = acquire(svc, "sb/a/0", memory=10 * GI, compute=10)
    b = acquire(svc, "sb/b/0", memory=10 * GI, compute=30)
    assert a.device_uuids == b.device_uuids, "best fit consolidates shares on one device"
    dev = a.device_uuids[0]
    whole = acquire(svc, "sb/w/0")
    svc.release(whole.lease_id)
    svc.release(a.lease_id)
    assert mps.calls == [("take", a.lease_id, dev, MpsLimits(10 * GI, 10)),
                         ("take", b.lease_id, dev, MpsLimits(10 * GI, 30)), ("stop", a.lease_id)]
    svc.release(a.lease_id)
    assert mps.calls.count(("stop", a.lease_id)) == 1, "releasing a released lease stops nothing"


def test_a_share_whose_daemon_cannot_take_its_limits_is_not_granted(svc: LeaseService, mps: FakeMps) -> None:
    mps.broken = True
    with pytest.raises(MpsError, match="refused"):
        acquire(svc, "sb/a/0", memory=10 * GI, compute=10)
    assert svc.leases() == [] and svc.store.all() == []


def test_a_share_that_cannot_be_stored_leaves_no_daemon(svc: LeaseService, mps: FakeMps,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def full(rec: LeaseRecord) -> None:
        raise StateStoreFull("state database: database or disk is full")

    monkeypatch.setattr(svc.store, "insert", full)
    with pytest.raises(StateStoreFull, match="disk is full"):
        acquire(svc, "sb/a/0", memory=10 * GI, compute=10)
    [(_, key, _, _)] = [c for c in mps.calls if c[0] == "take"]
    assert mps.calls[-1] == ("stop", key), "the daemon taken for it is stopped"
    assert svc.leases() == []


def test_restore_starts_the_daemon_of_every_kept_share(tmp_path: Path, mps: FakeMps) -> None:
    first = make(tmp_path, mps)
    a = acquire(first, "sb/a/0", memory=10 * GI, compute=20)
    acquire(first, "sb/w/0")
    first.store.close()
    mps.calls.clear()
    second = make(tmp_path, mps)
    try:
        assert second.restore_mps() == []
        assert mps.calls == [("ensure", a.lease_id, a.device_uuids[0], MpsLimits(10 * GI, 20))]
        mps.broken = True
        with capture_logs() as logs:
            assert second.restore_mps() == [a.lease_id], "a daemon that cannot start leaves the lease, named"
        assert [(e["event"], e["lease"]) for e in logs] == [("mps.restore_failed", a.lease_id)]
    finally:
        second.store.close()


def test_daemons_are_started_ahead_for_the_devices_a_share_can_be_leased_on(mig_svc: LeaseService,
                                                                             mps: FakeMps) -> None:
    mig_svc.warm_mps()
    assert mps.calls == [("warm", (T4, MIG_A, MIG_B))], "the MIG instances and the plain GPU; never the MIG GPU"


def test_service_works_without_an_mps_supervisor(tmp_path: Path) -> None:
    svc = make(tmp_path, None)
    try:
        rec = acquire(svc, "sb/a/0", memory=GI, compute=10)
        assert rec.mounts == () and rec.env["CUDA_MPS_PIPE_DIRECTORY"] == MPS_PIPE_IN_CONTAINER
        assert svc.restore_mps() == []
        svc.warm_mps()
        assert svc.release(rec.lease_id) is True
    finally:
        svc.store.close()


# -- reconcile and dead containers -------------------------------------------------------------
def test_reconcile_releases_only_unbound_leases_the_agent_forgot(svc: LeaseService) -> None:
    live = acquire(svc, "sb/live/0", memory=GI, compute=10)
    forgotten = acquire(svc, "sb/forgotten/0", memory=GI, compute=10)
    bound = acquire(svc, "sb/bound/0", memory=GI, compute=10)
    svc.bind(bound.lease_id, "c" * 64, os.getpid(), "")
    assert svc.reconcile(["sb/live/0"]) == [forgotten.lease_id]
    assert sorted(r.lease_id for r in svc.leases()) == sorted([live.lease_id, bound.lease_id])


def test_release_dead_releases_bound_leases_whose_process_is_gone(svc: LeaseService) -> None:
    gone = acquire(svc, "sb/gone/0", memory=GI, compute=10)
    svc.bind(gone.lease_id, "g" * 64, dead_pid(), "/whatever")
    alive = acquire(svc, "sb/alive/0", memory=GI, compute=10)
    svc.bind(alive.lease_id, "a" * 64, os.getpid(), own_cgroup())
    reused = acquire(svc, "sb/reused/0", memory=GI, compute=10)
    svc.bind(reused.lease_id, "r" * 64, os.getpid(), "/kubepods/not-this-process")
    unbound = acquire(svc, "sb/unbound/0", memory=GI, compute=10)
    assert sorted(svc.release_dead()) == sorted([gone.lease_id, reused.lease_id])
    assert sorted(r.lease_id for r in svc.leases()) == sorted([alive.lease_id, unbound.lease_id])


def test_release_dead_with_grace_leaves_the_poststop_hook_time(svc: LeaseService) -> None:
    gone = acquire(svc, "sb/gone/0", memory=GI, compute=10)
    svc.bind(gone.lease_id, "g" * 64, dead_pid(), "/whatever")
    assert svc.release_dead(grace=60) == []  # seen gone just now: the hook may still release it
    assert [r.lease_id for r in svc.leases()] == [gone.lease_id]
    assert svc.release_dead(grace=0) == [gone.lease_id]


# -- restart -------------------------------------------------------------------------------------
def test_leases_survive_a_restart_and_still_hold_capacity(tmp_path: Path, mps: FakeMps) -> None:
    first = make(tmp_path, mps)
    a = acquire(first, "sb/a/0")
    b = first.bind(acquire(first, "sb/b/0").lease_id, "c" * 64, 7, "/x")
    first.store.close()
    second = make(tmp_path, mps)
    try:
        assert second.leases() == [a, b]
        with pytest.raises(LeaseRefused):
            acquire(second, "sb/c/0")
        assert acquire(second, "sb/a/0").lease_id == a.lease_id, "idempotent across restarts"
        with pytest.raises(LeaseConflictError):
            second.bind(b.lease_id, "d" * 64, 8, "/y")
    finally:
        second.store.close()


# -- a container may only bind or release its own lease ---------------------------------------
def test_a_container_cannot_bind_or_release_another_containers_lease(svc: LeaseService) -> None:
    rec = acquire(svc, "sb/app/0", memory=10 * GI)
    with pytest.raises(LeaseConflictError, match="belongs to ns/pod/app"):
        svc.bind(rec.lease_id, "c" * 64, os.getpid(), "", owner=("sb", "intruder"))
    with pytest.raises(LeaseConflictError):
        svc.release(rec.lease_id, "poststop", owner=("other-sandbox", "app"))
    assert svc.bind(rec.lease_id, "c" * 64, os.getpid(), "", owner=("sb", "app")).state is LeaseState.BOUND
    assert svc.release(rec.lease_id, "poststop", owner=("sb", "app")) is True


def test_bind_without_a_pid_or_container_is_refused(svc: LeaseService) -> None:
    rec = acquire(svc, "sb/app/0", memory=10 * GI)
    for container_id, pid in (("c" * 64, 0), ("", os.getpid())):
        with pytest.raises(BadAnnotation, match="needs the container's id and pid"):
            svc.bind(rec.lease_id, container_id, pid, "")
    assert svc.leases()[0].state is LeaseState.ACQUIRED


@pytest.mark.parametrize(
    "line",
    [b'{"op": "bind", "lease_id": "x", "pid": 1e400}\n', b'{"op": "bind", "lease_id": "x", "pid": [1]}\n',
     b'{"op": "release"}\n', b'[1, 2]\n', b"\xff\xfe\n"],
    ids=["huge-pid", "pid-not-a-number", "no-lease-id", "not-an-object", "not-utf8"],
)
def test_malformed_hook_lines_get_a_clear_answer(svc: LeaseService, line: bytes) -> None:
    from shim.broker.server import _answer

    answer = _answer(svc, line)
    assert answer["ok"] is False and answer["code"] == "INVALID_ARGUMENT" and answer["error"]


# -- MIG: instances leased by their own UUIDs, the MIG-enabled GPU never ----------------------
@pytest.fixture
def mig_fake() -> FakeNvml:
    """The fake A100 with MIG on (a 10 GiB and a 40 GiB instance) beside a 16 GiB T4."""
    fake = FakeNvml()
    fake.enable_mig(two_instances())
    return fake


@pytest.fixture
def mig_proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    write_mig_caps(root, 0, 7, 0, 66, 67)
    write_mig_caps(root, 0, 2, 0, 21, 22)
    return root


@pytest.fixture
def mig_svc(tmp_path: Path, mps: FakeMps, mig_fake: FakeNvml, mig_proc: Path) -> Iterator[LeaseService]:
    s = LeaseService(NvmlBackend(library=mig_fake, proc_root=mig_proc), LeaseStore(tmp_path / "state"), mps)
    yield s
    s.store.close()
    s.backend.close()


def test_a_mig_instance_is_leased_whole_by_its_uuid(mig_svc: LeaseService, mps: FakeMps) -> None:
    rec = acquire(mig_svc, "sb/app/0", allowed=(MIG_A,))
    assert (rec.device_uuids, rec.shared, rec.memory_bytes, rec.compute_percent) == ((MIG_A,), False, 10 * GI, 100)
    assert rec.env == {"NVIDIA_VISIBLE_DEVICES": MIG_A, "CUDA_VISIBLE_DEVICES": MIG_A}
    # The GPU's node and the instance's two capabilities, and the control nodes this host has.
    assert rec.device_nodes[:3] == ("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap66", "/dev/nvidia-caps/nvidia-cap67")
    assert mps.calls == []
    with pytest.raises(LeaseRefused):
        acquire(mig_svc, "sb/b/0", memory=GI, compute=10, allowed=(MIG_A,))


def test_a_mig_instance_is_shared_by_its_uuid_under_its_own_mps_daemon(mig_svc: LeaseService, mps: FakeMps) -> None:
    a = acquire(mig_svc, "sb/a/0", memory=8 * GI, compute=25, allowed=(MIG_B,))
    b = acquire(mig_svc, "sb/b/0", memory=16 * GI, compute=50, allowed=(MIG_B,))
    for rec, memory, share in ((a, 8 * GI, 25), (b, 16 * GI, 50)):
        assert (rec.device_uuids, rec.shared, rec.memory_bytes, rec.compute_percent) == ((MIG_B,), True, memory,
                                                                                         share)
        assert rec.env["CUDA_VISIBLE_DEVICES"] == MIG_B and rec.env["NVIDIA_VISIBLE_DEVICES"] == MIG_B
        assert rec.device_nodes[:3] == ("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap21",
                                        "/dev/nvidia-caps/nvidia-cap22")
    assert mps.calls == [("take", a.lease_id, MIG_B, MpsLimits(8 * GI, 25)),
                         ("take", b.lease_id, MIG_B, MpsLimits(16 * GI, 50))]
    with pytest.raises(LeaseRefused):
        acquire(mig_svc, "sb/c/0", memory=20 * GI, compute=10, allowed=(MIG_B,))  # 24 of 40 GiB are leased


def test_shares_are_never_packed_on_a_mig_enabled_gpu(mig_svc: LeaseService) -> None:
    # The A100 itself has 80 GiB and no lease; only its 40 GiB instance may take a 30 GiB share.
    assert acquire(mig_svc, "sb/a/0", memory=30 * GI, compute=10).device_uuids == (MIG_B,)
    with pytest.raises(LeaseRefused):
        acquire(mig_svc, "sb/b/0", memory=30 * GI, compute=10)
    with pytest.raises(BadAnnotation, match="larger than any device"):
        acquire(mig_svc, "sb/c/0", memory=50 * GI, compute=10)
    placed = [acquire(mig_svc, f"sb/s{n}/0", memory=GI, compute=5).device_uuids[0] for n in range(12)]
    assert A100 not in placed and set(placed) <= {T4, MIG_A, MIG_B}


def test_whole_devices_are_the_instances_and_the_gpus_without_mig(mig_svc: LeaseService) -> None:
    got = acquire(mig_svc, "sb/a/0", count=3)
    assert sorted(got.device_uuids) == sorted((T4, MIG_A, MIG_B))
    with pytest.raises(LeaseRefused):
        acquire(mig_svc, "sb/b/0")


def test_a_mig_enabled_gpu_asked_for_itself_is_refused_naming_its_instances(mig_svc: LeaseService,
                                                                            mps: FakeMps) -> None:
    for kwargs in ({}, {"memory": GI, "compute": 10}):
        with pytest.raises(LeaseRefused) as err:
            acquire(mig_svc, "sb/a/0", allowed=(A100,), **kwargs)
        assert f"GPU {A100} has MIG on" in err.value.message
        assert f"its MIG instances ({MIG_A}, {MIG_B})" in err.value.message
    assert mig_svc.leases() == [] and mps.calls == []
    # Beside an instance the GPU only narrows the domain to that instance.
    assert acquire(mig_svc, "sb/b/0", allowed=(A100, MIG_A)).device_uuids == (MIG_A,)


def test_a_mig_enabled_gpu_without_instances_is_refused_saying_so(tmp_path: Path, mps: FakeMps) -> None:
    fake = FakeNvml()
    fake.handles = {"h0": A100}
    fake.enable_mig({})
    svc = LeaseService(NvmlBackend(library=fake), LeaseStore(tmp_path / "state"), mps)
    try:
        for kwargs in ({}, {"memory": GI, "compute": 10}):
            with pytest.raises(LeaseRefused) as err:
                acquire(svc, "sb/a/0", **kwargs)
            assert f"GPU {A100} has MIG on: it has no MIG instances" in err.value.message
        assert svc.leases() == []
    finally:
        svc.store.close()
        svc.backend.close()


def test_an_instance_whose_capability_file_is_gone_is_refused_leaving_no_daemon(
        mig_svc: LeaseService, mps: FakeMps, mig_proc: Path) -> None:
    gone = mig_proc / "driver/nvidia/capabilities/gpu0/mig/gi2/ci0/access"
    gone.unlink()
    with pytest.raises(LeaseRefused) as err:
        acquire(mig_svc, "sb/a/0", memory=GI, compute=10, allowed=(MIG_B,))
    assert str(gone) in err.value.message and MIG_B in err.value.message
    assert mig_svc.leases() == [] and mps.calls == [], "no lease stored, no daemon started"


def test_the_mps_daemon_of_a_share_of_an_instance_sees_that_instance(
        tmp_path: Path, mig_fake: FakeNvml, mig_proc: Path) -> None:
    from shim.broker.mps import MpsSupervisor
    from tests.broker.fakes import install_fake_mps

    supervisor = MpsSupervisor(tmp_path / "mps", install_fake_mps(tmp_path / "bin"))
    svc = LeaseService(NvmlBackend(library=mig_fake, proc_root=mig_proc), LeaseStore(tmp_path / "state"), supervisor)
    try:
        rec = acquire(svc, "sb/a/0", memory=2 * GI, compute=30, allowed=(MIG_A,))
        [daemon] = supervisor.daemons()
        started = json.loads((daemon.log_dir / "fake-env.json").read_text())
        assert started["env"]["CUDA_VISIBLE_DEVICES"] == MIG_A, "the daemon, and so its server, sees the instance"
        assert (daemon.key, daemon.device_uuid, daemon.limits) == (rec.lease_id, MIG_A, MpsLimits(2 * GI, 30))
        svc.release(rec.lease_id)
        assert supervisor.daemons() == []
    finally:
        supervisor.stop_all()
        svc.store.close()
        svc.backend.close()


def test_metrics_count_a_mig_gpus_memory_once_through_its_instances(mig_svc: LeaseService) -> None:
    from prometheus_client import generate_latest

    from shim.broker.metrics import BrokerMetrics

    text = generate_latest(BrokerMetrics(mig_svc).registry).decode()
    memory = [line for line in text.splitlines() if line.startswith("weft_gpu_device_memory_bytes{")]
    assert sorted(line.split('UUID="')[1].split('"')[0] for line in memory) == sorted((T4, MIG_A, MIG_B))


def test_the_mps_pool_is_a_gauge_per_device(tmp_path: Path, svc: LeaseService, mps: FakeMps) -> None:
    from prometheus_client import generate_latest

    from shim.broker.metrics import BrokerMetrics

    mps.pooled = [U1, U0, U1]
    text = generate_latest(BrokerMetrics(svc).registry).decode()
    assert [line for line in text.splitlines() if line.startswith("weft_gpu_mps_pool_idle{")] == [
        f'weft_gpu_mps_pool_idle{{UUID="{U0}",gpu="0"}} 1.0', f'weft_gpu_mps_pool_idle{{UUID="{U1}",gpu="1"}} 2.0']
    without = make(tmp_path / "without", None)
    try:
        assert without.mps_pool() == {} and "weft_gpu_mps_pool_idle{" not in generate_latest(
            BrokerMetrics(without).registry).decode()
    finally:
        without.store.close()
