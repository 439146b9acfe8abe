"""``docs/report.md`` is the contract of ``weft report``: held to the queries it sends and to what it prints.

The report runs against a Prometheus stand-in (httpx's mock transport) that
records each PromQL query, once for each kind of workload; the series and the
labels those queries name must be the rows of the page's table, no more and no
fewer. The JSON fields, the verdict's reasons and the exit statuses are held
to the code the same way, so what a user reads cannot drift from it.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections import defaultdict
from pathlib import Path

import httpx2

from shim.report import render
from shim.report.build import Request, build
from shim.report.cli import EXIT_ERROR, EXIT_NO_VERDICT, EXIT_VERDICT
from shim.report.model import Matcher, Prices, Workload
from shim.report.prom import OPT_IN_METRIC, PrometheusSource
from shim.report.source import FakeSource
from shim.report.verdict import Reason

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "report.md"
NOW = 1_741_014_300.0
_KEYWORDS = {"by", "on", "without", "ignoring", "group_left", "group_right", "or", "and", "unless", "bool", "offset"}
_GROUPING = re.compile(r"\b(?:by|on|without|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def _answer(request: httpx2.Request, sent: list[str]) -> httpx2.Response:
    """Just enough of Prometheus' answers for the report to ask everything it can."""
    query = dict(urllib.parse.parse_qsl(request.content.decode()))["query"]
    sent.append(query)
    if request.url.path.endswith("/query_range"):
        return httpx2.Response(200, json={"status": "success", "data": {"resultType": "matrix", "result": []}})
    result: list[dict] = []
    if "kube_replicaset_owner" in query:
        result = [{"metric": {"replicaset": "w-5d6c"}, "value": [NOW, "1"]}]
    elif "kube_pod_owner" in query or "kube_pod_labels" in query:
        result = [{"metric": {"pod": "w-5d6c-x1"}, "value": [NOW, "1"]}]
    elif OPT_IN_METRIC in query:
        result = [{"metric": {}, "value": [NOW, str(NOW - 3 * 3600)]}]
    elif "[15m]" in query:
        result = [{"metric": {}, "values": [[NOW - 60, "1"], [NOW - 30, "1"]]}]
    return httpx2.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": result}})


def sent_queries() -> list[str]:
    sent: list[str] = []
    transport = httpx2.MockTransport(lambda r: _answer(r, sent))
    for workload in (Workload("ns", "deployment", "w"), Workload("ns", "statefulset", "w"),
                     Workload("ns", selector=(Matcher("app", "=", "w"),))):
        with PrometheusSource("http://prometheus:9090", transport=transport) as source:
            build(source, Request(workload=workload, now=NOW), Prices())
    return sent


def read(query: str) -> tuple[dict[str, set[str]], set[str]]:
    """The series a query names with the labels it matches on each, and the labels it groups or joins by."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', query)  # label values and regexes say nothing here
    series: dict[str, set[str]] = defaultdict(set)
    for name, matchers in re.findall(r"([A-Za-z_:][\w:]*)\{([^}]*)\}", text):
        series[name] |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    grouping = {label.strip() for g in _GROUPING.findall(text) for label in g.split(",") if label.strip()}
    bare = re.sub(r"\[[^\]]*\]", "", _GROUPING.sub(" ", re.sub(r"\{[^}]*\}", "", text)))
    for name in re.findall(r"\b([A-Za-z_:][\w:]*)\b(?!\s*\()", bare):
        if name not in _KEYWORDS:
            series[name] |= set()
    return series, grouping


def section(heading: str) -> str:
    return PAGE.read_text().split(f"{heading}\n", 1)[1].split("\n#", 1)[0]


def rows(text: str) -> list[list[str]]:
    """Table rows whose first cell names something in backticks, as stripped cells."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| `")]


def documented() -> dict[str, set[str]]:
    """The page's table of series: first cell the series, third the labels read."""
    return {re.findall(r"`([^`]+)`", row[0])[0]: set(re.findall(r"`([^`]+)`", row[2]))
            for row in rows(section("## Series the report reads"))}


def _named(label: str, labels: set[str]) -> bool:
    # kube_pod_labels carries one label_<name> per pod label the selector names.
    return label in labels or (label.startswith("label_") and "label_<name>" in labels)


def test_the_page_lists_exactly_the_series_the_queries_name() -> None:
    names = {name for q in sent_queries() for name in read(q)[0]}
    assert set(documented()) == names


def test_every_label_a_query_reads_is_on_the_page_and_every_label_there_is_read() -> None:
    doc = documented()
    read_on: dict[str, set[str]] = defaultdict(set)
    for q in sent_queries():
        series, grouping = read(q)
        for name, matched in series.items():
            missing = {label for label in matched if not _named(label, doc[name])}
            assert not missing, f"{name}: {sorted(missing)} not on the page (query {q})"
            read_on[name] |= matched | (grouping & doc[name])
        undocumented = {g for g in grouping if not any(_named(g, doc[name]) for name in series)}
        assert not undocumented, f"{sorted(undocumented)} grouped by, but on no row of {sorted(series)}"
    for name, labels in doc.items():
        unread = {label for label in labels if label != "label_<name>" and label not in read_on[name]}
        assert not unread, f"{name}: the page lists {sorted(unread)}, which no query reads"


def test_the_page_lists_every_json_field() -> None:
    rep = build(FakeSource(workload_pods=["w-5d6c-x1"], opt_in_at=NOW - 3 * 3600),
                Request(workload=Workload("ns", "deployment", "w"), now=NOW), Prices())
    doc = json.loads(render.as_json(rep))
    top, window = section("### JSON fields").split("Each window:")
    named = [{name for row in rows(part) for name in re.findall(r"`([^`]+)`", row[0])} for part in (top, window)]
    assert named == [set(doc), set(doc["before"])]


def test_the_page_names_every_reason_and_exit_status() -> None:
    assert set(re.findall(r"`([a-z-]+)`", section("## The verdict"))) >= {r.value for r in Reason}
    statuses = {int(row[0].strip("`")) for row in rows(section("## Exit status"))}
    assert statuses == {EXIT_VERDICT, EXIT_ERROR, EXIT_NO_VERDICT}
