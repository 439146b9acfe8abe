"""Node network namespaces a test left behind: those it did not find, whose slot no live harness holds.

Tests run beside each other (pytest-xdist): a namespace that appeared while a test ran may be another
worker's node, and is a leak only once no live harness holds its slot.
"""

from __future__ import annotations

import subprocess

from shim.localfabric.containerd import lock_held


def netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def slot_held(name: str) -> bool:
    """A node namespace whose slot another live harness holds is theirs, not a leak."""
    return lock_held(f"slot{name.removeprefix('weftnode')}")


def leaked_node_namespaces(before: set[str]) -> set[str]:
    return {ns for ns in netns() - before if ns.startswith("weftnode") and not slot_held(ns)}
