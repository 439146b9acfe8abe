"""``weft simulate`` as a user meets it: outputs written, --json alone on stdout, one-line errors naming the flag."""

from __future__ import annotations

import argparse
import json

import pytest

from shim.sim.cli import DEFAULT_INPUTS, SAMPLES, add_parser, main, run
from tests.sim.test_readers import DLRM_HEADER, GENAI_HEADER

SMALL = ["--synthetic", "--pods", "40", "--arrival-rate", "120", "--run-time", "20m", "--seed", "3"]


def test_add_parser_wires_a_simulate_subcommand_that_runs():
    parser = argparse.ArgumentParser(prog="weft")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *SMALL, "--gpu-nodes", "2", "--cpu-nodes", "1"])
    assert args.fn is run
    assert args.gpu_nodes == "2" and args.synthetic


def test_help_says_where_the_public_traces_are(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "cluster-trace-v2026-GenAI" in out and "disaggregated_DLRM_trace.csv" in out
    assert "duty cycle" in out


def test_help_states_the_default_node_prices_and_their_source(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--gpu-node-price USD" in out and "--cpu-node-price USD" in out
    assert "default 55.04: AWS p5.48xlarge" in out and "default 12.7008: AWS r7i.48xlarge" in out
    assert "aws.amazon.com/ec2/pricing/on-demand/" in out and "2026" in out


def test_node_prices_given_on_the_command_line_price_every_mode(capsys):
    assert main([*SMALL, "--gpu-node-price", "10", "--cpu-node-price", "1.5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prices"]["gpu_node_usd_per_hour"] == 10.0 and doc["prices"]["cpu_node_usd_per_hour"] == 1.5
    assert doc["prices"]["gpu_node_source"] == "given with --gpu-node-price"
    assert set(doc["fleet_by_mode"]) == set(doc["modes"])
    for name, row in doc["fleet_by_mode"].items():
        assert row["fleet_usd_per_hour"] == row["gpu_nodes_needed"] * 10.0 + row["cpu_nodes_needed"] * 1.5, name
        assert row["gpu_nodes_needed"] == doc["nodes_needed_by_mode"][name]["gpu_nodes"]
    assert doc["fleet_by_mode"]["weft-reserved"]["hosted_squeezed_share"] in (0.0, None)


def test_a_synthetic_run_writes_the_report_the_json_and_both_figures(tmp_path, capsys):
    assert main([*SMALL, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "GPU utilisation (duty cycle, busy/held)" in out and "target:" in out
    for name in ("report.md", "results.json", "utilisation.png", "completion_cdf.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(doc["modes"]) == {"bundled", "weft", "weft-full-requests", "weft-reserved", "kai-fractions"}
    assert doc["modes"]["bundled"]["placed"] == 40
    report = (tmp_path / "out" / "report.md").read_text()
    assert "(utilisation.png)" in report and "### Synthetic workload (--synthetic)" in report
    assert "### DLRM workload" not in report  # only the assumptions that apply


def test_json_prints_only_the_results_and_the_same_seed_gives_the_same_results(capsys):
    assert main([*SMALL, "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main([*SMALL, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == first
    assert first["gpu_metric"].startswith("duty cycle")
    assert main([*SMALL[:-1], "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["modes"] != first["modes"]


def test_kai_fractions_run_beside_weft_with_their_out_of_memory_figures(tmp_path, capsys):
    # One GenTD26 pod whose memory cycles 10, 30, 60, 30 GiB: at its mean (33 GiB, rounded up) two stages share an
    # 80 GiB GPU, and both at 60 GiB, or one at 30 beside one at 60, do not fit.
    memory = [10, 30, 60, 30] * 10
    rows = "".join(f"p,{57 * k},5.0,{gib * 2**30},0.5\n" for k, gib in enumerate(memory))
    genai = write(tmp_path, "genai.csv", GENAI_HEADER + rows)
    argv = [*SMALL, "--genai-pods", genai, "--lease", "mean", "--gpu-nodes", "2", "--cpu-nodes", "2"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    assert "kai-fractions" in table.splitlines()[1]
    assert "GPU-stage OOM failures" in table and "of which within own share (neighbour's overrun)" in table
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    kai, weft = doc["modes"]["kai-fractions"], doc["modes"]["weft"]
    for s in (kai, weft):
        assert {"oom_failures", "oom_failures_within_share", "oom_stages_failed", "oom_gpu_h_lost",
                "oom_busy_gpu_h_lost"} <= set(s)
    # Every failure in weft is of a stage above its own lease; without the limit, stages within theirs fail too.
    assert weft["oom_failures"] > 0 and weft["oom_failures_within_share"] == 0
    assert kai["oom_failures_within_share"] > 0 and kai["oom_gpu_h_lost"] > 0
    assert doc["modes"]["bundled"]["oom_failures"] == 0  # a whole 80 GiB GPU holds 60 GiB
    mean = next(r for r in doc["lease_sensitivity"] if r["lease"] == "mean")
    assert (mean["oom_failures"], mean["kai_oom_failures"]) == (weft["oom_failures"], kai["oom_failures"])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "### Out of memory: the shares enforced (weft) or not (kai-fractions)" in report
    assert "| kai-fractions |" in report


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        pytest.param(["--dlrm", "/nonexistent/dlrm.csv"], "--dlrm", ["/nonexistent/dlrm.csv", "no such file"],
                     id="missing-file"),
        pytest.param(["--genai-pods", str(SAMPLES / DEFAULT_INPUTS["genai_pods"])], "--dlrm", ["exactly one"],
                     id="gpu-behaviour-without-a-workload"),
        pytest.param([*SMALL, "--gpu-memory", "80GB"], "--gpu-memory", ['"80GB"'], id="bad-size"),
        pytest.param([*SMALL, "--pods", "many"], "--pods", ["'many'"], id="bad-count"),
        pytest.param([*SMALL, "--run-time", "soon"], "--run-time", ["duration"], id="bad-duration"),
        pytest.param([*SMALL, "--cpu-stage", "8"], "--cpu-stage", ["VCPU:MEMORY"], id="bad-pair"),
        pytest.param([*SMALL, "--duty", "lots"], "--duty", ["uniform:LO,HI"], id="bad-duty"),
        pytest.param([*SMALL, "--gpu-node-price", "cheap"], "--gpu-node-price", ["'cheap'", "$ per hour"],
                     id="bad-gpu-node-price"),
        pytest.param([*SMALL, "--cpu-node-price", "-1"], "--cpu-node-price", ["'-1'", "0 or more"],
                     id="negative-cpu-node-price"),
        pytest.param([*SMALL, "--gpu-node-price", "nan"], "--gpu-node-price", ["'nan'"], id="nan-price"),
        pytest.param([*SMALL, "--cpu-node-price", "inf"], "--cpu-node-price", ["'inf'"], id="infinite-price"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(argv, flag, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith(f"weft simulate: {flag}:")
    for word in words:
        assert word in err


def test_a_malformed_column_names_the_flag_the_file_and_the_column(tmp_path, capsys):
    dlrm = write(tmp_path, "dlrm.csv", DLRM_HEADER + "i,HN,app,eight,1,40,0,0,,,\n")
    assert main(["--dlrm", dlrm]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"weft simulate: --dlrm: {dlrm}: line 2, column 'cpu_request'")
    genai = write(tmp_path, "genai.csv", "container_ip,timestamp_anon\n")
    assert main([*SMALL, "--genai-pods", genai]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"weft simulate: --genai-pods: {genai}: column 'gpu_duty_cycle_pct'")


def test_validate_exits_1_when_the_bundled_run_misses_a_figure(tmp_path, capsys):
    # A pod busy half of the time is nothing like GenTD26's 7 % mean duty cycle.
    rows = "".join(f"p,{57 * k},50.0,{23 * 2**30},0.5\n" for k in range(20))
    genai = write(tmp_path, "genai.csv", GENAI_HEADER + rows)
    dlrm = write(tmp_path, "dlrm.csv", DLRM_HEADER + "h,HN,app,8,1,40,0,0,,,3600\nc,CN,app,64,0,320,0,0,,,3600\n")
    assert main(["--dlrm", dlrm, "--genai-pods", genai]) == 0
    assert main(["--dlrm", dlrm, "--genai-pods", genai, "--validate"]) == 1
    out = capsys.readouterr().out
    assert "genai_serving_gpu_duty_mean" in out and "FAIL" in out
