"""The complete table of CRI methods weft intercepts, and the table of weft's own admin calls.

A method path listed in :func:`intercepted` is handled by weft's own module
for that verb; every other path is forwarded to containerd as raw bytes. A
route with a ``when`` is used only while ``when()`` is true, and the path
passes through otherwise; one with a ``pick`` reads the request body first
and passes the call through unless it is weft's (a remote container's). The
``/weft.agent.v1`` paths of :func:`admin` are weft's own calls (``weft
status``, ``weft explain``, ``weft drain`` over the agent's socket).
"""

from __future__ import annotations

from shim.cri import methods
from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs import (
    admin,
    attach,
    container_stats,
    container_status,
    create_container,
    exec_stream,
    exec_sync,
    get_container_events,
    list_container_stats,
    list_containers,
    list_pod_sandbox,
    list_pod_sandbox_stats,
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


def intercepted(fabric: Fabric) -> dict[str, Route]:
    """Method path -> route, for every CRI verb weft intercepts."""
    return {
        # Always.
        run_pod_sandbox.PATH: run_pod_sandbox.route(fabric),
        create_container.PATH: create_container.route(fabric),
        remove_container.PATH: remove_container.route(fabric),
        remove_pod_sandbox.PATH: remove_pod_sandbox.route(fabric),
        # Only while this node has remote containers, and then only for a remote container's request.
        container_status.PATH: container_status.route(fabric),
        start_container.PATH: start_container.route(fabric),
        stop_container.PATH: stop_container.route(fabric),
        stop_pod_sandbox.PATH: stop_pod_sandbox.route(fabric),
        exec_sync.PATH: exec_sync.route(fabric),
        exec_stream.PATH: exec_stream.route(fabric),
        attach.PATH: attach.route(fabric),
        container_stats.PATH: container_stats.route(fabric),
        update_container_resources.PATH: update_container_resources.route(fabric),
        reopen_container_log.PATH: reopen_container_log.route(fabric),
        # Only on a node with a mesh: the credentials a host's pull needs.
        pull_image.PATH: pull_image.route(fabric),
        # Only on a node with a mesh, when kubelet opens the stream: shadows' events out, remote containers' in.
        get_container_events.PATH: get_container_events.route(fabric),
        # Only while this node hosts shadows or has remote containers.
        list_pod_sandbox.PATH: list_pod_sandbox.route(fabric),
        list_containers.PATH: list_containers.route(fabric),
        list_container_stats.PATH: list_container_stats.route(fabric),
        list_pod_sandbox_stats.PATH: list_pod_sandbox_stats.route(fabric),
    }


def admin_calls(fabric: Fabric) -> dict[str, Route]:
    """Method path -> route, for weft's own calls on the agent's socket (JSON bodies)."""
    return {
        methods.ADMIN_STATUS: admin.status(fabric),
        methods.ADMIN_EXPLAIN: admin.explain(fabric),
        methods.ADMIN_DRAIN: admin.drain(fabric),
    }


def table(fabric: Fabric) -> dict[str, Route]:
    """Everything the agent's socket answers itself; what is not here goes to containerd."""
    return {**intercepted(fabric), **admin_calls(fabric)}
