"""The Grafana dashboard and the recording rules, evaluated by promtool against a recorded metrics snapshot.

The snapshot is ten minutes of scrapes, one a minute, of two sources:

- weft's own metric code (``shim.broker.metrics.BrokerMetrics`` and
  ``shim.metrics.Metrics``) driven through a scenario on one node, so a metric
  or label renamed in weft breaks these tests rather than the dashboard;
- dcgm-exporter's scrape of the same devices (``fixtures/dcgm-exporter.prom``,
  parsed with prometheus_client's exposition parser).

The scenario, on node-a: ml/trainer holds GPU-aaaa whole and keeps it 75%
busy; serve/server and ml/notebook share GPU-bbbb (20 GiB each), the server
25% busy, the notebook idle; GPU-dddd has no lease. node-b's GPU-cccc runs a
pod without weft.

``promtool test rules`` checks each recording rule's values at minute 10, and
every query of the dashboard, turned into an alerting rule, for the exact set
of series it returns.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from shim.broker.metrics import BrokerMetrics
from shim.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "nodeimage" / "prometheus" / "weft-rules.yaml"
DASHBOARD = ROOT / "nodeimage" / "dashboards" / "weft-gpu.json"
DCGM = Path(__file__).parent / "fixtures" / "dcgm-exporter.prom"

GIB = 1 << 30
MINUTES = 10
WEFT_TARGET = {"job": "weft-broker", "instance": "node-a:9465"}


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is not installed: apt-get install prometheus (scripts/setup.sh installs it)"
    return path


# --- the snapshot -------------------------------------------------------------------


class _Device:
    def __init__(self, index: int, uuid: str) -> None:
        self.index, self.uuid, self.memory_total, self.leasable = index, uuid, 80 * GIB, True


class _Lease:
    def __init__(self, lease_id, namespace, pod, container, uuid, index, memory, shared) -> None:
        self.lease_id, self.namespace, self.pod, self.container = lease_id, namespace, pod, container
        self.device_uuids, self.device_indices = (uuid,), (index,)
        self.memory_bytes, self.shared = memory, shared


class _Service:
    """The part of the broker's LeaseService the metrics read."""

    def __init__(self) -> None:
        self.devices = [_Device(0, "GPU-aaaa"), _Device(1, "GPU-bbbb"), _Device(2, "GPU-dddd")]
        self._leases = [
            _Lease("l-trainer", "ml", "trainer", "model", "GPU-aaaa", 0, 80 * GIB, False),
            _Lease("l-server", "serve", "server", "server", "GPU-bbbb", 1, 20 * GIB, True),
            _Lease("l-notebook", "ml", "notebook", "lab", "GPU-bbbb", 1, 20 * GIB, True),
        ]

    def leases(self):
        return list(self._leases)

    def mps_pool(self) -> dict[str, int]:
        return {"GPU-bbbb": 1}


