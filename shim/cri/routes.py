"""The complete table of CRI methods weft intercepts.

A method path listed here is handled by weft's own module for that verb; every
other path is forwarded to containerd as raw bytes. A handler with a ``when``
attribute is used only while ``when()`` is true, and the path passes through
otherwise. The ``/weft.agent.v1``
paths are weft's own admin calls (``weft status``/``weft explain`` over the
agent's socket).
"""

from __future__ import annotations

from collections.abc import Callable

from shim.cri import admin, create_container, hide_shadows, remove_container, remove_pod_sandbox, run_pod_sandbox
from shim.cri.fabric import Fabric


def intercepted(fabric: Fabric) -> dict[str, Callable[..., object]]:
    """Method path -> handler ``(request bytes, context) -> response bytes`` for every intercepted verb."""
    return {
        run_pod_sandbox.PATH: run_pod_sandbox.handler(fabric),
        create_container.PATH: create_container.handler(fabric),
        remove_container.PATH: remove_container.handler(fabric),
        remove_pod_sandbox.PATH: remove_pod_sandbox.handler(fabric),
        admin.STATUS: admin.status_handler(fabric),
        admin.EXPLAIN: admin.explain_handler(fabric),
        # Only while this node hosts shadows (each handler's ``when``); pass-through otherwise.
        **hide_shadows.handlers(fabric),
    }
