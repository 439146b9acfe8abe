"""The complete table of CRI methods weft intercepts.

A method path listed here is handled by weft's own module for that verb; every
other path is forwarded to containerd as raw bytes. Today the table is empty:
the proxy is a transparent pass-through, and opt-in handling adds its verbs
here one module each (``shim/cri/run_pod_sandbox.py`` and so on).
"""

from __future__ import annotations

from collections.abc import Callable

from shim.cri.passthrough import Upstream


def intercepted(upstream: Upstream) -> dict[str, Callable[..., object]]:
    """Method path -> handler ``(request, context)`` for every intercepted verb."""
    del upstream  # the verbs that use it arrive with opt-in handling
    return {}
