"""The error tree drawn in ``shim/errors.py`` is complete and true.

Every subclass of ``WeftError`` anywhere in ``shim`` appears in the tree,
under its real base, with the module it lives in and the status code it
carries, so the docstring is the one place a reader learns what can go wrong.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import grpc
import pytest

import shim
from shim import errors
from shim.errors import WeftError

_LINE = re.compile(r"^(?P<indent>(?:[│ ]   )*)(?:[├└]── )?(?P<name>[A-Z]\w+)\s+(?P<text>.*)$")


def _tree() -> dict[str, tuple[str | None, str]]:
    """Class name -> (parent name, the rest of its line and any continuation lines)."""
    body = errors.__doc__.split("::", 1)[1].split("\n\n", 2)[1]
    out: dict[str, tuple[str | None, str]] = {}
    stack: list[str] = []
    last = None
    for line in body.splitlines():
        m = _LINE.match(line.strip("\n")[4:])
        if m is None or m["name"] == "UNKNOWN":
            if last is not None:  # a continuation of the line above
                out[last] = (out[last][0], out[last][1] + " " + line.strip(" │"))
            continue
        depth = len(m["indent"]) // 4 + (0 if m["name"] == "WeftError" else 1)
        del stack[depth:]
        out[m["name"]] = (stack[-1] if stack else None, m["text"])
        stack.append(m["name"])
        last = m["name"]
    return out


def _subclasses() -> list[type[WeftError]]:
    for info in pkgutil.walk_packages(shim.__path__, "shim."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    found, todo = [], [WeftError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if not sub.__name__.startswith("_"):
                found.append(sub)
            todo.append(sub)
    return found


TREE = _tree()


def test_the_tree_has_its_root_and_parses():
    assert TREE["WeftError"][0] is None
    assert len(TREE) > 20


@pytest.mark.parametrize("cls", _subclasses(), ids=lambda c: c.__name__)
def test_every_error_is_in_the_tree_under_its_base_with_its_module_and_code(cls):
    assert cls.__name__ in TREE, f"{cls.__module__}.{cls.__name__} is missing from the tree in shim/errors.py"
    parent, text = TREE[cls.__name__]
    assert parent == cls.__base__.__name__, f"{cls.__name__} is drawn under {parent}, but its base is {cls.__base__}"
    where = re.search(r"\((shim\.[\w.]+);", text)
    assert (where[1] if where else "shim.errors") == cls.__module__, f"{cls.__name__} lives in {cls.__module__}"
    code = re.search(r"\b([A-Z_]{5,})\)\s*$", text)
    if code and "any code" not in text:
        assert cls.code is getattr(grpc.StatusCode, code[1]), f"{cls.__name__} carries {cls.code.name}"


def test_every_name_in_the_tree_is_a_real_error():
    real = {c.__name__ for c in _subclasses()} | {"WeftError"}
    assert set(TREE) <= real, f"the tree names errors that do not exist: {set(TREE) - real}"
