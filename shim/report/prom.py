"""The Prometheus side of the report: each :class:`Signal` as one PromQL query over the HTTP API.

It uses the documented ``/api/v1/query`` and ``/api/v1/query_range``
endpoints through httpx2 (the maintained httpx fork weft already depends on
through lightkube), with a bounded timeout on every request: a Prometheus
that is down, slow or answering errors becomes one :class:`PrometheusError`
that names the address, what failed and the flag to change.

Series names and labels are those a real cluster has: dcgm-exporter with its
Kubernetes pod mapping (``UUID``, ``pod``, ``namespace``, or their
``exported_`` forms), kube-state-metrics v2, cAdvisor through the kubelet
(with a ``node`` label), and weft's broker and agent
(``shim/broker/metrics.py``, ``shim/metrics.py``); ``docs/report.md`` lists
them, and a test holds that list to the queries here. Every time sent is
exact to the millisecond, Prometheus' resolution.
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Sequence
from typing import Any

import httpx2

from shim.report.compute import INSTANCE_TYPE_LABEL, REPLICAS_LABEL
from shim.report.errors import PrometheusError
from shim.report.model import CONTROLLERS, Grid, Series, Window, Workload, ms
from shim.report.source import Signal
from shim.report.workload import ksm_label

OPT_IN_METRIC = "weft_sandbox_opted_in_timestamp_seconds"
# The device plugin's resource, as kube-state-metrics spells it: whole GPUs, or
# time-sliced / MPS replicas where the plugin renames what it shares.
GPU_RESOURCES = "nvidia_com_gpu|nvidia_com_gpu_shared"


def _dcgm(field: str) -> str:
    """One DCGM field per device and pod, whichever way the scrape left the exporter's pod labels.

    Scraped with ``honor_labels: true`` they are ``namespace`` and ``pod``; where
    the target has labels of those names (a ServiceMonitor with the Helm chart's
    default ``honorLabels: false``) Prometheus keeps the exporter's as
    ``exported_namespace`` and ``exported_pod``. Both are read, and each series
    is keyed by the workload's pod either way.
    """
    exported = (f'label_replace(label_replace({field}{{XSEL}}, "namespace", "$1", "exported_namespace", "(.+)"), '
                '"pod", "$1", "exported_pod", "(.+)")')
    return f"(max by (UUID, namespace, pod) ({field}{{SEL}}) or max by (UUID, namespace, pod) ({exported}))"


_QUERIES = {
    Signal.LEASE_SHARE: "sum by (namespace, pod) (weft_gpu_lease_bytes{SEL} / on (UUID) group_left () "
                        "max by (UUID) (weft_gpu_device_memory_bytes))",
    Signal.LEASE_BYTES: "sum by (namespace, pod) (weft_gpu_lease_bytes{SEL})",
    Signal.PLUGIN_GPUS: "sum by (namespace, pod) "
                        f'(kube_pod_container_resource_requests{{SEL, resource=~"{GPU_RESOURCES}"}}) '
                        '* on (namespace, pod) group_left () '
                        'max by (namespace, pod) (kube_pod_status_phase{SEL, phase="Running"})',
    Signal.DEVICE_MEMORY: f"sum by (namespace, pod) ({_dcgm('DCGM_FI_DEV_FB_USED')} + "
                          f"{_dcgm('DCGM_FI_DEV_FB_FREE')}) * 1048576",
    Signal.GR_ENGINE_ACTIVE: f"sum (max by (UUID) ({_dcgm('DCGM_FI_PROF_GR_ENGINE_ACTIVE')}))",
    Signal.GPU_UTIL: f"sum (max by (UUID) ({_dcgm('DCGM_FI_DEV_GPU_UTIL')})) / 100",
    Signal.FB_USED: f"sum (max by (UUID) ({_dcgm('DCGM_FI_DEV_FB_USED')})) * 1048576",
    Signal.CPU: 'sum by (node) (rate(container_cpu_usage_seconds_total{SEL, container!="", container!="POD"}[RATE]))',
    Signal.RESTARTS: "max by (namespace, pod, container) (kube_pod_container_status_restarts_total{SEL})",
    Signal.STARTED: "max by (namespace, pod, container) (kube_pod_container_state_started{SEL})",
    Signal.LAST_TERMINATED: "max by (namespace, pod, container) "
                            "(kube_pod_container_status_last_terminated_timestamp{SEL})",
    Signal.CREATED: "max by (namespace, pod) (kube_pod_created{SEL})",
    Signal.POD_NODE: "max by (namespace, pod, node) (kube_pod_info{SEL})",
    Signal.GPU_NODES: f'sum by (node) (kube_node_status_capacity{{resource=~"{GPU_RESOURCES}"}})',
    Signal.NODE_LABELS: f"max by (node, {INSTANCE_TYPE_LABEL}, {REPLICAS_LABEL}) (kube_node_labels)",
}


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _alternation(names: Sequence[str]) -> str:
    # Pod names are DNS subdomains: only "." needs escaping in an RE2 alternation.
    return _quote("|".join(re.escape(n) for n in names))


def _pod_selector(namespace: str, pods: Sequence[str], prefix: str = "") -> str:
    return f"{prefix}namespace={_quote(namespace)}, {prefix}pod=~{_alternation(pods)}"


def _at(t_ms: int) -> str:
    """Unix seconds to the millisecond, written exactly (a float's %.3f may round the other way)."""
    return f"{t_ms // 1000}.{t_ms % 1000:03d}"


def _duration(seconds: float) -> str:
    return f"{max(1, ms(seconds))}ms"


def promql(signal: Signal, namespace: str, pods: Sequence[str], step: float) -> str:
    """The query for ``signal`` over the pods, at ``step``."""
    return (_QUERIES[signal].replace("{SEL}", "{" + _pod_selector(namespace, pods) + "}")
            .replace("{SEL, ", "{" + _pod_selector(namespace, pods) + ", ")
            .replace("{XSEL}", "{" + _pod_selector(namespace, pods, "exported_") + "}")
            .replace("[RATE]", f"[{_duration(4 * step)}]"))


class PrometheusSource:
    """A :class:`~shim.report.source.Source` over Prometheus' HTTP API."""

    def __init__(self, address: str, timeout: float = 10.0, transport: httpx2.BaseTransport | None = None) -> None:
        if not re.match(r"https?://", address):
            address = "http://" + address
        self.address = address.rstrip("/")
        self.timeout = timeout
        self._client = httpx2.Client(base_url=self.address, timeout=httpx2.Timeout(timeout), transport=transport)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> PrometheusSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- HTTP --------------------------------------------------------------

    def _get(self, path: str, params: dict[str, str]) -> Any:
        try:
            r = self._client.post(path, data=params)  # POST: a long pod alternation would not fit a URL
        except httpx2.TimeoutException as exc:
            raise PrometheusError(f"Prometheus at {self.address} did not answer within {self.timeout:g} s; check "
                                  "that it is healthy, or raise --timeout / report.timeout") from exc
        except httpx2.TransportError as exc:
            raise PrometheusError(f"cannot reach Prometheus at {self.address}: {exc}; check --prometheus / "
                                  "report.prometheus") from exc
        try:
            body = r.json()
        except ValueError:
            raise PrometheusError(f"Prometheus at {self.address} answered {path} with HTTP {r.status_code} and no "
                                  "JSON: is that address a Prometheus server? (--prometheus)") from None
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus at {self.address} refused a query ({body.get('errorType', '?')}: "
                                  f"{body.get('error', r.status_code)})")
        return body["data"]

    def query(self, query: str, at: float) -> list[dict]:
        return self._get("/api/v1/query", {"query": query, "time": _at(ms(at))})["result"]

    def query_range(self, query: str, grid: Grid) -> list[Series]:
        data = self._get("/api/v1/query_range", {"query": query, "start": _at(grid.first_ms),
                                                 "end": _at(grid.end_ms), "step": _at(grid.step_ms)})
        return [Series(r["metric"], tuple((float(t), float(v)) for t, v in r["values"])) for r in data["result"]]

    # -- Source ------------------------------------------------------------

    def pods(self, workload: Workload, start: float, end: float) -> list[str]:
        ns = f"namespace={_quote(workload.namespace)}"
        span = _duration(end - start)
        if workload.kind == "deployment":
            rs = self.query(f"group by (replicaset) (last_over_time(kube_replicaset_owner{{{ns}, "
                            f'owner_kind="Deployment", owner_name={_quote(workload.name)}}}[{span}]))', end)
            owners = [r["metric"].get("replicaset", "") for r in rs]
            if not owners:
                return []
            owner = f'owner_kind="ReplicaSet", owner_name=~{_alternation(owners)}'
        elif workload.kind:
            owner = f"owner_kind={_quote(CONTROLLERS[workload.kind])}, owner_name={_quote(workload.name)}"
        else:
            owner = ", ".join(f"{ksm_label(m.label)}{m.op}{_quote(m.value)}" for m in workload.selector)
        metric = "kube_pod_owner" if workload.kind else "kube_pod_labels"
        found = self.query(f"group by (pod) (last_over_time({metric}{{{ns}, {owner}}}[{span}]))", end)
        return sorted(r["metric"]["pod"] for r in found if r["metric"].get("pod"))

    def opt_in(self, namespace: str, pods: Sequence[str], start: float, end: float) -> float | None:
        found = self.query(f"min(min_over_time({OPT_IN_METRIC}{{{_pod_selector(namespace, pods)}}}"
                           f"[{_duration(end - start)}]))", end)
        return float(found[0]["value"][1]) if found else None

    def scrape_interval(self, namespace: str, pods: Sequence[str], at: float) -> float | None:
        # Raw samples (a range selector at an instant) show the real spacing of scrapes.
        found = self.query(f"kube_pod_info{{{_pod_selector(namespace, pods)}}}[15m]", at)
        gaps = [float(b[0]) - float(a[0]) for r in found for a, b in itertools.pairwise(r["values"])]
        return statistics.median(gaps) if gaps else None

    def series(self, signal: Signal, namespace: str, pods: Sequence[str], window: Window,
               step: float) -> list[Series]:
        return self.query_range(promql(signal, namespace, pods, step), Grid.of(window, step))
