"""Events on a pod, for what a person must see in ``kubectl describe pod``: the installer's refusal of a host.

The installer runs in the DaemonSet's init container, which knows its pod from the downward API
(``WEFT_POD_NAME``, ``WEFT_POD_NAMESPACE``, ``WEFT_POD_UID``) and has the pod's service account (or
``KUBECONFIG``, as kubectl reads it). Reporting is best effort: the installer's own exit and output stay
what they are when the API cannot be reached.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import httpx2
import lightkube
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event

from shim.errors import ConfigError
from shim.kube import access

COMPONENT = "weft-install"
MESSAGE_LIMIT = 1024  # the API server's limit on an Event's message


@dataclass(frozen=True)
class PodRef:
    name: str
    namespace: str
    uid: str

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> PodRef | None:
        env = os.environ if environ is None else environ
        name, namespace = env.get("WEFT_POD_NAME"), env.get("WEFT_POD_NAMESPACE")
        return cls(name, namespace, env.get("WEFT_POD_UID", "")) if name and namespace else None


def report(pod: PodRef, reason: str, message: str, *, warning: bool = True, kubeconfig: Path | None = None,
           component: str = COMPONENT, field_path: str | None = "spec.initContainers{install}") -> str | None:
    """Create an Event on ``pod``; None when it was created, else why not. ``kubeconfig`` (else ``KUBECONFIG``,
    else in-cluster) is whose credentials; ``component`` and ``field_path`` say which part of weft speaks."""
    if kubeconfig is None and os.environ.get("KUBECONFIG"):
        kubeconfig = Path(os.environ["KUBECONFIG"])
    try:
        api = access.resolve(kubeconfig)
        client = api.client()
    except ConfigError as exc:
        return exc.message
    now = dt.datetime.now(dt.UTC)
    event = Event(
        metadata=ObjectMeta(generateName=f"{pod.name}.", namespace=pod.namespace),
        involvedObject=ObjectReference(kind="Pod", apiVersion="v1", name=pod.name, namespace=pod.namespace,
                                       uid=pod.uid or None, fieldPath=field_path),
        reason=reason, message=message[:MESSAGE_LIMIT], type="Warning" if warning else "Normal",
        source=EventSource(component=component, host=os.environ.get("WEFT_NODE_NAME") or socket.gethostname()),
        firstTimestamp=now, lastTimestamp=now, count=1)
    try:
        client.create(event, namespace=pod.namespace)
    except (lightkube.ApiError, httpx2.HTTPError, OSError) as exc:
        return str(exc)
    finally:
        client.close()
    return None
