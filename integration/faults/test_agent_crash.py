"""kill -9 of a weft agent: at each step of CreateContainer on the origin, and with containers in every state.

The failpoints (``shim.failpoint``) make the origin's agent SIGKILL itself
between the steps of a create: after the broker granted a lease
(``create_container.leased``), after the pending placement was written
(``create_container.pending``), after containerd created the container
(``create_container.created``), and for a rerouted container after the
pending remote placement was written (``place_remote.pending``) and after the
host created the shadow (``place_remote.created``). kubelet's call fails; the
agent is started again (systemd's ``Restart=always``) and kubelet retries.
Then either agent is killed with containers created, running and exited.
"""

from __future__ import annotations

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
    restart_agent,
    settled,
)
from shim.localfabric.waiting import wait_for

RUNNING, CREATED, EXITED = cri.CONTAINER_RUNNING, cri.CONTAINER_CREATED, cri.CONTAINER_EXITED


def _crash_then_restart(kube: Kubelet, failpoint: str, sid: str, config: cri.ContainerConfig) -> None:
    f = kube.f
    restart_agent(f, ORIGIN, env={"WEFT_FAILPOINTS": failpoint})
    f.wait_meshed()
    with pytest.raises(grpc.RpcError) as err:
        kube.create(sid, config, start=False)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value  # the agent died mid-call
    assert f.agents[ORIGIN].proc is not None and f.agents[ORIGIN].proc.wait(10) == -9
    restart_agent(f, ORIGIN)  # systemd's Restart=always
    f.wait_meshed()


@pytest.mark.parametrize("failpoint", ["create_container.leased", "create_container.pending",
                                       "create_container.created"])
def test_origin_agent_killed_while_creating_a_gpu_container(kube: Kubelet, failpoint: str) -> None:
    f = kube.f
    sid = kube.run_pod("gpu-crash", gpu_share("model"))
    tok = kube.create(sid, cpu_config("tokenize"))  # the running workload the crash happens beside
    kube.wait_state(tok, RUNNING)
    with LiveCopies(f, kube):
        _crash_then_restart(kube, failpoint, sid, gpu_config("model"))
        if failpoint == "create_container.created":
            # containerd made it: recovery completes the record, and kubelet finds it by relisting (its
            # retry is refused as the name is taken, as containerd would refuse it without weft).
            def listed() -> str | None:
                found = kube.call("ListContainers", cri.ListContainersRequest(filter=cri.ContainerFilter(
                    pod_sandbox_id=sid, label_selector={"io.kubernetes.container.name": "model"}))).containers
                return found[0].id if found else None

            cid = wait_for(listed, what="the created container listed through the origin")
            kube.known[cid] = (sid, gpu_config("model"))
            wait_for(lambda: f.status(ORIGIN)["placements"] and all(
                p["state"] == "created" for p in f.status(ORIGIN)["placements"]), what="recovery")
            kube.start(cid)
        else:
            # Nothing was created: the orphaned lease goes, and kubelet's retry gets one lease, one container.
            cid = kube.create(sid, gpu_config("model"))
        kube.wait_state(cid, RUNNING)
        assert kube.state(tok) == RUNNING
    [lease] = f.broker.leases()
    assert (lease.container_id, lease.state) == (cid, "bound")
    settled(f, kube)


@pytest.mark.parametrize("failpoint", ["place_remote.pending", "place_remote.created"])
def test_origin_agent_killed_while_rerouting_a_cpu_container(kube: Kubelet, failpoint: str) -> None:
    f = kube.f
    sid = kube.run_pod("cpu-crash")
    with LiveCopies(f, kube):
        _crash_then_restart(kube, failpoint, sid, cpu_config("tokenize"))
        # The pending record is dropped at restart; a shadow the host made is an orphan, removed by the Watch
        # (or taken again by the retry, RunShadow being idempotent per key).
        cid = kube.create(sid, cpu_config("tokenize"))
        assert kube.host_of(cid) in HOSTS
        kube.wait_state(cid, RUNNING)
    settled(f, kube)
    assert sum(len(f.shadows(h)) for h in HOSTS) == 1


@pytest.mark.parametrize("victim", ["origin", "hosts"])
def test_agent_killed_with_containers_created_running_and_exited(kube: Kubelet, victim: str) -> None:
    f = kube.f
    made = every_state(kube, "states")
    before = {cid: kube.status(cid) for cid in made}
    with LiveCopies(f, kube):
        for name in ([ORIGIN] if victim == "origin" else list(HOSTS)):
            restart_agent(f, name)
        f.wait_meshed()
        settled(f, kube)
        for cid, state in made.items():
            st = kube.status(cid)
            assert (st.state, st.exit_code, st.reason) == (state, before[cid].exit_code, before[cid].reason), cid
        # What was created still starts, through the restarted agents.
        for cid, state in made.items():
            if state == CREATED:
                kube.start(cid)
                kube.wait_state(cid, RUNNING)
    settled(f, kube)
