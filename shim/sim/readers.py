"""Readers for the public trace files the simulator takes as input, with errors that say where.

The files are the user's input (or the samples in ``shim/sim/traces/``), so a
wrong file, a missing column or a bad cell must come back as one line that names
the file, the line and the column, never as a traceback from deep inside the
model. Each reader returns plain values; turning them into pods is
:mod:`shim.sim.workload`'s job. Column meanings and units follow the traces'
own dictionaries (GenTD26 duty cycle in percent and memory in bytes; Prism
DLRM requests in vCPU, GiB and whole GPUs, times in seconds from the trace
start with empty meaning outside the trace; openb capacities in milli-cores
and MiB).
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from shim.sim.model import GIB, MIB, GpuProfile

GENAI_STEP_S = 57.0  # GenTD26's sampling interval; a file with another step uses its own (median gap)


class TraceError(ValueError):
    """A trace file weft cannot use; the message names the file and, where it applies, the line and column."""

    def __init__(self, path: Path | str, problem: str, *, line: int | None = None, column: str | None = None) -> None:
        where = str(path)
        if line is not None:
            where += f": line {line}"
        if column is not None:
            where += f", column {column!r}" if line is not None else f": column {column!r}"
        super().__init__(f"{where}: {problem}")
        self.path, self.line, self.column, self.problem = Path(path), line, column, problem


def _rows(path: Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    try:
        handle = path.open(newline="", encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(path, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, "is a directory, not a CSV file") from None
    except OSError as exc:
        raise TraceError(path, f"cannot be read ({exc.strerror})") from exc
    with handle:
        reader = csv.DictReader(handle)
        try:
            header = reader.fieldnames or []
        except (UnicodeDecodeError, csv.Error) as exc:
            raise TraceError(path, f"is not a CSV file ({exc})") from exc
        for column in required:
            if column not in header:
                raise TraceError(path, f"missing (the header has: {', '.join(header) or 'nothing'})", column=column)
        try:
            for row in reader:
                yield reader.line_num, row
        except (UnicodeDecodeError, csv.Error) as exc:
            raise TraceError(path, f"is not a CSV file ({exc})", line=reader.line_num) from exc


def _number(path: Path, line: int, column: str, value: str | None, *, lo: float | None = None,
            hi: float | None = None) -> float:
    text = (value or "").strip()
    try:
        x = float(text)
    except ValueError:
        problem = "is empty; expected a number" if not text else f"{text!r} is not a number"
        raise TraceError(path, problem, line=line, column=column) from None
    if not math.isfinite(x) or (lo is not None and x < lo) or (hi is not None and x > hi):
        bounds = f" (expected {'' if lo is None else f'{lo:g} <= '}x{'' if hi is None else f' <= {hi:g}'})"
        raise TraceError(path, f"{text!r} is out of range{bounds}", line=line, column=column)
    return x


def _optional(path: Path, line: int, column: str, value: str | None) -> float | None:
    return None if not (value or "").strip() else _number(path, line, column, value, lo=0)


# -- GenTD26 per-pod samples ------------------------------------------------------

GENAI_SAMPLE_COLUMNS = ("container_ip", "timestamp_anon", "gpu_duty_cycle_pct", "gpu_memory_used_bytes")


def read_genai_samples(path: Path) -> list[GpuProfile]:
    """One profile per pod (``container_ip``), samples in time order; an empty memory cell repeats the last one."""
    pods: dict[str, list[tuple[float, float, float | None, int]]] = {}
    for line, row in _rows(path, GENAI_SAMPLE_COLUMNS):
        pod = (row["container_ip"] or "").strip()
        if not pod:
            raise TraceError(path, "is empty; expected the pod's id", line=line, column="container_ip")
        t = _number(path, line, "timestamp_anon", row["timestamp_anon"])
        duty = _number(path, line, "gpu_duty_cycle_pct", row["gpu_duty_cycle_pct"], lo=0, hi=100)
        memory = _optional(path, line, "gpu_memory_used_bytes", row["gpu_memory_used_bytes"])
        pods.setdefault(pod, []).append((t, duty, memory, line))
    if not pods:
        raise TraceError(path, "has no rows")
    profiles = []
    for pod, samples in pods.items():
        samples.sort(key=lambda s: s[0])
        gaps = sorted(b[0] - a[0] for a, b in itertools.pairwise(samples) if b[0] > a[0])
        step = gaps[len(gaps) // 2] if gaps else GENAI_STEP_S
        memory: list[int] = []
        for _, _, m, line in samples:
            if m is None and not memory:
                raise TraceError(path, f"is empty in pod {pod}'s first sample; nothing to carry forward", line=line,
                                 column="gpu_memory_used_bytes")
            memory.append(int(m) if m is not None else memory[-1])
        profiles.append(GpuProfile(pod, step, [s[1] / 100.0 for s in samples], memory))
    return profiles


# -- GenTD26 per-pod summary ------------------------------------------------------

GENAI_SUMMARY_COLUMNS = ("container_ip", "n_samples", "gpu_duty_mean_pct", "frac_samples_zero_duty",
                         "gpu_mem_mean_GiB", "gpu_mem_max_GiB")


def read_genai_summary(path: Path) -> list[GpuProfile]:
    """Each pod as a two-level profile with its mean duty, zero share, mean and peak memory (see assumptions)."""
    profiles = []
    for line, row in _rows(path, GENAI_SUMMARY_COLUMNS):
        name = (row["container_ip"] or "").strip()
        n = int(_number(path, line, "n_samples", row["n_samples"], lo=1))
        mean = _number(path, line, "gpu_duty_mean_pct", row["gpu_duty_mean_pct"], lo=0, hi=100) / 100.0
        zero_frac = _number(path, line, "frac_samples_zero_duty", row["frac_samples_zero_duty"], lo=0, hi=1)
        mem_mean = _number(path, line, "gpu_mem_mean_GiB", row["gpu_mem_mean_GiB"], lo=0)
        mem_max = _number(path, line, "gpu_mem_max_GiB", row["gpu_mem_max_GiB"], lo=0)
        zeros = min(n, round(zero_frac * n))
        if zeros == n and mean > 0:
            zeros = n - 1  # a mean above 0 needs one busy sample
        busy = n - zeros
        level = min(1.0, mean * n / busy) if busy else 0.0
        # Busy samples spread evenly among the idle ones, so that any stretch of the replay, not just the
        # whole series, has the pod's mix of idle and busy time.
        duty = [level if (k + 1) * busy // n > k * busy // n else 0.0 for k in range(n)]
        memory = [round(mem_mean * GIB)] * n
        profiles.append(GpuProfile(name, GENAI_STEP_S, duty, memory, peak_bytes=math.ceil(mem_max * GIB)))
    if not profiles:
        raise TraceError(path, "has no rows")
    return profiles


# -- Prism DLRM instances ---------------------------------------------------------

DLRM_COLUMNS = ("instance_sn", "role", "app_name", "cpu_request", "gpu_request", "memory_request",
                "creation_time", "scheduled_time", "deletion_time")


@dataclass(frozen=True)
class DlrmInstance:
    name: str
    role: str  # CN or HN
    app: str
    vcpu: float
    gpus: int
    memory_bytes: int
    created: float | None  # None: before the trace start
    scheduled: float | None
    deleted: float | None  # None: after the trace end
    order: int  # row position, the last tie-breaker of the pairing


def read_dlrm(path: Path) -> tuple[list[DlrmInstance], float]:
    """The instances and the trace end (the latest time anywhere in the file)."""
    out = []
    end = 0.0
    for line, row in _rows(path, DLRM_COLUMNS):
        role = (row["role"] or "").strip()
        if role not in ("CN", "HN"):
            raise TraceError(path, f"{role!r} is not a role (CN or HN)", line=line, column="role")
        times = {c: _optional(path, line, c, row[c]) for c in ("creation_time", "scheduled_time", "deletion_time")}
        end = max([end, *(t for t in times.values() if t is not None)])
        gpus = _number(path, line, "gpu_request", row["gpu_request"], lo=0)
        if gpus != int(gpus):
            raise TraceError(path, f"{row['gpu_request']!r} is not a whole number of GPUs", line=line,
                             column="gpu_request")
        if role == "HN" and gpus < 1:
            raise TraceError(path, "is 0 for an HN (GPU node) instance", line=line, column="gpu_request")
        out.append(DlrmInstance(
            name=(row["instance_sn"] or "").strip() or f"line-{line}",
            role=role,
            app=(row["app_name"] or "").strip(),
            vcpu=_number(path, line, "cpu_request", row["cpu_request"], lo=0),
            gpus=int(gpus),
            memory_bytes=round(_number(path, line, "memory_request", row["memory_request"], lo=0) * GIB),
            created=times["creation_time"],
            scheduled=times["scheduled_time"],
            deleted=times["deletion_time"],
            order=len(out),
        ))
    if not out:
        raise TraceError(path, "has no rows")
    return out, end


# -- openb node inventory ---------------------------------------------------------

OPENB_NODE_COLUMNS = ("cpu_milli", "memory_mib", "gpu")


@dataclass(frozen=True)
class NodeRow:
    vcpu: float
    memory_bytes: int
    gpus: int
    model: str


def read_openb_nodes(path: Path) -> list[NodeRow]:
    out = []
    for line, row in _rows(path, OPENB_NODE_COLUMNS):
        out.append(NodeRow(
            vcpu=_number(path, line, "cpu_milli", row["cpu_milli"], lo=0) / 1000.0,
            memory_bytes=round(_number(path, line, "memory_mib", row["memory_mib"], lo=0) * MIB),
            gpus=int(_number(path, line, "gpu", row["gpu"], lo=0)),
            model=(row.get("model") or "").strip(),
        ))
    if not out:
        raise TraceError(path, "has no rows")
    return out
