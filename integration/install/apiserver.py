"""The API server the manifest and Helm tests install weft into, and what of weft's they find there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from harness.controlplane import ControlPlane


def api_server(workdir: Path, **options: bool) -> Iterator[ControlPlane]:
    """A started API server with the namespace controller (a deleted namespace goes, with what it held); stopped
    after. For a fixture to ``yield from``."""
    cp = ControlPlane(workdir, "127.0.0.1", [], **options)
    try:
        cp.start()
        cp.start_controller_manager(["namespace"])
        yield cp
    finally:
        cp.stop()


def weft_objects(api: ControlPlane, *, pods: bool = False) -> list[str]:
    """Every object labelled as weft's, cluster-wide (its pods too with ``pods``), and weft's namespace."""
    kinds = ",".join(["daemonsets", "deployments", *(["pods"] if pods else []), "services", "serviceaccounts", "roles",
                      "rolebindings", "poddisruptionbudgets"])
    found = api.kubectl("get", f"{kinds},clusterroles,clusterrolebindings,runtimeclasses", "-A",
                        "-l", "app.kubernetes.io/name=weft", "-o", "name").stdout.split()
    return found + api.kubectl("get", "namespace", "weft-system", "-o", "name", "--ignore-not-found").stdout.split()
