"""Trace readers: the real files' shapes parse, and a bad file comes back as one error naming file, line, column."""

from __future__ import annotations

from pathlib import Path

import pytest

from shim.sim.model import GIB
from shim.sim.readers import TraceError, read_dlrm, read_genai_samples, read_genai_summary, read_openb_nodes

GENAI_HEADER = "container_ip,timestamp_anon,gpu_duty_cycle_pct,gpu_memory_used_bytes,pod_memory_util_frac\n"
DLRM_HEADER = ("instance_sn,role,app_name,cpu_request,gpu_request,memory_request,rdma_request,"
               "max_instance_per_node,creation_time,scheduled_time,deletion_time\n")


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_genai_samples_become_one_profile_per_pod_in_time_order(tmp_path):
    gib = 2**30
    path = write(tmp_path, "g.csv", GENAI_HEADER
                 + f"a,114,50.0,{2 * gib},0.5\n"  # out of order on purpose
                 + f"a,0,0.0,{gib},0.5\n"
                 + "a,57,100.0,,0.5\n"  # empty memory: the last value carries
                 + f"b,0,10.0,{3 * gib},0.1\n")
    profiles = {p.name: p for p in read_genai_samples(path)}
    a = profiles["a"]
    assert (a.step_s, a.duty, a.memory) == (57.0, (0.0, 1.0, 0.5), (gib, gib, 2 * gib))
    assert profiles["b"].duty == (0.1,)


def test_a_summary_pod_replays_its_mean_and_its_share_of_zero_samples(tmp_path):
    path = write(tmp_path, "s.csv", "container_ip,n_samples,gpu_duty_mean_pct,gpu_duty_median_pct,"
                 "frac_samples_zero_duty,gpu_duty_max_pct,gpu_mem_mean_GiB,gpu_mem_max_GiB,first_ts,last_ts\n"
                 "p,1000,7.0,0.0,0.65,60.0,23.0,40.5,0,1\n")
    (p,) = read_genai_summary(path)
    assert p.mean_duty == pytest.approx(0.07)
    assert p.zero_fraction == pytest.approx(0.65)
    assert p.mean_memory == pytest.approx(23.0 * GIB, rel=1e-9)
    assert p.peak_bytes == pytest.approx(40.5 * GIB, abs=1)


def test_dlrm_rows_with_times_outside_the_trace(tmp_path):
    path = write(tmp_path, "d.csv", DLRM_HEADER
                 + "i1,HN,app,8,1,40.0,25,4,,,\n"
                 + "i2,CN,app,96,0,480.0,0,-1,100,150,900\n")
    instances, end = read_dlrm(path)
    hn, cn = instances
    assert (hn.role, hn.created, hn.deleted, hn.gpus, hn.memory_bytes) == ("HN", None, None, 1, 40 * GIB)
    assert (cn.vcpu, cn.created, cn.scheduled, cn.deleted) == (96.0, 100.0, 150.0, 900.0)
    assert end == 900.0


def test_openb_nodes_in_vcpu_and_bytes(tmp_path):
    path = write(tmp_path, "n.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,96000,393216,8,G2\nn1,32000,262144,0,\n")
    gpu, cpu = read_openb_nodes(path)
    assert (gpu.vcpu, gpu.memory_bytes, gpu.gpus, gpu.model) == (96.0, 384 * GIB, 8, "G2")
    assert (cpu.gpus, cpu.model) == (0, "")


@pytest.mark.parametrize(
    ("reader", "text", "line", "column", "problem"),
    [
        pytest.param(read_genai_samples, "container_ip,timestamp_anon,gpu_memory_used_bytes\n", None,
                     "gpu_duty_cycle_pct", "missing", id="genai-missing-column"),
        pytest.param(read_genai_samples, GENAI_HEADER + "a,0,abc,1,0\n", 2, "gpu_duty_cycle_pct",
                     "'abc' is not a number", id="genai-not-a-number"),
        pytest.param(read_genai_samples, GENAI_HEADER + "a,0,130,1,0\n", 2, "gpu_duty_cycle_pct",
                     "out of range", id="genai-duty-over-100"),
        pytest.param(read_genai_samples, GENAI_HEADER + "a,0,5,,0\n", 2, "gpu_memory_used_bytes",
                     "first sample", id="genai-no-memory-to-carry"),
        pytest.param(read_dlrm, DLRM_HEADER + "i,XN,app,8,1,40,0,0,,,\n", 2, "role", "not a role",
                     id="dlrm-unknown-role"),
        pytest.param(read_dlrm, DLRM_HEADER + "i,HN,app,8,0.5,40,0,0,,,\n", 2, "gpu_request", "whole number",
                     id="dlrm-fractional-gpu"),
        pytest.param(read_dlrm, DLRM_HEADER + "i,CN,app,8,0,40,0,0,,,\ni,CN,app,,0,40,0,0,,,\n", 3,
                     "cpu_request", "empty", id="dlrm-empty-request"),
        pytest.param(read_dlrm, DLRM_HEADER + "i,CN,app,8,0,40,0,0,-5,,\n", 2, "creation_time", "out of range",
                     id="dlrm-negative-time"),
        pytest.param(read_openb_nodes, "sn,cpu_milli,gpu\n", None, "memory_mib", "missing", id="openb-missing"),
    ],
)
def test_bad_files_name_the_file_line_and_column(tmp_path, reader, text, line, column, problem):
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceError) as err:
        reader(path)
    message = str(err.value)
    assert message.startswith(str(path))
    assert f"column {column!r}" in message
    assert problem in message
    assert (err.value.line, err.value.column) == (line, column)


@pytest.mark.parametrize("reader", [read_genai_samples, read_genai_summary, read_dlrm, read_openb_nodes])
def test_missing_empty_and_directory_inputs(tmp_path, reader):
    with pytest.raises(TraceError, match="no such file"):
        reader(tmp_path / "absent.csv")
    with pytest.raises(TraceError, match="is a directory"):
        reader(tmp_path)
    header_only = write(tmp_path, "empty.csv", {
        read_genai_samples: GENAI_HEADER,
        read_genai_summary: "container_ip,n_samples,gpu_duty_mean_pct,frac_samples_zero_duty,gpu_mem_mean_GiB,"
                            "gpu_mem_max_GiB\n",
        read_dlrm: DLRM_HEADER,
        read_openb_nodes: "cpu_milli,memory_mib,gpu\n",
    }[reader])
    with pytest.raises(TraceError, match="has no rows"):
        reader(header_only)


def test_a_binary_file_is_not_a_csv(tmp_path):
    path = tmp_path / "x.csv"
    path.write_bytes(b"\xff\xfe\x00\x81binary")
    with pytest.raises(TraceError, match="not a CSV file"):
        read_dlrm(path)
