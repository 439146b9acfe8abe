"""The ``weft`` runtime handler's base OCI spec: containerd's default plus weft's hooks.

containerd reads a handler's ``base_runtime_spec`` once at start; the spec
must not carry ``hostname``. The hook runs as
createRuntime (bind the lease) and poststop (release it), with the broker's
socket in its environment and a bounded timeout so a hung broker can never
hang runc.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

HOOK_TIMEOUT_S = 10


def _is_weft(hook: dict[str, Any]) -> bool:
    """weft's own entries: those carrying the broker socket weft writes into their environment."""
    return any(e.startswith("WEFT_BROKER_SOCKET=") for e in hook.get("env", []))


def with_hooks(default_spec: dict[str, Any], hook_argv: Sequence[str], broker_socket: str) -> dict[str, Any]:
    """``hook_argv``: the program and leading args, e.g. ``["/usr/bin/weft-oci-hook"]``; the stage is appended."""
    spec = copy.deepcopy(default_spec)
    spec.pop("hostname", None)
    env = [f"WEFT_BROKER_SOCKET={broker_socket}", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    hooks = spec.setdefault("hooks", {})
    for stage in ("createRuntime", "poststop"):
        entries = [h for h in hooks.get(stage, []) if not _is_weft(h)]
        entries.append({"path": hook_argv[0], "args": [*hook_argv, stage], "env": env, "timeout": HOOK_TIMEOUT_S})
        hooks[stage] = entries
    return spec
