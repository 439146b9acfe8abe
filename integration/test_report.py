"""``weft report`` against a real Prometheus holding recorded dcgm-exporter, kube-state-metrics, cAdvisor and weft data.

One server for the module (backfilled from ``tests/data/report/``, stopped and
removed afterwards even when a test fails); each test runs the command as a
user would and asserts on what it prints. The recorded workloads opted in at
2025-03-03T12:00:00Z and have three hours of history either side, so every
report is taken ``--now`` just after.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.prometheus import PrometheusServer
from shim.cli import main

NOW = "2025-03-03T15:05:00Z"
PRICES = ["--price", "p5.48xlarge=6.88,0.04", "--price", "c7i.16xlarge=0,0.05"]


@pytest.fixture(scope="module")
def prom() -> Iterator[PrometheusServer]:
    with PrometheusServer() as p:
        yield p


def report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["report", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_workload_whose_utilisation_rose_is_kept(prom: PrometheusServer, capsys, tmp_path: Path) -> None:
    png = tmp_path / "trainer.png"
    code, out, _ = report(capsys, "deployment/trainer", "-n", "vision", "--prometheus", prom.url, "--now", NOW,
                          *PRICES, "--json", "--plot", str(png))
    assert code == 0
    doc = json.loads(out)
    assert doc["windows_from"] == "weft metrics"
    assert doc["opt_in"] == "2025-03-03T12:00:00Z"
    assert doc["active_metric"] == "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
    b, a = doc["before"], doc["after"]
    assert b["held_from"] == ["device plugin"] and "weft leases" in a["held_from"]
    assert b["active_over_held"] == pytest.approx(0.09, rel=0.02)
    assert a["active_over_held"] > 3 * b["active_over_held"]
    assert a["gpu_seconds_held"] < 0.6 * b["gpu_seconds_held"]  # two 20 GiB leases instead of a whole GPU
    assert a["cpu_seconds_hosts"] > 0 and b["cpu_seconds_hosts"] == 0  # the decode stage moved to a CPU node
    assert a["costs"]["gpu_idle"] < b["costs"]["gpu_idle"]
    assert b["restarts"] == 1 and a["restarts"] == 0
    assert b["p95_container_start_s"] == 14 and a["p95_container_start_s"] == 22
    assert doc["verdict"]["outcome"] == "kept"
    assert "runtimeClassName" in doc["backout"] and "patch deployment trainer" in doc["backout"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_workload_whose_utilisation_did_not_rise_is_no_change(prom: PrometheusServer, capsys) -> None:
    code, out, _ = report(capsys, "app=ranker", "-n", "search", "--prometheus", prom.url, "--now", NOW, *PRICES,
                          "--markdown")
    assert code == 0
    assert "**Verdict: no change** (within-margin)" in out
    assert "| GPU-active / held | 30.0% | 30.9% |" in out
    assert "To back out: remove `runtimeClassName: weft`" in out


def test_missing_dcgm_series_say_so_and_invent_no_verdict(prom: PrometheusServer, capsys) -> None:
    code, out, _ = report(capsys, "deployment/asr", "-n", "speech", "--prometheus", prom.url, "--now", NOW, *PRICES)
    assert code == 0
    assert "verdict: no verdict (no-dcgm)" in out
    assert "no DCGM activity series for the pods in the before and after window" in out
    assert "DCGM_EXPORTER_KUBERNETES=true" in out
    assert "kept" not in out.split("rule:")[0]


def test_no_opt_in_record_asks_for_windows_and_flags_give_them(prom: PrometheusServer, capsys) -> None:
    code, _, err = report(capsys, "deployment/scorer", "-n", "ads", "--prometheus", prom.url, "--now", NOW)
    assert code == 2
    assert err.startswith("weft report: no record of when ads/deployment/scorer opted in")
    assert "--before START..END --after START..END" in err
    code, out, _ = report(capsys, "deployment/scorer", "-n", "ads", "--prometheus", prom.url, "--now", NOW,
                          "--before", "2025-03-03T09:00:00Z..2025-03-03T12:00:00Z",
                          "--after", "2025-03-03T12:00:00Z..2025-03-03T15:00:00Z", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["windows_from"] == "flags" and doc["verdict"]["outcome"] == "kept"
    assert doc["before"]["costs"] is None  # no prices given: left out, not invented


def test_an_unknown_workload_names_what_to_check(prom: PrometheusServer, capsys) -> None:
    code, _, err = report(capsys, "deployment/nope", "-n", "vision", "--prometheus", prom.url, "--now", NOW)
    assert code == 2
    assert "no pods of vision/deployment/nope" in err and "--namespace" in err


def test_a_window_shorter_than_the_scrape_interval_is_refused(prom: PrometheusServer, capsys) -> None:
    code, _, err = report(capsys, "deployment/trainer", "-n", "vision", "--prometheus", prom.url, "--now", NOW,
                          "--before", "2025-03-03T11:00:00Z..2025-03-03T11:00:10Z",
                          "--after", "2025-03-03T12:00:00Z..2025-03-03T15:00:00Z")
    assert code == 2
    assert "--before: the before window is 10s, shorter than the scrape interval (30s)" in err


def test_too_little_data_gives_no_verdict_and_says_how_much_it_needs(prom: PrometheusServer, capsys) -> None:
    code, out, _ = report(capsys, "deployment/trainer", "-n", "vision", "--prometheus", prom.url, "--now", NOW,
                          "--before", "2025-03-03T11:55:00Z..2025-03-03T12:00:00Z",
                          "--after", "2025-03-03T12:00:00Z..2025-03-03T15:00:00Z")
    assert code == 0
    assert "verdict: no verdict (too-little-data)" in out
    assert "a verdict needs 30 (15min)" in out


def test_a_prometheus_that_is_down_is_a_clear_error(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code, _, err = report(capsys, "deployment/trainer", "-n", "vision", "--prometheus", f"http://127.0.0.1:{port}")
    assert code == 2
    assert err.startswith(f"weft report: cannot reach Prometheus at http://127.0.0.1:{port}")


def test_a_prometheus_that_is_slow_times_out_with_a_clear_error(capsys) -> None:
    # A server that accepts and never answers: the report must give up after --timeout, not hang.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        code, _, err = report(capsys, "deployment/trainer", "-n", "vision", "--prometheus", url, "--timeout", "0.5")
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        server.close()
    assert code == 2
    assert f"Prometheus at {url} did not answer within 0.5 s" in err and "--timeout" in err
