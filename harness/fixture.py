"""The pytest side of the real cluster: bring one up for a test module, report its figures, take it down."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from harness.cluster import KubeCluster, NodeSpec

FIGURES_ENV = "WEFT_TEST_FIGURES"
# Where a benchmark that runs a scenario's test (``shim/bench/checkout/day_two.py``) has its figures written, as
# JSON lines.
BENCH_FIGURES_ENV = "WEFT_BENCH_FIGURES"
# Upgrade and roll-back rounds in a row in the day-two test (``python -m bench.day_two --rounds N`` sets it).
ROUNDS_ENV = "WEFT_DAY_TWO_ROUNDS"


def report(config: pytest.Config, line: str, figures: dict[str, object] | None = None) -> None:
    """A figure on the terminal as the run goes (never asserted: figures measure the machine too).

    In a pytest-xdist worker, whose terminal nobody sees, the line goes to the file the controller named
    (integration/conftest.py), which prints it with the summary. ``figures``, the same as values, go to the
    file a benchmark named, if one did.
    """
    bench = os.environ.get(BENCH_FIGURES_ENV)
    if bench and figures is not None:
        with open(bench, "a") as f:
            f.write(json.dumps({"line": line, "figures": figures}) + "\n")
    figures = os.environ.get(FIGURES_ENV)
    if hasattr(config, "workerinput") and figures:
        with open(figures, "a") as f:
            f.write(f"[weft kube] {line}\n")
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        reporter.write_line(f"[weft kube] {line}")


def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            specs: Sequence[NodeSpec], **options: Any) -> Iterator[KubeCluster]:
    c = KubeCluster(tmp_path_factory.mktemp("kube"), specs, **options)
    try:
        with c:
            report(request.config, c.report())
            yield c
    finally:
        report(request.config, f"{c.report()} (after teardown)")
