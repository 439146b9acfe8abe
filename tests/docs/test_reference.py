"""The reference pages in ``docs/`` say what the code does, so they cannot drift.

- ``docs/configuration.md``: every field of every config section, with its
  type and default (``shim.config``); every flag of ``weft agent`` with the
  field it really sets, and of ``weft broker`` with its default; the pod
  annotations weft reads and writes.
- ``docs/metrics.md``: every metric with its type and labels, from the
  agent's and the broker's registries; every structured log event name with
  its levels, collected from the source with ``ast``.
- ``docs/operations.md``: every placement reason ``weft explain`` can show.
- Every flag of every ``weft`` subcommand appears in the docs.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim import cli, config
from shim.broker.metrics import BrokerMetrics
from shim.core import classify, placement, stitch
from shim.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# -- reading the pages ------------------------------------------------------------------------------------------


def _sections(page: str) -> dict[str, str]:
    """Heading text -> the text under it, up to the next heading of any level."""
    out: dict[str, str] = {}
    heading = ""
    for line in (DOCS / page).read_text().splitlines():
        m = re.match(r"^#+\s+(.*)$", line)
        if m:
            heading = m[1].strip()
            out[heading] = ""
        else:
            out[heading] = out.get(heading, "") + line + "\n"
    return out


def _rows(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in ``text``, as stripped cells (each table's header and rule left out)."""
    rows: list[list[str]] = []
    table: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
            continue
        for body in table[2:]:
            rows.append([c.strip() for c in body.strip().strip("|").split("|")])
        table = []
    return rows


def _code(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


# -- configuration ----------------------------------------------------------------------------------------------

_TYPES = {bool: "boolean", Path: "path", str: "string", int: "integer", float: "float", dict: "table"}


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path | str):
        return '"' + str(value) + '"'
    if isinstance(value, dict):
        return "{}"
    return repr(value)


def _fields(cls: type) -> dict[str, tuple[str, str]]:
    out = {}
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        kind = next(name for t, name in _TYPES.items()
                    if isinstance(value, t) and (t is bool or not isinstance(value, bool)))
        out[f.name] = (kind, _toml(value))
    return out


@pytest.mark.parametrize("section", [f.name for f in dataclasses.fields(config.Config)])
def test_every_config_field_is_documented_with_its_type_and_default(section: str) -> None:
    cls = type(getattr(config.Config(), section))
    documented = {}
    for row in _rows(_sections("configuration.md")[f"[{section}]"]):
        name = _code(row[0])
        if name:
            documented[name[0]] = (row[1], _code(row[2])[0] if _code(row[2]) else row[2])
    assert documented == _fields(cls), f"docs/configuration.md [{section}] differs from shim.config.{cls.__name__}"


def _subparsers() -> dict[str, object]:
    parser = cli.parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return dict(action.choices)


def _options(sub) -> dict[str, object]:
    """Option string -> argparse action, for every documented (not suppressed) long option."""
    out = {}
    for a in sub._actions:
        if a.help == "==SUPPRESS==" or not a.option_strings:
            continue
        long = [s for s in a.option_strings if s.startswith("--")]
        if long and long[0] != "--help":
            out[long[0]] = a
    return out


# A value for each agent flag, to see which field it really sets.
_AGENT_SAMPLES = {
    "--socket": "/weft-test/cri.sock", "--containerd-socket": "/weft-test/containerd.sock",
    "--state-dir": "/weft-test/state", "--metrics-address": "127.0.0.1:19464", "--log-level": "debug",
    "--broker-socket": "/weft-test/broker.sock", "--node-name": "node-under-test", "--role": "cpu",
    "--mesh-address": "127.0.0.1:17443", "--peers": "/weft-test/peers.toml", "--tls-dir": "/weft-test/tls",
    "--kubeconfig": "/weft-test/kubeconfig", "--cdi-spec-dirs": "/weft-test/cdi:/weft-test/run-cdi",
}


