"""The report's figure: GPUs held and GPUs busy over both windows, with the opt-in moment marked.

matplotlib is imported here only, when a PNG is asked for (it is slow to
import and an optional extra); without it the error says how to install it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from shim.report.build import Report
from shim.report.errors import UsageError


def write(rep: Report, path: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'weft[sim]'") from None

    def when(t: float) -> datetime:
        return datetime.fromtimestamp(t, UTC)

    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    try:
        for f, colour in ((rep.before, "tab:gray"), (rep.after, "tab:blue")):
            line = f.timeline
            ax.step([when(t) for t, _, _ in line], [h for _, h, _ in line], where="pre", color=colour,
                    label=f"GPUs held ({f.window.name})")
            busy = [(when(t), a) for t, _, a in line if a is not None]
            if busy:
                ax.fill_between([t for t, _ in busy], [a for _, a in busy], step="pre", color=colour, alpha=0.35,
                                label=f"GPUs active ({f.window.name}, {rep.active_metric})")
        split = ("after window starts" if rep.windows.source == "flags"
                 else "opted in (runtimeClassName: weft)")
        ax.axvline(when(rep.windows.opt_in), color="tab:red", linestyle="--", label=split)
        ax.set_ylabel("GPUs")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{rep.workload}: GPUs held vs active; verdict {rep.verdict.outcome.value}")
        ax.legend(loc="upper left", fontsize="small")
        fig.autofmt_xdate()
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path
