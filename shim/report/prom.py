"""The Prometheus side of the report: each :class:`Signal` as one PromQL query over the HTTP API.

It uses the documented ``/api/v1/query`` and ``/api/v1/query_range``
endpoints through httpx2 (the maintained httpx fork weft already depends on
through lightkube), with a bounded timeout on every request: a Prometheus
that is down, slow or answering errors becomes one :class:`PrometheusError`
that names the address, what failed and the flag to change.

Series names and labels are those a real cluster has: dcgm-exporter with its
Kubernetes pod mapping (``UUID``, ``gpu``, ``pod``, ``namespace``,
``container``), kube-state-metrics v2, cAdvisor through the kubelet (with a
``node`` label), and weft's broker and agent (``shim/broker/metrics.py``,
``shim/metrics.py``).
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Sequence
from typing import Any

import httpx2

from shim.report.errors import PrometheusError
from shim.report.model import CONTROLLERS, Series, Window, Workload
from shim.report.source import Signal
from shim.report.workload import ksm_label

OPT_IN_METRIC = "weft_sandbox_opted_in_timestamp_seconds"

_QUERIES = {
    Signal.LEASE_SHARE: "sum by (namespace, pod) (weft_gpu_lease_bytes{SEL} / on (UUID) group_left () "
                        "max by (UUID) (weft_gpu_device_memory_bytes))",
    Signal.LEASE_BYTES: "sum by (namespace, pod) (weft_gpu_lease_bytes{SEL})",
    Signal.PLUGIN_GPUS: "sum by (namespace, pod) "
                        '(kube_pod_container_resource_requests{SEL, resource="nvidia_com_gpu"}) '
                        '* on (namespace, pod) group_left () '
                        'max by (namespace, pod) (kube_pod_status_phase{SEL, phase="Running"})',
    Signal.DEVICE_MEMORY: "sum by (namespace, pod) (DCGM_FI_DEV_FB_USED{SEL} + DCGM_FI_DEV_FB_FREE{SEL}) * 1048576",
    Signal.GR_ENGINE_ACTIVE: "sum (max by (UUID) (DCGM_FI_PROF_GR_ENGINE_ACTIVE{SEL}))",
    Signal.GPU_UTIL: "sum (max by (UUID) (DCGM_FI_DEV_GPU_UTIL{SEL})) / 100",
    Signal.FB_USED: "sum (max by (UUID) (DCGM_FI_DEV_FB_USED{SEL})) * 1048576",
    Signal.CPU: 'sum by (node) (rate(container_cpu_usage_seconds_total{SEL, container!="", container!="POD"}[RATE]))',
    Signal.RESTARTS: "max by (namespace, pod, container) (kube_pod_container_status_restarts_total{SEL})",
    Signal.STARTED: "max by (namespace, pod, container) (kube_pod_container_state_started{SEL})",
    Signal.CREATED: "max by (namespace, pod) (kube_pod_created{SEL})",
    Signal.POD_NODE: "max by (namespace, pod, node) (kube_pod_info{SEL})",
    Signal.GPU_NODES: 'max by (node) (kube_node_status_capacity{resource="nvidia_com_gpu"})',
    Signal.NODE_TYPE: "max by (node, label_node_kubernetes_io_instance_type) (kube_node_labels)",
}


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _pod_selector(namespace: str, pods: Sequence[str]) -> str:
    # Pod names are DNS subdomains: only "." needs escaping in an RE2 alternation.
    return f"namespace={_quote(namespace)}, pod=~{_quote('|'.join(re.escape(p) for p in pods))}"


def _seconds(d: float) -> str:
    return f"{max(1, round(d))}s"


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

    def query(self, promql: str, at: float) -> list[dict]:
        return self._get("/api/v1/query", {"query": promql, "time": f"{at:.3f}"})["result"]

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[Series]:
        data = self._get("/api/v1/query_range", {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                 "step": f"{step:g}"})
        return [Series(r["metric"], tuple((float(t), float(v)) for t, v in r["values"])) for r in data["result"]]

    # -- Source ------------------------------------------------------------

    def pods(self, workload: Workload, start: float, end: float) -> list[str]:
        ns = f"namespace={_quote(workload.namespace)}"
        span = _seconds(end - start)
        if workload.kind == "deployment":
            rs = self.query(f"group by (replicaset) (last_over_time(kube_replicaset_owner{{{ns}, "
                            f'owner_kind="Deployment", owner_name={_quote(workload.name)}}}[{span}]))', end)
            owners = [r["metric"].get("replicaset", "") for r in rs]
            if not owners:
                return []
            owner = f'owner_kind="ReplicaSet", owner_name=~{_quote("|".join(re.escape(o) for o in owners))}'
        elif workload.kind:
            owner = f"owner_kind={_quote(CONTROLLERS[workload.kind])}, owner_name={_quote(workload.name)}"
        else:
            owner = ", ".join(f"{ksm_label(m.label)}{m.op}{_quote(m.value)}" for m in workload.selector)
        metric = "kube_pod_owner" if workload.kind else "kube_pod_labels"
        found = self.query(f"group by (pod) (last_over_time({metric}{{{ns}, {owner}}}[{span}]))", end)
        return sorted(r["metric"]["pod"] for r in found if r["metric"].get("pod"))

    def opt_in(self, namespace: str, pods: Sequence[str], start: float, end: float) -> float | None:
        found = self.query(f"min(min_over_time({OPT_IN_METRIC}{{{_pod_selector(namespace, pods)}}}"
                           f"[{_seconds(end - start)}]))", end)
        return float(found[0]["value"][1]) if found else None

    def scrape_interval(self, namespace: str, pods: Sequence[str], at: float) -> float | None:
        # Raw samples (a range selector at an instant) show the real spacing of scrapes.
        found = self.query(f"kube_pod_info{{{_pod_selector(namespace, pods)}}}[15m]", at)
        gaps = [float(b[0]) - float(a[0]) for r in found for a, b in itertools.pairwise(r["values"])]
        return statistics.median(gaps) if gaps else None

    def series(self, signal: Signal, namespace: str, pods: Sequence[str], window: Window,
               step: float) -> list[Series]:
        promql = _QUERIES[signal].replace("{SEL}", "{" + _pod_selector(namespace, pods) + "}").replace(
            "{SEL, ", "{" + _pod_selector(namespace, pods) + ", ").replace("[RATE]", f"[{_seconds(4 * step)}]")
        # A point stands for the step before it, so the first one is a step in.
        return self.query_range(promql, min(window.start + step, window.end), window.end, step)
