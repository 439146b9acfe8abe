"""A watch of Pods that ends when the API server ends it, and closes its response when its reader stops.

lightkube's own watch restarts forever inside its generator and leaves the
response open when the generator is closed; a host agent that must stop in
bounded time, and that must not leak a connection, reads the stream itself.
Each call is one watch request of at most ``timeout`` seconds (the API
server's ``timeoutSeconds``) from ``version`` on; the caller lists again to get
a fresh version after 410 Gone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import httpx2

from shim.errors import WeftError


class WatchError(WeftError):
    """The watch failed: the API refused it, or it broke; the message says which."""


def _selector(pairs: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in pairs.items())


def _path(namespace: str | None) -> str:
    return f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"


def list_pods(http: httpx2.Client, namespace: str | None, labels: Mapping[str, str],
              fields: Mapping[str, str]) -> tuple[list[dict[str, Any]], str]:
    """The matching Pods (as the API's JSON; in every namespace when ``namespace`` is None) and the list's
    resourceVersion."""
    try:
        r = http.get(_path(namespace), params={"labelSelector": _selector(labels), "fieldSelector": _selector(fields)})
        r.raise_for_status()
    except httpx2.HTTPError as exc:
        raise WatchError(f"list pods in {namespace or 'every namespace'}: {exc}") from exc
    doc = r.json()
    return doc.get("items") or [], doc.get("metadata", {}).get("resourceVersion", "")


def watch_pods(http: httpx2.Client, namespace: str | None, labels: Mapping[str, str], fields: Mapping[str, str],
               version: str, timeout: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event type, Pod) from ``version`` on, until the API server ends the watch."""
    params = {"watch": "1", "labelSelector": _selector(labels), "fieldSelector": _selector(fields),
              "timeoutSeconds": str(timeout), "allowWatchBookmarks": "true", "resourceVersion": version}
    try:
        with http.stream("GET", _path(namespace), params=params) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type", ""), event.get("object") or {}
                if kind == "ERROR":
                    raise WatchError(f"watch pods in {namespace}: {obj.get('code')} {obj.get('message')}")
                if kind != "BOOKMARK":
                    yield kind, obj
    except httpx2.HTTPError as exc:
        raise WatchError(f"watch pods in {namespace}: {exc}") from exc
    except ValueError as exc:
        raise WatchError(f"watch pods in {namespace}: a line that is not JSON ({exc})") from exc