def test_every_agent_flag_is_documented_with_the_field_it_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = {_code(r[0])[0]: r for r in _rows(_sections("configuration.md")["weft agent"]) if _code(r[0])}
    options = _options(_subparsers()["agent"])
    assert set(rows) == set(options), "docs/configuration.md 'weft agent' lists other flags than the parser has"

    seen: list[config.Config] = []

    class FakeAgent:
        def __init__(self, cfg: config.Config, host_check=None, host_sandbox_image=None) -> None:
            seen.append(cfg)

        def run(self) -> None:
            pass

    monkeypatch.setattr("shim.agent.Agent", FakeAgent)
    monkeypatch.setattr("shim.log.configure", lambda *a, **k: None)
    missing = set(options) - set(_AGENT_SAMPLES) - {"--config"}
    assert not missing, f"give {sorted(missing)} a sample value in _AGENT_SAMPLES"
    argv = ["agent"] + [x for flag, value in _AGENT_SAMPLES.items() for x in (flag, value)]
    assert cli.main(argv) == 0
    cfg = seen[0]
    for flag, value in _AGENT_SAMPLES.items():
        sets = _code(rows[flag][1])
        assert sets, f"docs/configuration.md: {flag} names no field it sets"
        section, field = sets[0].split(".")
        assert str(getattr(getattr(cfg, section), field)) == value, f"{flag} does not set {sets[0]}"
    assert _code(rows["--config"][1]) == []


def test_every_broker_flag_is_documented_with_its_default() -> None:
    rows = {_code(r[0])[0]: r for r in _rows(_sections("configuration.md")["weft broker"]) if _code(r[0])}
    options = _options(_subparsers()["broker"])
    assert set(rows) == set(options), "docs/configuration.md 'weft broker' lists other flags than the parser has"
    for flag, action in options.items():
        cell = rows[flag][1]
        if action.required:
            assert cell == "required", flag
        elif action.default is None:
            assert cell == "—", flag
        else:
            assert _code(cell) == [str(action.default)], flag


def test_pod_annotations_weft_reads_and_writes_are_documented() -> None:
    text = _sections("configuration.md")["Pod annotations"]
    names = [classify.STAGE_ANNOTATION, placement.GPU_MEMORY_ANNOTATION, placement.GPU_COMPUTE_ANNOTATION,
             stitch.PORTS_ANNOTATION]
    for prefix in names:
        assert f"`{prefix}<container>`" in text, prefix
    for name in (placement.PLACEMENT_ANNOTATION, placement.PLACEMENT_REASON_ANNOTATION,
                 placement.LEASE_ANNOTATION):
        assert f"`{name}`" in text, name


def test_every_placement_reason_is_documented() -> None:
    text = _sections("operations.md")["Seeing what weft did"]
    documented = {_code(r[0])[0] for r in _rows(text) if _code(r[0])}
    assert documented == {r.value for r in placement.PlacementReason}


# -- every flag somewhere ---------------------------------------------------------------------------------------

# Commands whose page another document owns; checked once that page exists.
_OWNED_ELSEWHERE = {"report": "report.md", "gpu-check": "gpu.md"}


def _all_docs() -> str:
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))])


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_flag_of_every_command_is_in_the_docs(command: str) -> None:
    page = _OWNED_ELSEWHERE.get(command)
    if page is not None and not (DOCS / page).exists():
        pytest.skip(f"docs/{page} does not exist yet")
    text = _all_docs()
    assert f"weft {command}" in text, f"no doc names 'weft {command}'"
    missing = [flag for flag in _options(_subparsers()[command]) if not re.search(re.escape(flag) + r"\b", text)]
    assert not missing, f"weft {command}: flags no doc mentions: {missing}"


def test_every_benchmark_has_a_section() -> None:
    bench = _subparsers()["bench"]
    what = next(a for a in bench._actions if a.dest == "what")
    headings = set(_sections("benchmarks.md"))
    for name in what.choices:
        assert any(h.startswith(f"{name}") or f"weft bench {name}" in h for h in headings), name


# -- metrics ----------------------------------------------------------------------------------------------------


class _NoLeases:
    devices: list = []

    def leases(self) -> list:
        return []

    def mps_pool(self) -> dict:
        return {}


