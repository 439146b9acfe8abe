"""A node's labels, read by the installer: where a platform team says per node what the DaemonSet cannot.

One DaemonSet installs every node alike; what differs between nodes (which GPU broker a node gets) is said
with labels on the Node, as `kubectl label node` sets them, and read once at install. Reading is best
effort like :mod:`shim.kube.events`: without the API the installer decides from the host alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx2
import lightkube
from lightkube.resources.core_v1 import Node

from shim.errors import ConfigError
from shim.kube import access


def labels(name: str) -> tuple[dict[str, str], str | None]:
    """(the node's labels, None), or ({}, why they could not be read)."""
    kubeconfig = os.environ.get("KUBECONFIG")
    try:
        api = access.resolve(Path(kubeconfig) if kubeconfig else None)
        if not api.available:
            return {}, "no Kubernetes API configuration"
        client = api.client()
    except ConfigError as exc:
        return {}, exc.message
    try:
        node = client.get(Node, name=name)
    except (lightkube.ApiError, httpx2.HTTPError, OSError) as exc:
        return {}, str(exc)
    finally:
        client.close()
    return dict((node.metadata.labels if node.metadata else None) or {}), None
