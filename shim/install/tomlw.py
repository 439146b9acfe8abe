"""A TOML writer for the small subset containerd's configuration uses.

``tomllib`` only reads. The containerd drop-in is written from a parsed
document (the host's effective CRI section plus the ``weft`` runtime), so this
emits nested tables as ``[a."b.c".d]`` headers, scalars, arrays of scalars and
arrays of tables, and checks its own output by reading it back: anything it
cannot write faithfully is an error, never a silently different file.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import tomllib
from typing import Any

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


class TomlWriteError(ValueError):
    """The document holds a value this writer does not emit."""


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return {"nan": "nan", "inf": "inf", "-inf": "-inf"}[str(v)]
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON's escapes are all valid in a TOML basic string
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, list) and not any(isinstance(x, dict) for x in v):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_scalar(x)}" for k, x in v.items()) + "}"
    raise TomlWriteError(f"cannot write a {type(v).__name__} value as TOML")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _table(path: list[str], doc: dict[str, Any], out: list[str], header: bool) -> None:
    # A table holding only tables needs no header of its own (TOML defines it implicitly); an empty one does.
    if header and not (doc and all(isinstance(v, dict) for v in doc.values())):
        out.append("")
        out.append("[" + ".".join(_key(p) for p in path) + "]")
    for k, v in doc.items():
        if not isinstance(v, dict) and not _is_table_array(v):
            out.append(f"{_key(k)} = {_scalar(v)}")
    for k, v in doc.items():
        if isinstance(v, dict):
            _table([*path, k], v, out, header=True)
        elif _is_table_array(v):
            for item in v:
                out.append("")
                out.append("[[" + ".".join(_key(p) for p in [*path, k]) + "]]")
                for ik, iv in item.items():
                    out.append(f"{_key(ik)} = {_scalar(iv)}")


def dumps(doc: dict[str, Any], banner: str = "") -> str:
    """TOML text for ``doc``; raises :class:`TomlWriteError` unless it reads back as exactly ``doc``."""
    out: list[str] = [f"# {line}" if line else "#" for line in banner.splitlines()]
    _table([], doc, out, header=False)
    text = "\n".join(out).lstrip("\n") + "\n"
    try:
        back = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TomlWriteError(f"wrote TOML that does not parse: {exc}") from exc
    if back != doc:
        raise TomlWriteError("wrote TOML that does not read back as the same document")
    return text
