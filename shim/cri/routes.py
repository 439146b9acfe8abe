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

from shim.cri import (
    admin,
    attach,
    container_stats,
    container_status,
    create_container,
    exec_stream,
    exec_sync,
    hide_shadows,
    pull_image,
    remove_container,
    remove_pod_sandbox,
    reopen_container_log,
    run_pod_sandbox,
    start_container,
    stop_container,
    stop_pod_sandbox,
    update_container_resources,
)
from shim.cri.fabric import Fabric


def intercepted(fabric: Fabric) -> dict[str, Callable[..., object]]:
    """Method path -> handler ``(request bytes, context) -> response bytes`` for every intercepted verb."""
    return {
        run_pod_sandbox.PATH: run_pod_sandbox.handler(fabric),
        create_container.PATH: create_container.handler(fabric),
        remove_container.PATH: remove_container.handler(fabric),
        remove_pod_sandbox.PATH: remove_pod_sandbox.handler(fabric),
        # Only while this node has remote containers (each handler's ``when``); a local container's
        # request passes through unchanged even then.
        container_status.PATH: container_status.handler(fabric),
        start_container.PATH: start_container.handler(fabric),
        stop_container.PATH: stop_container.handler(fabric),
        stop_pod_sandbox.PATH: stop_pod_sandbox.handler(fabric),
        exec_sync.PATH: exec_sync.handler(fabric),
        exec_stream.PATH: exec_stream.handler(fabric),
        attach.PATH: attach.handler(fabric),
        container_stats.PATH: container_stats.handler(fabric),
        update_container_resources.PATH: update_container_resources.handler(fabric),
        reopen_container_log.PATH: reopen_container_log.handler(fabric),
        # Only on a node with a mesh: the credentials a host's pull needs.
        pull_image.PATH: pull_image.handler(fabric),
        admin.STATUS: admin.status_handler(fabric),
        admin.EXPLAIN: admin.explain_handler(fabric),
        admin.DRAIN: admin.drain_handler(fabric),
        # Only while this node hosts shadows or has remote containers; pass-through otherwise.
        **hide_shadows.handlers(fabric),
    }
