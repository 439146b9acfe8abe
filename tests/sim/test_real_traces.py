"""The simulation on the public trace samples that ship with weft: validation passes, every output is written.

The run is the command a user types first, ``weft simulate --out DIR --validate`` with no input flag, which
reads the GenTD26 and Prism DLRM samples in ``shim/sim/traces/``; it is done once for all the tests in this
module.
"""

from __future__ import annotations

import json

import pytest

from shim.sim import validate
from shim.sim.cli import DEFAULT_INPUTS, SAMPLES, main


def test_every_default_sample_ships_with_its_readme():
    for name in (*DEFAULT_INPUTS.values(), "validation-targets.json", "README.md"):
        assert (SAMPLES / name).stat().st_size > 0, name
    readme = (SAMPLES / "README.md").read_text()
    for name in DEFAULT_INPUTS.values():
        assert name in readme, f"the traces README does not describe {name}"


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    out = tmp_path_factory.mktemp("simulate")
    code = main(["--out", str(out), "--validate"])
    return code, out


def test_bundled_validation_passes_within_the_stated_tolerances(outcome):
    code, out = outcome
    doc = json.loads((out / "results.json").read_text())
    failed = [v for v in doc["validation"] if not v["passed"]]
    assert not failed, f"out of tolerance: {failed}"
    ids = {v["id"].split("@")[0] for v in doc["validation"]}
    assert {"genai_serving_gpu_duty_mean", "genai_serving_gpu_duty_zero_frac", "genai_serving_gpu_mem_held",
            "dlrm_cn_vcpu_per_gpu", "dlrm_cpu_share_off_gpu_node", "dlrm_hn_vcpu_per_gpu"} <= ids
    assert code == 0  # --validate exits 1 on any failure


def test_report_json_and_both_figures_are_written(outcome):
    _, out = outcome
    for name in ("report.md", "results.json", "utilisation.png", "completion_cdf.png"):
        assert (out / name).stat().st_size > 0, name
    for name in ("utilisation.png", "completion_cdf.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    for section in ("## Inputs", "## Results", "## Validation of the bundled mode", "## Assumptions",
                    "### DLRM workload (--dlrm)", "### GenTD26 GPU behaviour", "duty cycle"):
        assert section in report


def test_results_have_both_modes_and_their_ratio(outcome):
    _, out = outcome
    doc = json.loads((out / "results.json").read_text())
    bundled, weft = doc["modes"]["bundled"], doc["modes"]["weft"]
    assert bundled["placed"] == weft["placed"] == bundled["pods"] > 4000
    assert bundled["busy_gpu_s"] == pytest.approx(weft["busy_gpu_s"])  # the same work in both modes
    assert doc["ratios_weft_over_bundled"]["gpu_utilisation"] == pytest.approx(
        weft["gpu_utilisation"] / bundled["gpu_utilisation"])
    assert weft["gpus_held_mean"] < bundled["gpus_held_mean"]
    assert weft["cpu_stages_rerouted"] > 0
    assert doc["target"]["met"] or doc["target"]["why"], "a missed target must say why"


def test_a_run_without_input_flags_reads_the_shipped_samples(outcome):
    _, out = outcome
    inputs = json.loads((out / "results.json").read_text())["inputs"]
    for flag, attr in (("--genai-pods", "genai_pods"), ("--genai-summary", "genai_summary"), ("--dlrm", "dlrm")):
        assert inputs[flag].startswith(str(SAMPLES / DEFAULT_INPUTS[attr])), flag


def test_embedded_targets_match_validation_targets_json():
    published = {t["id"]: t["value"] for t in json.loads((SAMPLES / "validation-targets.json").read_text())["targets"]}
    for key, value in validate.TARGETS.items():
        expected = tuple(published[key]) if isinstance(published[key], list) else published[key]
        assert value == expected, key


def test_the_reserved_mode_squeezes_nothing_and_the_fleet_is_priced_per_mode(outcome):
    _, out = outcome
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["modes"]) == {"bundled", "weft", "weft-full-requests", "weft-reserved", "kai-fractions"}
    reserved = doc["modes"]["weft-reserved"]
    assert reserved["cpu_stages_rerouted"] > 0
    assert reserved["hosted_squeezed_share"] == 0.0  # exactly: the scheduler counts every hosted stage
    assert reserved["cpu_node_overcommit_vcpu_h"] == 0.0
    assert doc["modes"]["weft"]["hosted_squeezed_share"] > 0
    assert reserved["busy_gpu_s"] == pytest.approx(doc["modes"]["bundled"]["busy_gpu_s"])  # the same work
    prices, fleet = doc["prices"], doc["fleet_by_mode"]
    assert set(fleet) == set(doc["modes"])
    bundled = fleet["bundled"]
    for name, row in fleet.items():
        assert (row["gpu_nodes_needed"], row["cpu_nodes_needed"]) == tuple(doc["nodes_needed_by_mode"][name].values())
        assert row["fleet_usd_per_hour"] == pytest.approx(row["gpu_nodes_needed"] * prices["gpu_node_usd_per_hour"]
                                                          + row["cpu_nodes_needed"] * prices["cpu_node_usd_per_hour"])
        assert row["gpu_nodes_ratio"] == pytest.approx(row["gpu_nodes_needed"] / bundled["gpu_nodes_needed"])
        assert row["cpu_nodes_ratio"] == pytest.approx(row["cpu_nodes_needed"] / bundled["cpu_nodes_needed"])
        assert row["cost_ratio"] == pytest.approx(row["fleet_usd_per_hour"] / bundled["fleet_usd_per_hour"])
    assert fleet["weft-reserved"]["hosted_squeezed_share"] == 0.0
    # Reserving hosted stages costs CPU nodes that the squeezed fleet only seemed not to need.
    assert fleet["weft-reserved"]["cpu_nodes_needed"] > fleet["weft"]["cpu_nodes_needed"]
    assert fleet["weft-reserved"]["gpu_nodes_needed"] == fleet["weft"]["gpu_nodes_needed"]
    report = (out / "report.md").read_text()
    assert "## Fleet: the nodes each mode needs, and their cost" in report and "### Cost" in report
    assert "p5.48xlarge" in report and "r7i.48xlarge" in report


def test_kai_fractions_hold_the_shares_weft_leases_and_run_out_of_memory_only_below_each_stages_peak(outcome):
    _, out = outcome
    doc = json.loads((out / "results.json").read_text())
    kai, full = doc["modes"]["kai-fractions"], doc["modes"]["weft-full-requests"]
    # Bundled on the GPU node as weft-full-requests books it, with the same shares packed alike: the same GPUs held.
    assert kai["gpus_held_mean"] == pytest.approx(full["gpus_held_mean"])
    assert kai["cpu_stages_rerouted"] == 0
    # At each stage's peak no one can run out, enforced or not: the same work in every mode.
    for name, s in doc["modes"].items():
        assert (s["oom_failures"], s["oom_gpu_h_lost"]) == (0, 0.0), name
    assert kai["busy_gpu_s"] == pytest.approx(doc["modes"]["bundled"]["busy_gpu_s"])
    rows = {r["lease"]: r for r in doc["lease_sensitivity"]}
    assert rows["peak"]["oom_failures"] == rows["peak"]["kai_oom_failures"] == 0
    # Below the peak: weft fails only stages above their own lease; KAI's failures are counted beside them.
    assert rows["mean"]["oom_failures"] > 0 and all(r["oom_failures_within_share"] == 0 for r in rows.values())
    assert rows["mean"]["kai_oom_failures"] >= rows["mean"]["kai_oom_failures_within_share"]
