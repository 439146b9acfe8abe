"""One home for the benchmarks, told apart by where they live: ``shim/bench`` ships (``weft bench``),
``shim/bench/checkout`` runs from a checkout (``python -m bench.NAME``, through ``bench/NAME.py``) and stays out of
the wheel, as the test harness does. What imports what is ``lint-imports``'s; this is the files around it."""

from __future__ import annotations

import ast
import contextlib
import io
import runpy
import sys
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
CHECKOUT = ROOT / "shim" / "bench" / "checkout"
ALIASES = ROOT / "bench"


def _runnable() -> list[str]:
    """The checkout's benchmarks that are run (a module with a ``main``), by name."""
    return sorted(p.stem for p in CHECKOUT.glob("*.py")
                  if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(p.read_text()).body))


def test_the_wheel_ships_the_benchmarks_of_weft_bench_and_neither_the_checkouts_nor_the_harness() -> None:
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = set(find_packages(str(ROOT), include=found["include"], exclude=found.get("exclude", ())))
    assert "shim.bench" in shipped
    assert not {p for p in shipped if p.startswith(("shim.bench.checkout", "harness", "integration", "tests"))}


def test_the_node_image_leaves_them_out_as_the_wheel_does() -> None:
    from nodeimage.build.containerfile import _ignored, ignore_patterns

    patterns = ignore_patterns(ROOT / "nodeimage" / "containerignore")
    assert _ignored("bench/checkout", patterns) and _ignored("bench/checkout/day_two.py", patterns)  # COPY shim
    assert not _ignored("bench/proxy.py", patterns)


def test_bench_holds_only_the_names_the_checkouts_benchmarks_are_run_by() -> None:
    aliases = sorted(p.stem for p in ALIASES.glob("*.py") if p.name != "__init__.py")
    assert aliases == _runnable()
    assert not [p.name for p in ALIASES.iterdir() if p.is_dir() and p.name not in ("results", "__pycache__")]


@pytest.mark.parametrize("name", _runnable())
def test_python_m_bench_name_runs_the_module_where_it_lives(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", "--help"])
    for module in (f"bench.{name}", f"shim.bench.checkout.{name}"):  # as in a fresh ``python -m``: not imported
        monkeypatch.delitem(sys.modules, module, raising=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stopped:
        runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    assert stopped.value.code == 0
    assert out.getvalue().startswith("usage: ")
    assert f"shim/bench/checkout/{name}.py" in (ALIASES / f"{name}.py").read_text()


@pytest.mark.parametrize("name", [n for n in _runnable() if n != "gpu_workload"])
def test_a_page_says_how_each_is_run(name: str) -> None:
    """``gpu_workload`` is ``gpu_value``'s pods' program, run by it, not by hand."""
    said = "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    assert f"python -m bench.{name}" in said
