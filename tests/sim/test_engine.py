"""The event engine on workloads small enough to work out by hand: holding, queueing, placement, accounting.

Each case states the pods and the cluster, and the assertion is the number a
person gets with pencil and paper: which GPUs are held for how long, when a
waiting pod starts, where a CPU stage lands and for what reason.
"""

from __future__ import annotations

import pytest

from shim.core.reroute import Resources
from shim.sim.engine import simulate
from shim.sim.metrics import summarise
from shim.sim.model import GIB, Mode
from tests.sim.builders import cluster, cpu_pod, gpu_pod


def placements(run, pod: str) -> dict[str, tuple[str, str]]:
    return {e.container: (e.node, e.reason) for e in run.log if e.event == "container.placed" and e.pod == pod}


def test_two_quarter_busy_pods_hold_two_gpus_bundled_and_one_with_weft():
    pods = [gpu_pod("a"), gpu_pod("b")]
    spec = cluster(gpus=2)
    bundled, weft = (summarise(simulate(pods, spec, m)) for m in (Mode.BUNDLED, Mode.WEFT))
    assert (bundled.gpus_held_peak, weft.gpus_held_peak) == (2, 1)
    assert bundled.held_gpu_s == 2 * 3600 and weft.held_gpu_s == 3600
    assert bundled.busy_gpu_s == weft.busy_gpu_s == 2 * 0.25 * 3600  # the same work in both modes
    assert bundled.gpu_utilisation == pytest.approx(0.25)
    assert weft.gpu_utilisation == pytest.approx(0.5)
    assert weft.gpu_stages_per_held_gpu == pytest.approx(2.0)


def test_weft_leases_are_memory_shares_with_compute_equal_to_the_memory_fraction():
    run = simulate([gpu_pod("a", gib=20)], cluster(), Mode.WEFT)
    lease = next(e for e in run.log if e.event == "lease.acquired")
    assert (lease.memory_bytes, lease.compute_percent, lease.reason) == (20 * GIB, 25, "best-fit")
    bundled = simulate([gpu_pod("a", gib=20)], cluster(), Mode.BUNDLED)
    whole = next(e for e in bundled.log if e.event == "lease.acquired")
    assert (whole.memory_bytes, whole.compute_percent, whole.reason) == (80 * GIB, 100, "whole-device")


def test_a_pod_that_does_not_fit_waits_in_arrival_order():
    pods = [gpu_pod(n, arrival=t, run=100.0) for n, t in (("a", 0.0), ("b", 10.0), ("c", 20.0))]
    run = simulate(pods, cluster(gpus=1), Mode.BUNDLED)
    assert [o.start for o in run.outcomes] == [0.0, 100.0, 200.0]
    s = summarise(run)
    assert (s.queue_p50_s, s.completion_p50_s) == (90.0, 190.0)
    assert s.jobs_per_hour == pytest.approx(3 / (300 / 3600))
    # With 20 GiB leases all three share the one GPU at once.
    weft = simulate(pods, cluster(gpus=1), Mode.WEFT)
    assert [o.start for o in weft.outcomes] == [0.0, 10.0, 20.0]


def test_capacity_freed_at_an_instant_serves_a_pod_arriving_at_that_instant():
    pods = [gpu_pod("a", run=100.0), gpu_pod("b", arrival=100.0, run=100.0)]
    run = simulate(pods, cluster(gpus=1), Mode.BUNDLED)
    assert run.outcomes[1].start == 100.0


def test_a_waiting_pod_that_does_not_fit_does_not_hold_back_a_later_one_that_does():
    spec = cluster(gpus=2, gpu_node=Resources(16.0, 512 * GIB))
    pods = [
        gpu_pod("first", run=100.0, cpu=8.0),
        gpu_pod("big", arrival=1.0, run=100.0, cpu=12.0),  # 14 vCPU: waits for "first" to finish
        gpu_pod("small", arrival=2.0, run=100.0, cpu=4.0),  # 6 vCPU: fits beside "first"
    ]
    run = simulate(pods, spec, Mode.BUNDLED)
    assert [o.start for o in run.outcomes] == [0.0, 102.0, 2.0]


def test_the_cpu_stage_goes_to_a_cpu_node_and_the_gpu_stage_stays():
    run = simulate([gpu_pod("a")], cluster(), Mode.WEFT)
    assert placements(run, "a") == {"cpu": ("cpu-000", "rerouted"), "gpu": ("gpu-000", "gpu-leased")}
    assert run.rerouted == 1 and run.fell_back == 0


def test_a_stage_annotated_local_stays_on_the_gpu_node():
    pod = gpu_pod("a", annotations={"weft.io/stage.cpu": "local"})
    run = simulate([pod], cluster(), Mode.WEFT)
    assert placements(run, "a")["cpu"] == ("gpu-000", "pinned-local")
    assert run.rerouted == 0
    assert summarise(run).cpu_node_utilisation == 0.0


def test_without_room_on_a_cpu_node_the_stage_falls_back_to_the_gpu_node():
    full = simulate([gpu_pod("a", cpu=40.0)], cluster(), Mode.WEFT)  # the CPU node has 32 vCPU
    assert placements(full, "a")["cpu"] == ("gpu-000", "no-peer-fits")
    none = simulate([gpu_pod("a")], cluster(cpu_nodes=0), Mode.WEFT)
    assert placements(none, "a")["cpu"] == ("gpu-000", "no-peers")
    assert full.fell_back == none.fell_back == 1


