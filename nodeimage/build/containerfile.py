"""Reading nodeimage/Containerfile (and containerignore) into the plan the build follows."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nodeimage.build.common import HOOK_RUN, HOOK_STAGE, IGNOREFILE, INIT_RUN, INIT_STAGE, PIP_RUN, BuildError


@dataclass
class Stage:
    """A build stage before the image's own (``FROM ... AS name``): what it copies in and runs."""

    base: str = ""
    copies: list[tuple[str, str]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """What the Containerfile asks for, in the terms build.py acts on."""

    base: str = ""
    copies: list[tuple[str, str]] = field(default_factory=list)  # (source in the repo, destination)
    runs: list[str] = field(default_factory=list)
    stages: dict[str, Stage] = field(default_factory=dict)
    copies_from: list[tuple[str, str, str]] = field(default_factory=list)  # (stage, its path, destination)
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


def _logical_lines(text: str) -> Iterator[str]:
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        yield buf + line
        buf = ""
    if buf:
        yield buf


def _pairs(args: str, what: str) -> dict[str, str]:
    out = {}
    for word in shlex.split(args):
        key, sep, value = word.partition("=")
        if not sep:
            raise BuildError(f"Containerfile {what}: {word!r} is not KEY=VALUE")
        out[key] = value
    return out


def parse_containerfile(text: str, build_args: dict[str, str] | None = None) -> Plan:
    """The instructions build.py supports; anything else is refused by name."""
    plan, args = Plan(), dict(build_args or {})
    into: Plan | Stage = plan
    for line in _logical_lines(text):
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ARG":
            key, _, default = rest.partition("=")
            args.setdefault(key, default)
        elif op == "FROM":
            words = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), rest).split()
            if len(words) == 3 and words[1].upper() == "AS":
                into = plan.stages[words[2]] = Stage(base=words[0])
            elif len(words) == 1:
                into, plan.base = plan, words[0]
            else:
                raise BuildError(f"Containerfile FROM {rest!r}: expected FROM IMAGE [AS NAME]")
        elif op == "COPY":
            words = shlex.split(rest)
            if words and words[0].startswith("--from="):
                if into is not plan or len(words) != 3 or words[0][7:] not in plan.stages:
                    raise BuildError(f"Containerfile COPY {rest!r}: --from names an earlier stage, into the image")
                plan.copies_from.append((words[0][7:], words[1], words[2]))
                continue
            src, dest = words
            into.copies.append((src, dest))
        elif op == "RUN":
            into.runs.append(" ".join(rest.split()))
        elif op == "ENV":
            plan.env.update(_pairs(rest, "ENV"))
        elif op == "LABEL":
            plan.labels.update(_pairs(rest, "LABEL"))
        elif op == "USER":
            plan.user = rest
        elif op in ("ENTRYPOINT", "CMD"):
            value = json.loads(rest)
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise BuildError(f"Containerfile {op}: use the JSON (exec) form")
            setattr(plan, op.lower(), value)
        else:
            raise BuildError(f"Containerfile: nodeimage/build.py does not handle {op}; keep to the instructions "
                             "it reads (see its docstring), or extend it")
    if not plan.base:
        raise BuildError("Containerfile: no FROM")
    for run in plan.runs:
        if run != PIP_RUN:
            raise BuildError(f"Containerfile RUN {run!r}: build.py only runs {PIP_RUN!r}")
    known = {HOOK_STAGE: [HOOK_RUN], INIT_STAGE: [INIT_RUN]}
    for name, stage in plan.stages.items():
        if known.get(name) != stage.runs or (name == INIT_STAGE and stage.copies):
            raise BuildError(f"Containerfile stage {name!r}: build.py builds only the {HOOK_STAGE!r} stage, "
                             f"whose one RUN is {HOOK_RUN!r}, and the {INIT_STAGE!r} stage, which copies nothing "
                             f"in and whose one RUN is {INIT_RUN!r}")
    return plan


def ignore_patterns(path: Path = IGNOREFILE) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    for pat in patterns:
        name = pat.removeprefix("**/")
        if pat.startswith("**/"):
            if any(fnmatch.fnmatchcase(p, name) for p in parts):
                return True
        elif fnmatch.fnmatchcase(rel, pat):
            return True
    return False
