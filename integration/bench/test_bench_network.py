"""``weft bench network --quick`` runs end to end: every figure is there and sane, and nothing is left behind.

A measurement, so this checks the figures' shape (positive, p99 not under
p50, the split of the exec round trip consistent), never how fast anything
was: timing thresholds would only measure how busy the test machine is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.leaks import leaked_node_namespaces, netns
from harness.weft_bench import positive, run
from shim.config import AgentConfig

pytestmark = pytest.mark.slow


def test_bench_network_quick_has_every_figure(tmp_path: Path) -> None:
    before = netns()
    out = tmp_path / "network.json"
    res = run("network", "--quick", "--json", "--output", str(out))
    figures = json.loads(res.stdout)
    assert json.loads(out.read_text()) == figures

    for path in ("direct", "stitched"):
        positive(figures["throughput_gbytes_s"][path], f"{path} throughput")
        rr = figures["rr_ms"][path]
        positive(rr["p50"], f"{path} p50")
        assert rr["p99"] >= rr["p50"], path
    positive(figures["throughput_ratio"], "throughput ratio")
    assert figures["added_p50_ms"] == pytest.approx(
        figures["rr_ms"]["stitched"]["p50"] - figures["rr_ms"]["direct"]["p50"], abs=1e-3)
    # The fabric's pod network is flat: the kernel carries 127.0.0.1 to the shadow, and the agents spend next to
    # nothing on it; the tunnel ([::1]) is measured beside it, and costs them CPU.
    assert figures["stitched_path"] == {"7500": "kernel", "7501": "kernel"}
    for agent in ("origin", "host"):
        assert figures["agent_cpu_s_per_gib"][agent] >= 0, agent
    if "tunnel" in figures["throughput_gbytes_s"]:
        positive(figures["tunnel_throughput_ratio"], "tunnel throughput ratio")
        assert figures["tunnel_added_p50_ms"] == pytest.approx(
            figures["rr_ms"]["tunnel"]["p50"] - figures["rr_ms"]["direct"]["p50"], abs=1e-3)
        for agent in ("origin", "host"):
            positive(figures["agent_cpu_s_per_gib_tunnel"][agent], f"{agent} agent CPU per GiB, tunnel")

    ex = figures["exec_rtt_ms"]
    for k in ("remote", "local", "shadow_on_host"):
        positive(ex[k]["p50"], f"exec {k} p50")
        assert ex[k]["p99"] >= ex[k]["p50"], k
    # The figures are computed before rounding, the p50s shown are rounded to the microsecond: allow for that.
    assert figures["exec_ratio"] == pytest.approx(ex["remote"]["p50"] / ex["local"]["p50"], rel=0.01)
    assert figures["exec_added_by_relays_ms"] == pytest.approx(ex["remote"]["p50"] - ex["shadow_on_host"]["p50"],
                                                               abs=3e-3)
    positive(figures["exec_agent_cpu_ms_per_keystroke"], "the agents' CPU a keystroke")
    assert figures["stream_busy_poll_us"] == AgentConfig().stream_busy_poll_us  # the agents ran with the default
    assert set(figures["targets"]) == {"throughput_ratio", "throughput_ratio_stretch", "added_p50_ms", "exec_ratio",
                                       "kernel_throughput_ratio", "kernel_added_p50_ms"}
    assert "exec echo" not in res.stdout  # --json: the object only
    assert not leaked_node_namespaces(before)  # the fabric's node namespaces went with it
