"""The weft run decides with shim.core itself, and what it decides never breaks the broker's invariants.

Spies wrap the core functions where the simulator looks them up, to show
every decision passes through them (a simulator that re-implemented packing
or rerouting would pass the arithmetic tests and still drift from the
agent). The property test replays the event log of random small workloads
and checks, at every instant, what the broker promises: no device holds more
memory or compute than it has, a whole device is never shared, and each pod
runs exactly its run time once it starts.
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

import shim.sim.engine as engine
import shim.sim.plan as plan
from shim.core.reroute import Resources
from shim.sim.engine import simulate
from shim.sim.model import GIB, Mode
from tests.sim.builders import cluster, cpu_pod, gpu_pod


def spy(monkeypatch, module, name: str) -> list:
    calls: list = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(result)
        return result

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_every_weft_decision_comes_from_shim_core(monkeypatch):
    packs = spy(monkeypatch, engine, "pack")
    decides = spy(monkeypatch, engine, "decide")
    capacities = spy(monkeypatch, engine, "free_capacity")
    classifications = spy(monkeypatch, plan, "classify")
    places = spy(monkeypatch, plan, "place")
    asks = spy(monkeypatch, plan, "gpu_ask")
    pods = [gpu_pod("a"), gpu_pod("b", annotations={"weft.io/stage.cpu": "local"})]
    simulate(pods, cluster(cpu_nodes=2), Mode.WEFT)
    assert [c.stage.value for c in classifications] == ["gpu", "cpu", "gpu", "local"]
    assert [p.reason.value for p in places] == ["gpu-leased", "gpu-leased", "pinned-local"]
    assert [(a.memory_bytes, a.compute_percent) for a in asks] == [(20 * GIB, 25)] * 2
    assert [p.reason.value for p in packs] == ["best-fit", "best-fit"]
    assert [d.reason.value for d in decides] == ["rerouted"]  # the local stage is never offered to a peer
    assert capacities, "peer views are built with reroute.free_capacity"


def test_bundled_pods_take_whole_devices_through_pack(monkeypatch):
    packs = spy(monkeypatch, engine, "pack")
    decides = spy(monkeypatch, engine, "decide")
    simulate([gpu_pod("a"), gpu_pod("b")], cluster(gpus=2), Mode.BUNDLED)
    assert [p.reason.value for p in packs] == ["whole-device", "whole-device"]
    assert not decides


pod_specs = st.lists(
    st.tuples(
        st.integers(0, 5000),  # arrival, s
        st.integers(1, 4000),  # run, s
        st.integers(1, 80),  # GPU memory lease, GiB
        st.sampled_from([None, 10, 50, 100]),  # explicit compute percent
        st.sampled_from([0.0, 2.0, 8.0, 30.0]),  # CPU stage vCPU (0: no CPU stage)
        st.booleans(),  # whole device (no memory annotation)
        st.booleans(),  # a plain CPU pod instead
    ),
    min_size=1, max_size=14,
)


@settings(max_examples=60, deadline=None)
@given(pod_specs, st.integers(1, 2), st.integers(1, 3), st.integers(0, 2), st.sampled_from(list(Mode)))
def test_replayed_event_log_never_breaks_device_limits(specs, gpu_nodes, gpus, cpu_nodes, mode):
    pods = []
    for k, (arrival, run, gib, compute, vcpu, whole, plain) in enumerate(specs):
        if plain:
            pods.append(cpu_pod(f"p{k}", arrival=arrival, run=run, cpu=max(vcpu, 1.0)))
            continue
        notes = {} if compute is None else {"weft.io/gpu-compute.gpu": str(compute)}
        pods.append(gpu_pod(f"p{k}", arrival=arrival, run=run, gib=gib, cpu=vcpu, lease=not whole, annotations=notes))
    spec = cluster(gpu_nodes, gpus, cpu_nodes, gpu_node=Resources(48.0, 512 * GIB))
    run = simulate(pods, spec, mode)

    memory: dict[str, int] = defaultdict(int)
    compute: dict[str, int] = defaultdict(int)
    leases: dict[str, int] = defaultdict(int)
    whole_held: set[str] = set()
    for event in sorted(run.log, key=lambda e: (e.t, e.event != "lease.released")):
        device = f"{event.node}/{event.device}"
        if event.event == "lease.acquired":
            assert device not in whole_held, "a whole device was shared"
            memory[device] += event.memory_bytes
            compute[device] += event.compute_percent
            leases[device] += 1
            if event.reason == "whole-device":
                assert leases[device] == 1, "a whole device went to a GPU already leased"
                whole_held.add(device)
            assert memory[device] <= spec.gpu_memory_bytes
            assert compute[device] <= 100
        elif event.event == "lease.released":
            memory[device] -= event.memory_bytes
            compute[device] -= event.compute_percent
            leases[device] -= 1
            whole_held.discard(device)
    assert all(v == 0 for v in memory.values()), "every lease is released"
    for pod, out in zip(pods, run.outcomes, strict=True):
        if out.unplaceable:
            assert out.start is None
            continue
        assert out.start is not None and out.end is not None, "every placeable pod runs eventually"
        assert out.start >= pod.arrival_s
        assert out.end - out.start == pod.run_s
