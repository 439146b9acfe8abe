"""The fleet's books: nodes times hourly prices, ratios against bundled, worked out by hand."""

from __future__ import annotations

import pytest

from shim.core.reroute import Resources
from shim.sim.cost import DEFAULT_PRICES, Prices, books, fleet_usd_per_hour
from shim.sim.model import GIB, Mode
from shim.sim.study import study
from tests.sim.builders import cluster, cpu_pod, gpu_pod

PRICES = Prices(50.0, 10.0, "test GPU node", "test CPU node")


def test_a_fleet_costs_its_nodes_at_their_hourly_prices():
    assert fleet_usd_per_hour(3, 4, PRICES) == 3 * 50.0 + 4 * 10.0
    assert fleet_usd_per_hour(0, 0, PRICES) == 0.0


def test_books_give_each_mode_its_cost_and_its_ratios_against_bundled():
    needed = {"bundled": {"gpu_nodes": 10, "cpu_nodes": 4}, "weft-reserved": {"gpu_nodes": 2, "cpu_nodes": 8}}
    out = books(needed, {"bundled": None, "weft-reserved": 0.0}, {"bundled": 24.0, "weft-reserved": 24.0}, PRICES)
    bundled, reserved = out["bundled"], out["weft-reserved"]
    assert bundled["fleet_usd_per_hour"] == 540.0 and reserved["fleet_usd_per_hour"] == 180.0
    assert (bundled["gpu_nodes_usd_per_hour"], bundled["cpu_nodes_usd_per_hour"]) == (500.0, 40.0)
    assert reserved["fleet_usd_over_run"] == 180.0 * 24
    assert (reserved["gpu_nodes_ratio"], reserved["cpu_nodes_ratio"]) == (0.2, 2.0)
    assert reserved["cost_ratio"] == pytest.approx(180 / 540)
    assert bundled["cost_ratio"] == 1.0
    assert reserved["hosted_squeezed_share"] == 0.0


def test_a_ratio_against_nothing_is_none():
    needed = {"bundled": {"gpu_nodes": 1, "cpu_nodes": 0}, "weft": {"gpu_nodes": 1, "cpu_nodes": 2}}
    out = books(needed, {}, {"bundled": 1.0, "weft": 1.0}, Prices(0.0, 0.0, "", ""))
    assert out["weft"]["cpu_nodes_ratio"] is None and out["weft"]["cost_ratio"] is None
    assert out["weft"]["gpu_nodes_ratio"] == 1.0


def test_default_prices_name_their_public_source_and_date():
    assert DEFAULT_PRICES.gpu_node_usd_per_hour > DEFAULT_PRICES.cpu_node_usd_per_hour > 0
    assert "p5.48xlarge" in DEFAULT_PRICES.gpu_node_source and "2026" in DEFAULT_PRICES.gpu_node_source
    assert "r7i.48xlarge" in DEFAULT_PRICES.cpu_node_source and "2026" in DEFAULT_PRICES.cpu_node_source


def test_a_study_prices_the_fleet_each_mode_needs_on_its_own():
    # Two 100-vCPU CPU stages and a 100-vCPU plain pod on 224-vCPU GPU nodes and 192-vCPU CPU nodes.
    pods = [gpu_pod("a", cpu=100.0), gpu_pod("b", cpu=100.0), cpu_pod("plain", arrival=1.0, cpu=100.0, gib=64)]
    spec = cluster(gpu_nodes=0, gpus=8, cpu_nodes=0, gpu_node=Resources(224.0, 2048 * GIB),
                   cpu_node=Resources(192.0, 1024 * GIB))
    st = study(pods, spec, gpu_nodes_given=False, cpu_nodes_given=False, sensitivity=False, prices=PRICES)
    fleet = st.fleet
    assert set(fleet) == {m.value for m in Mode}
    # bundled: both pods on one GPU node (2 x 102 vCPU), the plain pod on one CPU node.
    assert (fleet["bundled"]["gpu_nodes_needed"], fleet["bundled"]["cpu_nodes_needed"]) == (1, 1)
    # weft-reserved: each 100-vCPU stage reserved on its own CPU node, and the plain pod on a third.
    assert (fleet["weft-reserved"]["gpu_nodes_needed"], fleet["weft-reserved"]["cpu_nodes_needed"]) == (1, 3)
    assert fleet["weft-reserved"]["fleet_usd_per_hour"] == 50.0 + 3 * 10.0
    assert fleet["weft-reserved"]["cost_ratio"] == pytest.approx(80.0 / 60.0)
    assert fleet["weft-reserved"]["hosted_squeezed_share"] == 0.0
    # weft: the plain pod is bound onto a host's CPU the scheduler cannot see, so it seems to need fewer nodes.
    assert fleet["weft"]["cpu_nodes_needed"] == 2 and fleet["weft"]["hosted_squeezed_share"] > 0


def test_with_both_node_counts_given_no_mode_is_sized_and_the_note_says_so():
    st = study([gpu_pod("a")], cluster(gpu_nodes=1, cpu_nodes=1), gpu_nodes_given=True, cpu_nodes_given=True,
               sensitivity=False, prices=PRICES)
    assert st.fleet == {}
    assert "$60.00/h" in st.fleet_note and "--gpu-nodes" in st.fleet_note