def _series_key(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def recorded_snapshot() -> dict[str, list[float | None]]:
    """series -> value at each minute 0..10 (None: not exported yet)."""
    service = _Service()
    broker = BrokerMetrics(service)
    agent = Metrics()
    series: dict[str, list[float | None]] = {}

    def scrape(minute: int) -> None:
        for registry in (broker.registry, agent.registry):
            for family in registry.collect():
                for s in family.samples:
                    if s.name.endswith("_created"):
                        continue
                    key = _series_key(s.name, {**s.labels, **WEFT_TARGET})
                    series.setdefault(key, [None] * (MINUTES + 1))[minute] = s.value
        for family in text_string_to_metric_families(DCGM.read_text()):
            for s in family.samples:
                labels = {**s.labels, "job": "dcgm-exporter", "instance": f"{s.labels['Hostname']}:9400"}
                series.setdefault(_series_key(s.name, labels), [None] * (MINUTES + 1))[minute] = s.value

    scrape(0)
    for minute in range(1, MINUTES + 1):
        # What the watchdog does every tick, here once a minute.
        broker.account(service.leases(), service.devices, {"GPU-aaaa": 75, "GPU-bbbb": 25}, 60.0,
                       {"l-trainer": 75, "l-server": 25})
        agent.placements.labels("gpu", "local", "gpu-leased").inc(3)
        agent.placements.labels("cpu", "local", "no-mesh").inc()
        if minute == 3:
            broker.violations.labels("GPU-bbbb", "notebook", "ml", "lab", "log").inc()
        scrape(minute)
    return series


def _input_series(snapshot: dict[str, list[float | None]]) -> list[dict]:
    return [{"series": key, "values": " ".join("_" if v is None else repr(float(v)) for v in values)}
            for key, values in sorted(snapshot.items())]


def _run_promtool(tmp_path: Path, rule_files: list[Path], tests: list[dict]) -> None:
    doc = {"rule_files": [str(p) for p in rule_files], "evaluation_interval": "30s",
           "tests": [{"interval": "1m", "input_series": _input_series(recorded_snapshot()), **t} for t in tests]}
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    res = subprocess.run([_promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"promtool test rules failed:\n{res.stdout}\n{res.stderr}"


# --- the recording rules --------------------------------------------------------------

ML_TRAINER = {"namespace": "ml", "pod": "trainer"}
ML_NOTEBOOK = {"namespace": "ml", "pod": "notebook"}
SERVE_SERVER = {"namespace": "serve", "pod": "server"}

RULE_EXPECTATIONS = {
    # GPUs held and kept busy, per workload: the notebook holds a GPU and leaves it idle.
    "namespace_pod:weft_gpu_held:rate5m": [(ML_TRAINER, 1), (ML_NOTEBOOK, 1), (SERVE_SERVER, 1)],
    "namespace_pod:weft_gpu_active:rate5m": [(ML_TRAINER, 0.75), (ML_NOTEBOOK, 0), (SERVE_SERVER, 0.25)],
    "namespace_pod:weft_gpu_active_per_held:ratio5m": [(ML_TRAINER, 0.75), (ML_NOTEBOOK, 0), (SERVE_SERVER, 0.25)],
    "namespace_pod:weft_gpu_held_idle:rate5m": [(ML_TRAINER, 0.25), (ML_NOTEBOOK, 1), (SERVE_SERVER, 0.75)],
    # DCGM's view of the devices they hold, joined on UUID: the notebook's device is 50% active (the server).
    "namespace_pod:dcgm_gr_engine_active_while_held:rate5m": [
        (ML_TRAINER, 0.75), (ML_NOTEBOOK, 0.5), (SERVE_SERVER, 0.5)],
    "UUID:weft_gpu_held:rate5m": [({"UUID": "GPU-aaaa", "gpu": "0"}, 1), ({"UUID": "GPU-bbbb", "gpu": "1"}, 1)],
    "UUID:weft_gpu_active:rate5m": [({"UUID": "GPU-aaaa", "gpu": "0"}, 0.75), ({"UUID": "GPU-bbbb", "gpu": "1"}, 0.25)],
    "UUID:dcgm_gpu_util:ratio_avg5m": [
        ({"UUID": "GPU-aaaa", "gpu": "0"}, 0.75), ({"UUID": "GPU-bbbb", "gpu": "1"}, 0.5),
        ({"UUID": "GPU-cccc", "gpu": "0"}, 1), ({"UUID": "GPU-dddd", "gpu": "2"}, 0)],
    "UUID:weft_gpu_lease_bytes:ratio": [
        ({"UUID": "GPU-aaaa", "gpu": "0"}, 1), ({"UUID": "GPU-bbbb", "gpu": "1"}, 0.5),
        ({"UUID": "GPU-dddd", "gpu": "2"}, 0)],
}


def _labels(metric: str, labels: dict[str, str]) -> str:
    return _series_key(metric, labels)


def test_every_recording_rule_has_an_expectation():
    rules = [r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert sorted(rules) == sorted(RULE_EXPECTATIONS)


def test_recording_rules_give_gpu_held_vs_active_per_workload_and_dcgm_beside_it(tmp_path):
    tests = [{"promql_expr_test": [
        {"expr": record, "eval_time": f"{MINUTES}m",
         "exp_samples": [{"labels": _labels(record, labels), "value": value} for labels, value in expected]}
        for record, expected in RULE_EXPECTATIONS.items()]}]
    _run_promtool(tmp_path, [RULES], tests)


# --- the dashboard --------------------------------------------------------------------

NODE_A_WEFT = {"job": "weft-broker", "instance": "node-a:9465"}
WORKLOADS = [ML_TRAINER, ML_NOTEBOOK, SERVE_SERVER]
DEVICES_LEASED = [{"UUID": "GPU-aaaa", "gpu": "0"}, {"UUID": "GPU-bbbb", "gpu": "1"}]
DEVICES_WEFT = [*DEVICES_LEASED, {"UUID": "GPU-dddd", "gpu": "2"}]
DEVICES_DCGM = [*DEVICES_WEFT, {"UUID": "GPU-cccc", "gpu": "0"}]

# (panel title, refId) -> the label sets the query returns on the snapshot.
DASHBOARD_EXPECTATIONS: dict[tuple[str, str], list[dict[str, str]]] = {
    ("GPUs held vs active, per workload", "A"): WORKLOADS,
    ("GPUs held vs active, per workload", "B"): WORKLOADS,
    ("Active per held GPU, per workload", "A"): WORKLOADS,
    ("Held but idle GPUs, per workload", "A"): WORKLOADS,
    ("DCGM engine activity while held, per workload", "A"): WORKLOADS,
    ("DCGM engine activity while held, per workload", "B"): WORKLOADS,
    # Joined on pod: DCGM attributes GPU-bbbb to the server only; batch/other holds no weft lease.
    ("DCGM GPU utilisation of weft workloads (by pod)", "A"): [ML_TRAINER, SERVE_SERVER],
    ("Per device: weft held and active vs DCGM", "A"): DEVICES_LEASED,
    ("Per device: weft held and active vs DCGM", "B"): DEVICES_LEASED,
    ("Per device: weft held and active vs DCGM", "C"): DEVICES_DCGM,
    ("Per device: weft held and active vs DCGM", "D"): DEVICES_DCGM,
    ("Leased memory per device", "A"): DEVICES_WEFT,
    ("Leases per device", "A"): DEVICES_WEFT,
    ("Lease memory by workload", "A"): [
        {**ML_TRAINER, "container": "model", "UUID": "GPU-aaaa"},
        {**SERVE_SERVER, "container": "server", "UUID": "GPU-bbbb"},
        {**ML_NOTEBOOK, "container": "lab", "UUID": "GPU-bbbb"}],
    ("Placements", "A"): [{"stage": "gpu", "placement": "local", "reason": "gpu-leased"},
                          {"stage": "cpu", "placement": "local", "reason": "no-mesh"}],
    ("Lease violations", "A"): [{**ML_NOTEBOOK, "container": "lab", "action": "log"}],
}


def _dashboard_targets() -> dict[tuple[str, str], str]:
    doc = json.loads(DASHBOARD.read_text())
    return {(p["title"], t["refId"]): t["expr"] for p in doc["panels"] for t in p.get("targets", [])}


def test_every_dashboard_query_has_an_expectation():
    assert sorted(_dashboard_targets()) == sorted(DASHBOARD_EXPECTATIONS)


def test_dashboard_uses_only_series_that_weft_and_dcgm_export_or_the_rules_record():
    """Every metric name in a query is in the snapshot (weft's real metrics, DCGM's) or recorded by the rules."""
    import re

    known = {k.split("{", 1)[0] for k in recorded_snapshot()}
    known |= set(RULE_EXPECTATIONS)
    functions = {"sum", "avg", "max", "rate", "increase", "avg_over_time", "sort_desc", "by", "on", "and",
                 "group_left", "or"}
    for (title, ref), expr in _dashboard_targets().items():
        without_labels = re.sub(r"\{[^}]*\}|\([^()]*\)\s*(?=\()|\[[^\]]*\]|\"[^\"]*\"", " ", expr)
        names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", without_labels)) - functions
        names -= {"namespace", "pod", "UUID", "gpu", "stage", "placement", "reason", "container", "action"}
        assert names <= known, f"{title} {ref}: unknown series {sorted(names - known)}"
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE"} <= {
        n for e in _dashboard_targets().values() for n in re.findall(r"DCGM_FI_\w+", e)} | {
        n for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
        for n in re.findall(r"DCGM_FI_\w+", r["expr"])}


def test_every_dashboard_query_parses_and_returns_the_expected_series(tmp_path):
    targets = _dashboard_targets()
    names = {key: f"dashboard_q{i}" for i, key in enumerate(sorted(targets))}
    alerts = tmp_path / "dashboard-queries.yaml"
    alerts.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"alert": names[key], "expr": targets[key]} for key in sorted(targets)]}]}))
    tests = [{"alert_rule_test": [
        {"alertname": names[key], "eval_time": f"{MINUTES}m",
         "exp_alerts": [{"exp_labels": labels} for labels in DASHBOARD_EXPECTATIONS[key]]}
        for key in sorted(targets)]}]
    _run_promtool(tmp_path, [RULES, alerts], tests)


def test_dashboard_is_grafana_json_on_a_prometheus_datasource_variable():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["title"] and doc["schemaVersion"] >= 36
    (var,) = [v for v in doc["templating"]["list"] if v["type"] == "datasource"]
    assert var["query"] == "prometheus"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        assert p["datasource"]["uid"] == "${" + var["name"] + "}"
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])


@pytest.mark.parametrize("broken", ["sum by (UUID (weft_gpu_leases)", "rate(weft_gpu_held_seconds_total)"],
                         ids=["unbalanced", "rate-of-instant-vector"])
def test_a_broken_query_fails_the_check(tmp_path, broken):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [{"alert": "q", "expr": broken}]}]}))
    res = subprocess.run([_promtool(), "check", "rules", str(bad)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
