"""weft-reserved: each hosted stage has a reservation pod on its host, so the scheduler never binds onto its CPU.

The same hand-made workloads as the engine's tests: a CPU stage hosted on a
32-vCPU CPU node, and a plain pod that would fit only in the CPU the stage
uses. In weft the scheduler cannot see the stage and binds the plain pod on
top of it (the squeezed share); with the reservation it waits, or goes to
another node.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from shim.sim.engine import simulate
from shim.sim.metrics import summarise
from shim.sim.model import GIB, Mode
from tests.sim.builders import CPU_NODE, cluster, cpu_pod, gpu_pod

SQUEEZE = [gpu_pod("a", cpu=24.0), cpu_pod("plain", arrival=1.0, run=3599.0, cpu=16.0)]


def test_the_scheduler_refuses_to_bind_a_plain_pod_onto_reserved_cpu():
    run = simulate(SQUEEZE, cluster(), Mode.WEFT_RESERVED)
    hosted, plain = run.outcomes
    assert ("cpu", "cpu-000", "rerouted") in hosted.placements
    # 32 - 24 reserved = 8 vCPU left on the books: the 16-vCPU pod waits until the stage and its reservation go.
    assert plain.start == 3600.0 and plain.node == "cpu-000"
    s = summarise(run)
    assert s.hosted_squeezed_share == 0.0 and s.cpu_node_overcommit_vcpu_h == 0.0
    # Without the reservation the same pod is bound at once, on top of the stage.
    weft = simulate(SQUEEZE, cluster(), Mode.WEFT)
    assert weft.outcomes[1].start == 1.0 and summarise(weft).hosted_squeezed_share > 0


def test_the_reservation_is_bound_with_the_stage_and_deleted_when_the_pod_ends():
    run = simulate(SQUEEZE, cluster(), Mode.WEFT_RESERVED)
    events = [(e.t, e.event, e.container, e.node, e.memory_bytes, e.reason) for e in run.log
              if e.event.startswith("reservation.")]
    assert events == [(0.0, "reservation.bound", "cpu", "cpu-000", 8 * GIB, "24 vCPU"),
                      (3600.0, "reservation.deleted", "cpu", "cpu-000", 8 * GIB, "24 vCPU")]
    assert not [e for e in simulate(SQUEEZE, cluster(), Mode.WEFT).log if e.event.startswith("reservation.")]


def test_memory_is_reserved_too():
    # 8 vCPU fit beside the stage, but 250 GiB do not fit beside its 8 GiB on a 256 GiB node.
    pods = [gpu_pod("a", cpu=24.0), cpu_pod("big", arrival=1.0, cpu=8.0, gib=250)]
    run = simulate(pods, cluster(), Mode.WEFT_RESERVED)
    assert run.outcomes[1].start == 3600.0
    assert simulate(pods, cluster(), Mode.WEFT).outcomes[1].start == 1.0


def test_a_growing_pool_adds_a_cpu_node_for_the_plain_pod_instead():
    run = simulate(SQUEEZE, cluster(cpu_nodes=0), Mode.WEFT_RESERVED, grow_cpu=True)
    assert run.cluster.cpu_nodes == 2
    assert (run.outcomes[1].start, run.outcomes[1].node) == (1.0, "cpu-001")
    weft = simulate(SQUEEZE, cluster(cpu_nodes=0), Mode.WEFT, grow_cpu=True)
    assert weft.cluster.cpu_nodes == 1  # the fleet looks smaller only because the stage is squeezed


def test_the_gpu_node_books_are_those_of_weft():
    # Reservations live on the CPU node; the GPU node books the GPU stage and the CPU stage's token, as weft.
    pods = [gpu_pod("a", cpu=24.0)]
    reserved = simulate(pods, cluster(), Mode.WEFT_RESERVED)
    weft = simulate(pods, cluster(), Mode.WEFT)
    assert reserved.plans[0].node_request == weft.plans[0].node_request


def churn(seed: int) -> list:
    """Plain pods and two-stage pods of many sizes arriving and leaving on a small cluster."""
    rng = random.Random(seed)
    pods = []
    for k in range(120):
        t = rng.uniform(0, 20_000)
        if rng.random() < 0.5:
            pods.append(cpu_pod(f"p{k}", arrival=t, run=rng.uniform(100, 5000), cpu=rng.choice([1.0, 2.5, 7.0, 12.0]),
                                gib=rng.choice([2, 8, 32])))
        else:
            pods.append(gpu_pod(f"g{k}", arrival=t, run=rng.uniform(100, 5000), gib=rng.choice([10, 20, 40]),
                                cpu=rng.choice([0.5, 3.0, 9.0, 17.5]), cpu_gib=rng.choice([1, 8, 24])))
    return pods


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_cpu_node_ever_runs_over_with_every_hosted_stage_reserved(seed):
    pods = churn(seed)
    spec = cluster(gpu_nodes=2, gpus=4, cpu_nodes=3)
    run = simulate(pods, spec, Mode.WEFT_RESERVED)
    s = summarise(run)
    assert s.cpu_stages_rerouted > 0
    assert s.hosted_squeezed_share == 0.0  # exactly, not approximately
    assert s.cpu_node_overcommit_vcpu_h == 0.0
    # Replay: at every instant a CPU node's plain pods and hosted stages fit its capacity.
    use: dict[str, list[float]] = defaultdict(list)
    changes = []
    for pod, out in zip(run.pods, run.outcomes, strict=True):
        if out.start is None:
            continue
        cpu_parts = [(out.node, pod.total_cpu.cpu_cores)] if pod.gpu is None else []
        cpu_parts += [(peer.name, limits.cpu_cores) for peer, limits in out.hosted]
        for node, cpu in cpu_parts:
            changes += [(out.start, 1, node, cpu), (out.end, 0, node, -cpu)]
    level: dict[str, float] = defaultdict(float)
    for _, _, node, delta in sorted(changes):
        level[node] += delta
        use[node].append(level[node])
    assert max(max(v) for v in use.values()) <= CPU_NODE.cpu_cores + 1e-9
    # The same pods without reservations do get squeezed, so the test can tell the difference.
    assert summarise(simulate(pods, spec, Mode.WEFT)).hosted_squeezed_share > 0


def test_a_reserved_node_running_over_stops_the_engine(monkeypatch):
    # Guard of the invariant: were the books to let a plain pod onto reserved CPU, the run fails loudly.
    from shim.sim import engine

    monkeypatch.setattr(engine._CpuNode, "books_fit", lambda self, request: True)
    with pytest.raises(RuntimeError, match="over capacity with every hosted stage reserved"):
        simulate(SQUEEZE, cluster(), Mode.WEFT_RESERVED)
