"""A real Prometheus server (Debian's ``prometheus``) holding recorded exporter samples as history.

A scrape can only write "now", so a test's history comes from the recorded
text exposition files under ``tests/data/report/<phase>/`` (one scrape each of
dcgm-exporter, kube-state-metrics, cAdvisor and weft, per phase): each is
replayed as a scrape every ``interval`` seconds across its phase (gauges
keep their recorded value, counters rise linearly from 0 at the phase start
to it), written as timestamped OpenMetrics, backfilled with
``promtool tsdb create-blocks-from openmetrics``, and served by a
``prometheus`` process on a free loopback port with its own temporary TSDB.

Stories one recorded scrape cannot tell (a rollout, a container that
restarts, an exporter whose pod mapping lags) are written sample by sample
into a :class:`History` and backfilled with the recorded phases.

``--query.lookback-delta`` is set to one interval and a bit: backfilled
series carry no staleness markers (a live scrape writes one when a pod
goes), so without it a gone pod would seem to linger five minutes.
"""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "report"
T0 = 1741003200.0  # 2025-03-03T12:00:00Z: the recorded workloads opted in here
PHASE_S = 3 * 3600.0
PHASES = {"before": (T0 - PHASE_S, T0), "after": (T0, T0 + PHASE_S)}


def _label_text(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


class History:
    """Series written as a scraper would have seen them: a sample at every multiple of ``interval``."""

    def __init__(self, interval: float = 30.0) -> None:
        self.interval = interval
        self.series: dict[str, dict[str, dict[float, float]]] = {}

    def add(self, name: str, labels: dict[str, str], start: float, end: float,
            value: float | Callable[[float], float | None]) -> None:
        """Scrapes in [start, end); ``value`` may depend on the time, and None there means no sample.

        Writing a series twice at one time keeps the later value, as one scrape would.
        """
        points = self.series.setdefault(name, {}).setdefault(_label_text(labels), {})
        t = math.ceil(start / self.interval) * self.interval
        while t < end:
            v = value(t) if callable(value) else value
            if v is not None:
                points[t] = float(v)
            t += self.interval


def openmetrics(data: Path = DATA, interval: float = 30.0, history: History | None = None) -> str:
    """The recorded scrapes replayed over their phases, and ``history``, as OpenMetrics with timestamps."""
    series: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for name, by_labels in (history.series if history else {}).items():
        for labels, points in by_labels.items():
            series.setdefault(name, {}).setdefault(labels, []).extend(points.items())
    for phase, (start, end) in PHASES.items():
        for path in sorted((data / phase).glob("*.prom")):
            for fam in text_string_to_metric_families(path.read_text()):
                counter = fam.type == "counter"
                for s in fam.samples:
                    key = _label_text(s.labels)
                    points = series.setdefault(s.name, {}).setdefault(key, [])
                    t = start + interval
                    while t <= end:
                        value = s.value * (t - start) / (end - start) if counter else s.value
                        points.append((t, float(int(value)) if counter and s.name.endswith("restarts_total")
                                       else value))
                        t += interval
    return render(series)


def render(series: dict[str, dict[str, list[tuple[float, float]]]], time_digits: int = 0) -> str:
    """Series (name -> label text -> [(time, value)]) as the OpenMetrics text promtool backfills from."""
    lines = []
    for name, by_labels in series.items():
        lines.append(f"# TYPE {name} gauge")  # PromQL does not care; OpenMetrics counters need a _total family
        for labels, points in by_labels.items():
            lines += [f"{name}{{{labels}}} {v!r} {t:.{time_digits}f}" for t, v in sorted(points)]
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    """``with PrometheusServer() as prom: prom.url`` — stopped and its files removed on exit, also on failure."""

    def __init__(self, interval: float = 30.0, history: History | None = None) -> None:
        self.interval = interval
        self.history = history
        self.dir = Path(tempfile.mkdtemp(prefix="weft-prom-"))
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> PrometheusServer:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        for tool in ("prometheus", "promtool"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is missing: apt-get install prometheus (scripts/setup.sh does)")
        om = self.dir / "history.om"
        om.write_text(openmetrics(interval=self.interval, history=self.history))
        tsdb = self.dir / "tsdb"
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(om), str(tsdb)], check=True,
                       capture_output=True, timeout=120)
        (self.dir / "prometheus.yml").write_text(f"global:\n  scrape_interval: {self.interval:g}s\n")
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = (self.dir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={tsdb}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=100y",
             f"--query.lookback-delta={int(self.interval * 1.5)}s"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("prometheus did not become ready in 60 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "log"):
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
