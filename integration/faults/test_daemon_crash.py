"""kill -9 of the GPU broker and of containerd (on the origin and on a host) under a running workload.

Each with containers created, running and exited when the process dies, and
with a lifecycle step taken while it is down: a GPU container exits while
the broker is away (its poststop hook cannot release the lease), a GPU create
is refused while CPU ones go on; the origin keeps answering for its remote
containers while its own containerd is away; a host whose containerd is away
is still heard (Hello), so nothing is fenced or lost, even past the loss
timeout.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from integration.faults.checks import (
    HOSTS,
    ORIGIN,
    Kubelet,
    LiveCopies,
    cpu_config,
    every_state,
    gpu_config,
    gpu_share,
    problems,
    settled,
)
from shim.localfabric.waiting import wait_for

RUNNING, CREATED, EXITED = cri.CONTAINER_RUNNING, cri.CONTAINER_CREATED, cri.CONTAINER_EXITED


def test_broker_killed_with_gpu_containers_created_running_and_exited(kube: Kubelet) -> None:
    f = kube.f
    assert f.broker is not None
    sid = kube.run_pod("broker", gpu_share("created", "running", "exited", "dies", "late"))
    created = kube.create(sid, gpu_config("created"), start=False)
    running = kube.create(sid, gpu_config("running"))
    exited = kube.create(sid, gpu_config("exited"))
    dies = kube.create(sid, gpu_config("dies"))
    kube.stop(exited)
    wait_for(lambda: len(f.broker.leases()) == 3, what="the exited container's lease released by poststop")
    with LiveCopies(f, kube):
        f.broker.stop(9)
        kube.stop(dies)  # its poststop hook cannot reach the broker: the lease outlives the container
        with pytest.raises(grpc.RpcError) as err:
            kube.create(sid, gpu_config("late"), start=False)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE and str(f.broker.socket) in err.value.details()
        cpu = kube.create(sid, cpu_config("tokenize"))  # the CPU stage of the same pod goes on
        f.broker.start()
        # The broker's own sweep releases the dead container's lease; the others are kept as they were.
        settled(f, kube)
        states = {lease.container: (lease.container_id, lease.state) for lease in f.broker.leases()}
        assert states == {"created": ("", "acquired"), "running": (running, "bound")}, states
        kube.start(created)
        # kubelet's retry (the agent reconnects to the broker within a second; a call before is UNAVAILABLE).
        late_config = gpu_config("late")
        late = kube.retry("CreateContainer", cri.CreateContainerRequest(
            pod_sandbox_id=sid, config=late_config, sandbox_config=kube.sandboxes[sid])).container_id
        kube.known[late] = (sid, late_config)
        kube.start(late)
        for cid in (created, running, late, cpu):
            kube.wait_state(cid, RUNNING)
    settled(f, kube)


def test_broker_killed_after_storing_a_lease_before_answering(kube: Kubelet) -> None:
    f = kube.f
    assert f.broker is not None
    sid = kube.run_pod("broker-fp", gpu_share("model"))
    tok = kube.create(sid, cpu_config("tokenize"))
    with LiveCopies(f, kube):
        f.broker.stop(9)
        f.broker.extra_env = {"WEFT_FAILPOINTS": "broker.lease.stored"}
        f.broker.start()
        with pytest.raises(grpc.RpcError) as err:
            kube.create(sid, gpu_config("model"), start=False)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value
        f.broker.stop(9)
        f.broker.extra_env = {}
        f.broker.start()
        # kubelet's retry, same key: the stored lease is the one granted, never a second.
        config = gpu_config("model")
        cid = kube.retry("CreateContainer", cri.CreateContainerRequest(
            pod_sandbox_id=sid, config=config, sandbox_config=kube.sandboxes[sid])).container_id
        kube.known[cid] = (sid, config)
        kube.start(cid)
        kube.wait_state(cid, RUNNING)
        [lease] = f.broker.leases()
        assert (lease.container_id, lease.state) == (cid, "bound")
        assert kube.state(tok) == RUNNING
    settled(f, kube)


def test_origin_containerd_killed_with_containers_created_running_and_exited(kube: Kubelet) -> None:
    f = kube.f
    ctrd = f.node(ORIGIN).containerd
    made = every_state(kube, "ctrd")
    remote = {cid for cid in made if kube.host_of(cid) in HOSTS}
    assert len(remote) == 3
    with LiveCopies(f, kube):
        ctrd.stop(9)
        # Remote containers are answered from what their hosts push; local ones wait for containerd.
        for cid in made:
            if cid in remote:
                assert kube.state(cid) == made[cid]
            else:
                with pytest.raises(grpc.RpcError) as err:
                    kube.status(cid)
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        time.sleep(f.loss_s + 1)  # the hosts still hear the origin's agent: nothing fenced, nothing lost
        ctrd.start()
        wait_for(lambda: _answers(kube, next(iter(made))), what="the origin's agent back on containerd")
        for cid, state in made.items():
            assert kube.state(cid) == state, cid
        for cid, state in made.items():
            if state == CREATED:
                kube.start(cid)
                kube.wait_state(cid, RUNNING)
    settled(f, kube)


def _answers(kube: Kubelet, cid: str) -> bool:
    try:
        kube.status(cid)
    except grpc.RpcError:
        return False
    return True


def test_host_containerd_killed_with_shadows_created_running_and_exited(kube: Kubelet) -> None:
    f = kube.f
    sid = kube.run_pod("host-ctrd")
    made = {
        kube.create(sid, cpu_config("c-created"), start=False): CREATED,
        kube.create(sid, cpu_config("c-running")): RUNNING,
        kube.create(sid, cpu_config("c-exited", ("sh", "-c", "exit 3"))): EXITED,
    }
    for cid, state in made.items():
        kube.wait_state(cid, state)
    hosts = {kube.host_of(cid) for cid in made}
    assert hosts <= set(HOSTS)
    with LiveCopies(f, kube):
        for host in hosts:
            f.node(host).containerd.stop(9)
        # Past the loss timeout: each host's agent still says Hello, so the origin keeps its containers
        # (their shims and processes run on without containerd, as on a real node).
        time.sleep(f.loss_s + 1)
        for cid, state in made.items():
            assert kube.state(cid) == state, cid
        for host in hosts:
            f.node(host).containerd.start()
        settled(f, kube)
        for cid, state in made.items():
            assert kube.state(cid) == state, cid
        created = next(c for c, s in made.items() if s == CREATED)
        # The host's agent reconnects to containerd within a second; a call in between is UNAVAILABLE.
        kube.retry("StartContainer", cri.StartContainerRequest(container_id=created))
        kube.wait_state(created, RUNNING)
        running = next(c for c, s in made.items() if s == RUNNING)
        out = kube.retry("ExecSync", cri.ExecSyncRequest(container_id=running, cmd=["echo", "alive"], timeout=10))
        assert out.stdout == b"alive\n"
    settled(f, kube)


def test_the_checker_sees_a_leaked_lease_a_vanished_container_and_an_orphan_shadow(kube: Kubelet) -> None:
    """The invariants are not vacuous: each kind of leak the suite looks for is seen when it is there."""
    from shim._pb import broker_pb2 as bpb

    f = kube.f
    assert f.broker is not None
    sid = kube.run_pod("checker")
    cid = kube.create(sid, cpu_config("tokenize"))
    kube.wait_state(cid, RUNNING)
    settled(f, kube)
    ch, stub = f.broker.stub()
    with ch:
        leaked = stub.Acquire(bpb.AcquireRequest(key="nobody/model/0", namespace="default", pod="nobody",
                                                 container="model", sandbox_id="nobody", memory_bytes=1 << 30,
                                                 compute_percent=10, count=1), timeout=10)
        kube.known["f" * 64] = (sid, cpu_config("ghost"))  # a container kubelet was given that weft forgot
        found = "\n".join(problems(f, kube))
        stub.Release(bpb.ReleaseRequest(lease_id=leaked.lease_id, reason="test"), timeout=10)
    del kube.known["f" * 64]
    assert f"leaked lease {leaked.lease_id}" in found and f"{'f' * 12} vanished" in found, found
    # A shadow whose placement the origin forgets (recorded gone behind its back) is an orphan.
    host = kube.host_of(cid)
    f.agents[ORIGIN].stop()
    with contextlib.closing(sqlite3.connect(f.agents[ORIGIN].state_dir / "agent.db")) as db, db:
        db.execute("DELETE FROM placements")
    f.agents[ORIGIN].start()
    kube.known.clear()
    found = "\n".join(problems(f, kube))
    assert f"orphan shadow {sid}/tokenize/0 on {host}" in found, found
    settled(f, kube)  # and the Watch removes it
