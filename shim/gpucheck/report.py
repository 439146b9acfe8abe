"""Checks as values, the verdict over them, and the two ways they are shown (a table, one JSON line).

The JSON line is a contract that outside checks rely on: the last line of
stdout is one object with ``checks`` (each ``name``, ``result`` in
ok|warn|fail, ``detail``) and ``verdict``; the exit code is 0 when nothing
failed.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Result(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    name: str  # stable, dotted for the live test's steps (live.memory-beyond)
    result: Result
    detail: str  # what was found; for warn and fail also what to change

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "result": self.result.value, "detail": self.detail}


def ok(name: str, detail: str) -> Check:
    return Check(name, Result.OK, detail)


def warn(name: str, detail: str) -> Check:
    return Check(name, Result.WARN, detail)


def fail(name: str, detail: str) -> Check:
    return Check(name, Result.FAIL, detail)


def verdict(checks: list[Check]) -> Result:
    """The worst result: one failed check fails the node."""
    results = {c.result for c in checks}
    return Result.FAIL if Result.FAIL in results else Result.WARN if Result.WARN in results else Result.OK


def json_line(checks: list[Check], **extra: Any) -> str:
    return json.dumps({"checks": [c.as_dict() for c in checks], "verdict": verdict(checks).value, **extra},
                      separators=(",", ":"))


def table(checks: list[Check], width: int | None = None) -> str:
    """One row per check; the detail wrapped under its own column."""
    width = width or max(80, shutil.get_terminal_size((120, 24)).columns)
    name_w = max([len(c.name) for c in checks] + [5])
    lead = name_w + 2 + 4 + 2
    rows = [f"{'CHECK':<{name_w}}  {'':<4}  DETAIL"]
    for c in checks:
        lines = textwrap.wrap(c.detail, max(30, width - lead)) or [""]
        rows.append(f"{c.name:<{name_w}}  {c.result.value:<4}  {lines[0]}")
        rows.extend(" " * lead + line for line in lines[1:])
    v = verdict(checks)
    rows.append("")
    rows.append(f"verdict: {v.value}" + {Result.OK: "", Result.WARN: " (nothing failed; see the warnings)",
                                        Result.FAIL: " (see the failed checks for what to change)"}[v])
    return "\n".join(rows)