def _exported() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Metric name as Prometheus shows it -> (type, label names), from both registries."""
    out = {}
    registries = [Metrics().registry, BrokerMetrics(_NoLeases()).registry]
    for registry in registries:
        for collector in registry._collector_to_names:
            if hasattr(collector, "_labelnames") and hasattr(collector, "_type"):
                families = [(collector._name, collector._type, tuple(collector._labelnames))]
            else:  # a custom collector: its families say their own label names
                families = [(f.name, f.type, tuple(f._labelnames)) for f in collector.collect()]
            for name, kind, labels in families:
                out[name + ("_total" if kind == "counter" else "")] = (kind, labels)
    return out


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    documented = {}
    for row in _rows((DOCS / "metrics.md").read_text()):
        names = _code(row[0])
        if names and names[0].startswith("weft_"):
            documented[names[0]] = (row[1], tuple(_code(row[2])))
    assert documented == _exported()


# -- log events -------------------------------------------------------------------------------------------------

_LEVELS = {"debug": "debug", "info": "info", "warning": "warning", "error": "error", "exception": "error",
           "critical": "critical"}
_EVENT = re.compile(r"[a-z][a-z_0-9]*(\.[a-z_0-9]+)+")
# Events whose name is built at run time: the f-string as written -> every name it can take.
_DYNAMIC = {"shadow.{why}": {"shadow.removed", "shadow.orphan_removed"}}


def _levels(func: ast.expr) -> set[str]:
    if isinstance(func, ast.Attribute) and func.attr in _LEVELS:
        return {_LEVELS[func.attr]}
    if isinstance(func, ast.IfExp):
        return _levels(func.body) | _levels(func.orelse)
    return set()


def _names(arg: ast.expr, where: str) -> Iterator[str]:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        if _EVENT.fullmatch(arg.value):
            yield arg.value
    elif isinstance(arg, ast.IfExp):
        yield from _names(arg.body, where)
        yield from _names(arg.orelse, where)
    elif isinstance(arg, ast.JoinedStr):
        pattern = "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                          for v in arg.values)
        if _EVENT.fullmatch(re.sub(r"\{[^}]*\}", "x", pattern)):
            assert pattern in _DYNAMIC, f"{where}: log event {pattern!r} is built at run time; add it to _DYNAMIC"
            yield from _DYNAMIC[pattern]


def _events() -> dict[str, set[str]]:
    """Every structlog event name in shim/ and hooks/ -> the levels it is logged at.

    A log call's first argument (``_log.info("peer.up", ...)``), and the ``failed=`` event of a background
    loop (``Periodic(..., failed="watchdog.failed")``), which the loop logs with its traceback, as an error,
    and a pod watch's ``failed_event`` (``PodWatch``), logged as a warning before it retries.
    """
    out: dict[str, set[str]] = {}
    files = [p for p in sorted((ROOT / "shim").rglob("*.py")) if "_pb" not in p.parts]
    for path in [*files, *sorted((ROOT / "hooks").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if node.args and (levels := _levels(node.func)):
                for name in _names(node.args[0], where):
                    out.setdefault(name, set()).update(levels)
            if isinstance(node.func, ast.Name) and node.func.id == "Periodic":
                for kw in node.keywords:
                    if kw.arg == "failed":
                        for name in _names(kw.value, where):
                            out.setdefault(name, set()).add("error")
            if isinstance(node.func, ast.Name) and node.func.id == "PodWatch":
                for kw in node.keywords:
                    if kw.arg == "failed_event":  # a failed list or watch, retried: a warning
                        for name in _names(kw.value, where):
                            out.setdefault(name, set()).add("warning")
    return out


def test_every_log_event_is_documented_with_its_levels() -> None:
    documented = {}
    for row in _rows(_sections("metrics.md")["Log events"]):
        names = _code(row[0])
        if names:
            documented[names[0]] = {lv.strip() for lv in row[1].split(",")}
    assert documented == _events()


def test_the_event_collector_sees_the_agents_own_events() -> None:
    events = _events()
    assert {"agent.started", "cri.call", "placement.decided", "peer.lost", "lease.bound"} <= set(events)
    assert events["cri.call"] == {"debug", "info"}
