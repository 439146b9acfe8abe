"""The report's two figures, drawn with matplotlib's Agg backend (no display needed).

matplotlib is an optional extra (``weft[sim]``) and slow to import, so it is
imported inside :func:`write` only: the rest of the simulator, and the agent
that shares its package tree, never pay for it. A missing matplotlib is a
:class:`PlotError` whose message says how to install it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shim.sim.metrics import Series

_STYLE = {"bundled": ("tab:red", "-"), "weft": ("tab:blue", "-"), "weft-full-requests": ("tab:blue", ":"),
          "weft-reserved": ("tab:green", "--"), "kai-fractions": ("tab:orange", "-.")}


class PlotError(RuntimeError):
    """The figures cannot be drawn here."""


def write(out: Path, series: Mapping[str, Series], completions: Mapping[str, Sequence[float]]) -> list[Path]:
    """Write ``utilisation.png`` and ``completion_cdf.png`` into ``out``; returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError as exc:
        raise PlotError("the figures need matplotlib: pip install 'weft[sim]'") from exc

    paths = [out / "utilisation.png", out / "completion_cdf.png"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, s in series.items():
        if not s.edges_s:
            continue
        mids = [(a + b) / 2 / 3600 for a, b in itertools.pairwise(s.edges_s)]
        points = [(x, 100 * u) for x, u in zip(mids, s.utilisation, strict=True) if u is not None]
        color, line = _STYLE.get(name, ("tab:gray", "-"))
        ax.plot([x for x, _ in points], [y for _, y in points], color=color, linestyle=line, label=name)
    ax.set_xlabel("time (h)")
    ax.set_ylabel("GPU utilisation, duty cycle (%)\nbusy / held GPU-seconds")
    ax.set_ylim(bottom=0)
    _save(fig, ax, "GPU utilisation over time", paths[0])

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in completions.items():
        if not values:
            continue
        ordered = sorted(values)
        n = len(ordered)
        color, line = _STYLE.get(name, ("tab:gray", "-"))
        ax.step([v / 3600 for v in ordered], [(k + 1) / n for k in range(n)], where="post", color=color,
                linestyle=line, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time, queueing + run (h, log scale)")
    ax.set_ylabel("share of pods")
    _save(fig, ax, "Job completion time CDF", paths[1])
    return paths


def _save(fig: Any, ax: Any, title: str, path: Path) -> None:
    """Title, grid and legend alike on every figure; written to ``path`` and closed."""
    from matplotlib import pyplot as plt  # imported by write already: matplotlib is optional

    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
