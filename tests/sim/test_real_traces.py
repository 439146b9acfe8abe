"""The simulation on the real trace samples in ../shared/traces: validation passes, every output is written.

CI always has the traces folder beside the repository, so a missing folder
is a failure with a clear message, never a skip: a skipped test here would
let a broken simulator through unnoticed. The run is the same command a user
types, on the GenTD26 sample and the Prism DLRM sample, done once for all the
tests in this module.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from shim.sim import validate
from shim.sim.cli import main

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
GENAI = "alibaba-genai2026-pod-gpu-sample.csv"
DLRM = "alibaba-dlrm2025-disagg-sample.csv"


def traces() -> Path:
    missing = [name for name in (GENAI, DLRM, "validation-targets.json") if not (TRACES / name).is_file()]
    if missing:
        pytest.fail(f"the public trace samples are missing from {TRACES} ({', '.join(missing)}); the simulator's "
                    "real-trace test needs the shared/traces folder beside the repository", pytrace=False)
    return TRACES


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    folder = traces()
    out = tmp_path_factory.mktemp("simulate")
    began = time.perf_counter()
    code = main(["--genai-pods", str(folder / GENAI), "--dlrm", str(folder / DLRM), "--out", str(out), "--validate"])
    return code, out, time.perf_counter() - began


def test_bundled_validation_passes_within_the_stated_tolerances(outcome):
    code, out, _ = outcome
    doc = json.loads((out / "results.json").read_text())
    failed = [v for v in doc["validation"] if not v["passed"]]
    assert not failed, f"out of tolerance: {failed}"
    ids = {v["id"].split("@")[0] for v in doc["validation"]}
    assert {"genai_serving_gpu_duty_mean", "genai_serving_gpu_duty_zero_frac", "genai_serving_gpu_mem_held",
            "dlrm_cn_vcpu_per_gpu", "dlrm_cpu_share_off_gpu_node", "dlrm_hn_vcpu_per_gpu"} <= ids
    assert code == 0  # --validate exits 1 on any failure


def test_report_json_and_both_figures_are_written(outcome):
    _, out, _ = outcome
    for name in ("report.md", "results.json", "utilisation.png", "completion_cdf.png"):
        assert (out / name).stat().st_size > 0, name
    for name in ("utilisation.png", "completion_cdf.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    for section in ("## Inputs", "## Results", "## Validation of the bundled mode", "## Assumptions",
                    "### DLRM workload (--dlrm)", "### GenTD26 GPU behaviour", "duty cycle"):
        assert section in report


def test_results_have_both_modes_and_their_ratio(outcome):
    _, out, _ = outcome
    doc = json.loads((out / "results.json").read_text())
    bundled, weft = doc["modes"]["bundled"], doc["modes"]["weft"]
    assert bundled["placed"] == weft["placed"] == bundled["pods"] > 4000
    assert bundled["busy_gpu_s"] == pytest.approx(weft["busy_gpu_s"])  # the same work in both modes
    assert doc["ratios_weft_over_bundled"]["gpu_utilisation"] == pytest.approx(
        weft["gpu_utilisation"] / bundled["gpu_utilisation"])
    assert weft["gpus_held_mean"] < bundled["gpus_held_mean"]
    assert weft["cpu_stages_rerouted"] > 0
    assert doc["target"]["met"] or doc["target"]["why"], "a missed target must say why"


def test_the_run_on_the_samples_is_fast(outcome):
    assert outcome[2] < 60.0


def test_embedded_targets_match_validation_targets_json():
    published = {t["id"]: t["value"] for t in json.loads((traces() / "validation-targets.json").read_text())["targets"]}
    for key, value in validate.TARGETS.items():
        expected = tuple(published[key]) if isinstance(published[key], list) else published[key]
        assert value == expected, key