def test_the_stage_goes_to_the_peer_with_most_cpu_left():
    # cpu-000 already runs an 8-vCPU plain pod, so cpu-001 has more room after placing.
    pods = [cpu_pod("plain", cpu=8.0), gpu_pod("a", arrival=1.0)]
    run = simulate(pods, cluster(cpu_nodes=2), Mode.WEFT)
    assert placements(run, "plain")["main"][0] == "cpu-000"
    assert placements(run, "a")["cpu"] == ("cpu-001", "rerouted")


def test_weft_books_only_a_token_for_the_cpu_stage_unless_requests_are_full():
    # A 60-vCPU CPU stage: the GPU node (64 vCPU) can book only one such pod whole.
    pods = [gpu_pod("a", cpu=60.0), gpu_pod("b", cpu=60.0)]
    spec = cluster(gpus=2, cpu_nodes=0)
    split = simulate(pods, spec, Mode.WEFT)
    full = simulate(pods, spec, Mode.WEFT_FULL)
    assert [o.start for o in split.outcomes] == [0.0, 0.0]
    assert [o.start for o in full.outcomes] == [0.0, 3600.0]
    # Both fell back (no CPU node), and with only a token booked the GPU node ran over its 64 vCPU.
    assert summarise(split).gpu_node_overcommit_vcpu_h == pytest.approx(60 + 60 + 2 * 2 - 64)
    assert summarise(full).gpu_node_overcommit_vcpu_h == 0.0


def test_the_scheduler_does_not_see_hosted_stages_and_the_excess_is_reported():
    # The stage takes 24 of cpu-000's 32 vCPU; the plain pod that comes next is bound by the books (0 used).
    pods = [gpu_pod("a", cpu=24.0), cpu_pod("plain", arrival=1.0, run=3599.0, cpu=16.0)]
    run = simulate(pods, cluster(), Mode.WEFT)
    s = summarise(run)
    assert s.cpu_node_overcommit_vcpu_h == pytest.approx(8 * 3599 / 3600)
    assert s.hosted_squeezed_share == pytest.approx(8 * 3599 / (24 * 3600))


def test_a_pod_larger_than_any_node_is_never_placed_and_left_out():
    pods = [gpu_pod("huge", cpu=100.0), gpu_pod("ok")]
    run = simulate(pods, cluster(), Mode.BUNDLED)
    assert run.outcomes[0].unplaceable and run.outcomes[0].start is None
    s = summarise(run)
    assert (s.placed, s.unplaceable) == (1, 1)


def test_a_bad_annotation_makes_the_pod_unplaceable_in_weft_with_the_annotation_named():
    pod = gpu_pod("a", lease=False, annotations={"weft.io/gpu-memory.gpu": "20GB"})
    run = simulate([pod], cluster(), Mode.WEFT)
    assert "weft.io/gpu-memory.gpu" in run.outcomes[0].unplaceable
    assert simulate([pod], cluster(), Mode.BUNDLED).outcomes[0].start == 0.0


def test_a_gpu_stage_without_a_memory_annotation_gets_whole_devices():
    run = simulate([gpu_pod("a", lease=False), gpu_pod("b", lease=False)], cluster(gpus=2), Mode.WEFT)
    assert summarise(run).gpus_held_peak == 2
    assert {e.reason for e in run.log if e.event == "lease.acquired"} == {"whole-device"}


def test_growing_pools_report_the_nodes_the_workload_needed():
    # 100-vCPU CPU stages bundled onto 224-vCPU GPU nodes: two per node, whatever the GPUs.
    big = Resources(224.0, 2048 * GIB)
    pods = [gpu_pod(f"p{k}", cpu=100.0) for k in range(5)]
    spec = cluster(gpu_nodes=0, gpus=8, cpu_nodes=0, gpu_node=big, cpu_node=Resources(192.0, 1024 * GIB))
    bundled = simulate(pods, spec, Mode.BUNDLED, grow_gpu=True, grow_cpu=True)
    weft = simulate(pods, spec, Mode.WEFT, grow_gpu=True, grow_cpu=True)
    assert (bundled.cluster.gpu_nodes, bundled.cluster.cpu_nodes) == (3, 0)
    # weft: five 20 GiB leases fit one node; each CPU node hosts one 100-vCPU stage.
    assert (weft.cluster.gpu_nodes, weft.cluster.cpu_nodes) == (1, 5)
    assert weft.fell_back == 0


def test_stages_whose_duty_adds_up_past_a_whole_gpu_are_reported_oversubscribed():
    busy = [gpu_pod("a", duty=0.6), gpu_pod("b", duty=0.6)]
    calm = [gpu_pod("a", duty=0.4), gpu_pod("b", duty=0.4)]
    assert summarise(simulate(busy, cluster(), Mode.WEFT)).oversubscribed_share == 1.0
    assert summarise(simulate(calm, cluster(), Mode.WEFT)).oversubscribed_share == 0.0
    assert summarise(simulate(busy, cluster(gpus=2), Mode.BUNDLED)).oversubscribed_share == 0.0
