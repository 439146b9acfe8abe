"""The fleet's books per mode: GPU nodes and CPU nodes each mode needs for the same work, and what they cost.

Each mode is sized on pools that grow whenever nothing fits (:func:`shim.sim.study.size_cluster`), so its node
counts are what that mode needs for the whole workload with no pod waiting; the fleet's cost is those counts
times the hourly price of a node of each kind. The squeezed share beside them is measured on that same fleet:
a mode that hides hosted stages from the scheduler needs fewer CPU nodes only because plain pods are bound on
top of the stages, and the two figures belong together. Ratios are against the bundled mode.

The default prices are public on-demand list prices of cloud instances shaped like the default nodes
(:data:`DEFAULT_PRICES`); ``--gpu-node-price`` and ``--cpu-node-price`` replace them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

BASELINE = "bundled"


@dataclass(frozen=True)
class Prices:
    gpu_node_usd_per_hour: float
    cpu_node_usd_per_hour: float
    gpu_node_source: str
    cpu_node_source: str

    def as_dict(self) -> dict:
        return asdict(self)


GPU_NODE_PRICE_SOURCE = (
    "AWS p5.48xlarge (8 x H100 80 GB, 192 vCPU, 2 TiB: the DGX H100-class default node), on-demand Linux, "
    "us-east-1, after AWS's June 2025 price cut for P5: $6.88 per GPU-hour x 8 = $55.04/h "
    "(compux.net/docs/guides/gpu-pricing-trends-2026, 2026; list at aws.amazon.com/ec2/pricing/on-demand/). "
    "Before the cut it was $98.32/h (nextplatform.com, 2023-07-27)"
)
CPU_NODE_PRICE_SOURCE = (
    "AWS r7i.48xlarge (192 vCPU, 1,536 GiB: the smallest 192-vCPU EC2 shape with at least the default CPU node's "
    "1 TiB), on-demand Linux, us-east-1, $12.7008/h (aws.amazon.com/ec2/pricing/on-demand/, as listed in 2026)"
)
DEFAULT_PRICES = Prices(55.04, 12.7008, GPU_NODE_PRICE_SOURCE, CPU_NODE_PRICE_SOURCE)


def fleet_usd_per_hour(gpu_nodes: int, cpu_nodes: int, prices: Prices) -> float:
    """What a fleet of ``gpu_nodes`` GPU nodes and ``cpu_nodes`` CPU nodes costs per hour."""
    return gpu_nodes * prices.gpu_node_usd_per_hour + cpu_nodes * prices.cpu_node_usd_per_hour


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def books(needed: Mapping[str, Mapping[str, int]], squeezed: Mapping[str, float | None],
          hours: Mapping[str, float], prices: Prices) -> dict[str, dict]:
    """Per mode: nodes needed, squeezed share on that fleet, its cost per hour and over the run, ratios to bundled.

    ``needed`` is what :func:`shim.sim.study.size_cluster` found (empty when both node counts were given: then
    no mode was sized, and every figure that depends on the fleet a mode needs is None); ``squeezed`` the
    hosted squeezed share of each mode's sized run; ``hours`` that run's length.
    """
    out: dict[str, dict] = {}
    for mode, nodes in needed.items():
        per_hour = fleet_usd_per_hour(nodes["gpu_nodes"], nodes["cpu_nodes"], prices)
        out[mode] = {
            "gpu_nodes_needed": nodes["gpu_nodes"],
            "cpu_nodes_needed": nodes["cpu_nodes"],
            "hosted_squeezed_share": squeezed.get(mode),
            "gpu_nodes_usd_per_hour": nodes["gpu_nodes"] * prices.gpu_node_usd_per_hour,
            "cpu_nodes_usd_per_hour": nodes["cpu_nodes"] * prices.cpu_node_usd_per_hour,
            "fleet_usd_per_hour": per_hour,
            "run_hours": hours.get(mode),
            "fleet_usd_over_run": per_hour * hours[mode] if mode in hours else None,
        }
    base = out.get(BASELINE)
    for row in out.values():
        row["gpu_nodes_ratio"] = _ratio(row["gpu_nodes_needed"], base and base["gpu_nodes_needed"])
        row["cpu_nodes_ratio"] = _ratio(row["cpu_nodes_needed"], base and base["cpu_nodes_needed"])
        row["cost_ratio"] = _ratio(row["fleet_usd_per_hour"], base and base["fleet_usd_per_hour"])
    return out
