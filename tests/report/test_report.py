"""Unit tests of weft report's pure layers, through the in-package FakeSource (no server)."""

from __future__ import annotations

import httpx2
import pytest

from shim import config
from shim.errors import ConfigError
from shim.metrics import Metrics
from shim.report import render
from shim.report.build import Request, build
from shim.report.errors import NoOptInRecord, PrometheusError, UnknownWorkload, UsageError
from shim.report.model import Grid, Price, Prices, Series, Window, Workload
from shim.report.prom import PrometheusSource
from shim.report.source import FakeSource, Signal
from shim.report.verdict import Outcome, Reason
from shim.report.windows import from_flags, parse_duration
from shim.report.workload import parse

T0 = 1_741_003_200.0
NOW = T0 + 3 * 3600
PRICES = Prices({"p5": Price(gpu_hour=6.0, vcpu_hour=0.05)}, default_type="p5")


def flat(labels: dict, start: float, end: float, value: float, step: float = 30.0) -> Series:
    n = int((end - start) // step)
    return Series(labels, tuple((start + step * (i + 1), value) for i in range(n)))


def source(active_before: float, active_after: float, *, dcgm: bool = True, restarts_after: float = 0.0,
           opt_in: float | None = T0) -> FakeSource:
    b, a = {"pod": "w-old", "namespace": "ns"}, {"pod": "w-new", "namespace": "ns"}
    data = {
        Signal.PLUGIN_GPUS: [flat(b, T0 - 10800, T0, 1.0), flat(a, T0, NOW, 1.0)],
        Signal.LEASE_SHARE: [flat(a, T0, NOW, 0.5)],
        Signal.POD_NODE: [flat({**b, "node": "g1"}, T0 - 10800, T0, 1), flat({**a, "node": "g1"}, T0, NOW, 1)],
        Signal.RESTARTS: [Series({**a, "container": "m"}, ((T0 + 30, 0.0), (T0 + 3600, restarts_after)))],
    }
    if dcgm:
        data[Signal.GR_ENGINE_ACTIVE] = [flat({}, T0 - 10800, T0, active_before), flat({}, T0, NOW, active_after)]
    return FakeSource(workload_pods=["w-new", "w-old"], opt_in_at=opt_in, data=data)


def run(src: FakeSource, **kw) -> object:
    return build(src, Request(workload=Workload("ns", "deployment", "w"), now=NOW, **kw), PRICES)


@pytest.mark.parametrize(("before", "after", "outcome", "reason"), [
    (0.1, 0.2, Outcome.KEPT, Reason.UTILISATION_ROSE),  # 10 % of a GPU, then 20 % busy on half a GPU
    (0.2, 0.1, Outcome.NO_CHANGE, Reason.WITHIN_MARGIN),  # same 20 % ratio
    (0.2, 0.05, Outcome.WORSE, Reason.UTILISATION_FELL),
], ids=["utilisation-rose-kept", "same-ratio-no-change", "utilisation-fell-worse"])
def test_the_verdict_follows_the_ratio_of_active_to_held(before, after, outcome, reason) -> None:
    rep = run(source(before, after))
    assert (rep.verdict.outcome, rep.verdict.reason) == (outcome, reason)
    assert rep.windows.source == "weft metrics"
    assert rep.before.held_gpu_s == pytest.approx(10800) and rep.after.held_gpu_s == pytest.approx(5400)
    assert rep.after.held_from == ("weft leases",)  # the lease wins over the device plugin's whole GPU
    assert rep.before.costs.held == pytest.approx(18.0) and rep.after.costs.held == pytest.approx(9.0)


def test_restarts_that_rose_make_it_worse_even_when_utilisation_rose() -> None:
    rep = run(source(0.1, 0.3, restarts_after=3))
    assert rep.verdict.outcome is Outcome.WORSE and rep.verdict.reason is Reason.RESTARTS_ROSE


def test_without_dcgm_there_is_no_verdict_and_a_note_says_what_to_turn_on() -> None:
    rep = run(source(0.1, 0.3, dcgm=False))
    assert rep.verdict.outcome is Outcome.NONE and rep.verdict.reason is Reason.NO_DCGM
    assert "no verdict" in render.table(rep) and "DCGM_EXPORTER_KUBERNETES=true" in render.table(rep)


def test_too_little_data_says_how_much_it_would_need() -> None:
    rep = run(source(0.1, 0.3), before=f"{T0 - 600}..{T0}", after=f"{T0}..{NOW}")
    assert rep.verdict.outcome is Outcome.NONE and rep.verdict.reason is Reason.TOO_LITTLE_DATA
    assert "has 20 steps" in rep.verdict.detail and "needs 30 (15min)" in rep.verdict.detail


def test_no_opt_in_record_asks_for_windows_and_the_state_dir_is_a_fallback() -> None:
    with pytest.raises(NoOptInRecord, match=r"--before START\.\.END --after START\.\.END"):
        run(source(0.1, 0.3, opt_in=None))
    rep = run(source(0.1, 0.3, opt_in=None), state_opt_in=lambda ns, pods: T0)
    assert rep.windows.source == "state dir" and rep.windows.opt_in == T0


def test_an_unknown_workload_names_the_namespace_and_flag() -> None:
    with pytest.raises(UnknownWorkload, match=r"no pods of ns/deployment/w .* --namespace"):
        run(FakeSource(workload_pods=[]))


def test_a_window_shorter_than_a_scrape_names_the_flag() -> None:
    with pytest.raises(UsageError, match=r"^--after: the after window is 10s, shorter than the scrape interval"):
        run(source(0.1, 0.3), before=f"{T0 - 3600}..{T0}", after=f"{T0}..{T0 + 10}")


@pytest.mark.parametrize(("before", "after", "opt_in", "message"), [
    ("-2h..-1h", None, None, "--before needs its partner"),
    ("-2h..-1h", "-1h..now", "-1h", "--opt-in conflicts with --before/--after"),
    ("-1h..-2h", "-1h..now", None, "--before: the window .* is empty"),
    ("-2h..-30m", "-1h..now", None, "--before ends .* after --after starts"),
    ("yesterday..now", "-1h..now", None, "--before: 'yesterday' is not a time"),
], ids=["one-window-only", "opt-in-and-windows", "empty-window", "overlapping", "bad-time"])
def test_bad_window_flags_name_what_to_change(before, after, opt_in, message) -> None:
    with pytest.raises(UsageError, match=message):
        from_flags(before, after, opt_in, NOW)


@pytest.mark.parametrize(("spec", "message"), [
    ("frobnicator/x", "'frobnicator' is not a controller kind"),
    ("trainer", "neither a controller"),
    ("app=x,tier in (a,b)", "set-based selectors are not supported"),
    ("app!=x", "needs at least one label=value"),
], ids=["unknown-kind", "bare-name", "set-based", "only-negative"])
def test_bad_workloads_are_refused_with_a_message(spec, message) -> None:
    with pytest.raises(UsageError, match=message):
        parse(spec, "ns")


def test_workloads_parse_controllers_plurals_and_selectors() -> None:
    assert parse("deploy/trainer", "ml") == Workload("ml", "deployment", "trainer")
    assert parse("statefulsets/db", "ml").kind == "statefulset"
    assert [str(m) for m in parse("app=x,tier!=debug", "ml").selector] == ["app=x", "tier!=debug"]
    assert parse_duration("1h30m", "--window") == 5400


def test_report_config_section_and_its_errors(tmp_path) -> None:
    f = tmp_path / "weft.toml"
    f.write_text('[report]\nprometheus = "http://p:9090"\n[report.prices."p5"]\ngpu_hour = 6.0\nvcpu_hour = 0.05\n')
    cfg = config.load(f).report
    assert cfg.prometheus == "http://p:9090" and cfg.prices == {"p5": {"gpu_hour": 6.0, "vcpu_hour": 0.05}}
    f.write_text('[report.prices."p5"]\ngpu_hour = -1\nvcpu_hour = 0.05\n')
    with pytest.raises(ConfigError, match=r'report.prices."p5".gpu_hour: expected a price'):
        config.load(f)


def test_prometheus_errors_and_timeouts_are_one_clear_message() -> None:
    def slow(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ReadTimeout("timed out", request=request)

    with PrometheusSource("p:9090", timeout=2, transport=httpx2.MockTransport(slow)) as src, \
            pytest.raises(PrometheusError, match=r"Prometheus at http://p:9090 did not answer within 2 s"):
        src.query("up", NOW)

    def bad(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(400, json={"status": "error", "errorType": "bad_data", "error": "parse error"})

    with PrometheusSource("http://p:9090", transport=httpx2.MockTransport(bad)) as src, \
            pytest.raises(PrometheusError, match=r"refused a query \(bad_data: parse error\)"):
        src.query("up{", NOW)


def test_the_agent_exports_opt_in_times_for_a_bounded_number_of_pods(monkeypatch) -> None:
    monkeypatch.setattr("shim.metrics._OPT_IN_SERIES", 2)
    m = Metrics()
    for i in range(3):
        m.sandbox_opted_in("ns", f"p{i}", T0 + i)
    got = {s.labels["pod"]: s.value for fam in m.registry.collect() for s in fam.samples
           if s.name == "weft_sandbox_opted_in_timestamp_seconds"}
    assert got == {"p1": T0 + 1, "p2": T0 + 2}


def test_json_and_markdown_show_the_same_figures() -> None:
    rep = run(source(0.1, 0.2))
    md, js = render.markdown(rep), render.as_json(rep)
    assert "| GPU-active / held | 10.0% | 40.0% |" in md
    assert '"outcome": "kept"' in js and "runtimeClassName" in md


def test_windows_and_times_a_dash_starts_are_values_not_options() -> None:
    from shim.cli import parser

    args = parser().parse_args(["report", "deployment/w", "--before", "-14d..-7d", "--after", "-7d..now",
                                "--now", "-1h"])
    assert (args.before, args.after, args.now) == ("-14d..-7d", "-7d..now", "-1h")


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.7346, 0.9996, 0.0004])
def test_a_counter_there_from_the_first_point_adds_only_what_it_rose(fraction: float) -> None:
    # Two pods restarted 5 and 2 times long before; the second restarts once more inside the after window.
    # Prometheus answers at the query's instants, which the points here stand at.
    before, after = Window("before", T0 - 3600 + fraction, T0), Window("after", T0 + fraction, NOW)
    instants = [ms / 1000 for w in (before, after) for g in [Grid.of(w, 30.0)]
                for ms in range(g.first_ms, g.end_ms + 1, g.step_ms)]
    src = source(0.1, 0.2)
    src.data[Signal.RESTARTS] = [
        Series({"pod": pod, "namespace": "ns", "container": "m"}, tuple((t, count(t)) for t in instants))
        for pod, count in (("w-old", lambda t: 5.0), ("w-new", lambda t: 2.0 if t < T0 + 3000 else 3.0))]
    rep = run(src, before=f"{before.start}..{before.end}", after=f"{after.start}..{after.end}")
    assert (rep.before.restarts, rep.after.restarts) == (0, 1)


def test_each_start_is_timed_from_its_pods_creation_or_the_run_before_it() -> None:
    c = {"pod": "w-new", "namespace": "ns", "container": "m"}
    points = {  # t: (started, restarts, last terminated)
        T0 + 60: (T0 + 20, 0, None), T0 + 600: (T0 + 20, 0, None),
        T0 + 660: (T0 + 650, 1, T0 + 610), T0 + 1200: (T0 + 1190, 2, T0 + 1100),
    }
    src = source(0.1, 0.2)
    src.data[Signal.CREATED] = [flat({"pod": "w-new", "namespace": "ns"}, T0, NOW, T0)]
    src.data[Signal.STARTED] = [Series(c, tuple((t, v[0]) for t, v in points.items()))]
    src.data[Signal.RESTARTS] = [Series(c, tuple((t, v[1]) for t, v in points.items()))]
    src.data[Signal.LAST_TERMINATED] = [Series(c, tuple((t, v[2]) for t, v in points.items() if v[2]))]
    rep = run(src)
    assert (rep.after.starts, rep.after.p95_start_s) == (3, 90)  # 20 s, 40 s, 90 s
    del src.data[Signal.LAST_TERMINATED]
    rep = run(src)
    assert (rep.after.starts, rep.after.p95_start_s) == (1, 20)
    assert any("2 container restart(s) in the window are not timed" in n for n in rep.after.notes)


def test_memory_held_is_the_mean_of_the_steps_with_samples_and_a_note_says_which_lacked_them() -> None:
    src = source(0.1, 0.2)
    mem = flat({"pod": "w-old", "namespace": "ns"}, T0 - 10800, T0, 80 * 2**30)
    src.data[Signal.DEVICE_MEMORY] = [Series(mem.labels, mem.points[3:])]  # dcgm-exporter mapped it late
    rep = run(src)
    assert rep.before.memory_held_bytes == pytest.approx(80 * 2**30)
    assert any(n.startswith("GPU memory held is the mean over 357 of 360 steps") and "w-old" in n
               for n in rep.before.notes)


def test_a_device_plugin_replica_holds_its_share_of_a_device() -> None:
    src = source(0.1, 0.2)
    src.data[Signal.NODE_LABELS] = [flat({"node": "g1", "label_nvidia_com_gpu_replicas": "4"}, T0 - 10800, NOW, 1)]
    rep = run(src)
    assert rep.before.held_gpu_s == pytest.approx(10800 / 4)
    assert rep.before.shared_fraction == 1.0
