"""``weft status``, ``weft explain`` and ``weft drain``: read from the running agent or from the state files.

With ``--socket`` the agent answers (and asks its broker for live leases),
adding what only it knows: this node's role and drain state, its peers and
their health, the shadows it hosts, its recent warnings and errors. With
``--state-dir`` the files are read directly (``agent.db``, and ``broker.db``
when the broker keeps its state there too), which works while the agent is
down. Both give the same JSON document for what they share. ``weft drain``
always asks the agent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc

from shim.cri.methods import ADMIN_DRAIN, ADMIN_EXPLAIN, ADMIN_STATUS
from shim.errors import UnknownContainer, WeftError
from shim.state import report
from shim.state.agent import AgentStore
from shim.state.leases import LeaseStore


def from_agent(socket: Path, explain: str | None = None) -> dict[str, Any]:
    path, body = (ADMIN_EXPLAIN, explain.encode()) if explain is not None else (ADMIN_STATUS, b"")
    return _ask(socket, path, body)


def drain(socket: Path, on: bool) -> dict[str, Any]:
    """Start (or, with ``on`` false, end) draining the node; its drain state and the shadows it still hosts."""
    return _ask(socket, ADMIN_DRAIN, json.dumps({"drain": on}).encode())


def _ask(socket: Path, path: str, body: bytes) -> dict[str, Any]:
    with grpc.insecure_channel(f"unix://{socket}") as ch:
        try:
            raw = ch.unary_unary(path)(body, timeout=10)
        except grpc.RpcError as exc:
            raise WeftError(f"agent at {socket}: {exc.details()}") from None  # type: ignore[attr-defined]
    return json.loads(raw)


def from_state_dir(state_dir: Path, explain: str | None = None) -> dict[str, Any]:
    if not (state_dir / "agent.db").exists():
        raise WeftError(f"no weft state in {state_dir} (no agent.db); is --state-dir right?")
    store = AgentStore(state_dir)
    leases = None
    if (state_dir / "broker.db").exists():
        lstore = LeaseStore(state_dir)
        leases = [report.lease_from_record(r) for r in lstore.all()]
        lstore.close()
    try:
        if explain is not None:
            doc = report.explain(store, explain, leases)
            if doc is None:
                raise UnknownContainer(f"weft placed no container {explain!r} (state in {state_dir})")
            return doc
        return report.status(store, leases)
    finally:
        store.close()


def table(doc: dict[str, Any]) -> str:
    lines = []
    node = doc.get("node")
    if node:
        lines.append(f"NODE  {node['name'] or '(no mesh)'}  role={node['role']}"
                     + (f"  mesh={node['mesh_address']}" if node.get("mesh_address") else "")
                     + ("  DRAINING" if node.get("draining") else "")
                     + ("  gpu-broker" if node.get("gpu_broker") else ""))
    if "peers" in doc:
        lines.append(f"PEERS ({len(doc['peers'])})")
        lines += [f"  {p['node']:<16} {p['role'] or '?':<8} {_health(p):<10} {p['address']}  "
                  f"free {_free(p)}" + (f"  last seen {p['last_seen_s']}s ago" if p.get("last_seen_s") is not None
                                        else "") + (f"  ({p['error']})" if p.get("error") else "")
                  for p in doc["peers"]]
    lines.append(f"SANDBOXES ({len(doc['sandboxes'])})")
    lines += [f"  {s['id'][:13]}  {s['namespace']}/{s['name']}  opted_in={s['opted_in']}" for s in doc["sandboxes"]]
    lines.append(f"PLACEMENTS ({len(doc['placements'])})")
    lines += [f"  {(p['container_id'] or '(pending)')[:13]}  {p['name']:<16} {p['stage']:<5} {p['placement']:<14} "
              f"{p['reason']}" for p in doc["placements"]]
    lines.append(f"LEASES ({len(doc['leases'])})")
    lines += [f"  {lease['lease_id']}  {lease['state']:<8} {','.join(lease['devices'])}  "
              f"{lease['memory_bytes'] >> 20} MiB  {lease['compute_percent']}%  {lease['container_id'][:13]}"
              for lease in doc["leases"]]
    hosted = doc.get("hosted")
    if isinstance(hosted, str):
        lines.append(f"HOSTED (unknown: {hosted})")
    elif hosted is not None and (hosted or (node and "cpu" in str(node.get("role", "")))):
        lines.append(f"HOSTED ({len(hosted)})")
        reservations = {s["id"]: s["reservation"] for s in doc.get("shadows") or []}
        lines += [f"  {h['id'][:13]}  {h['name']:<16} {h['state']:<8} for {h['origin']}"
                  + (f"  reservation {r['name']} {r['state']}" if (r := reservations.get(h["id"])) and r["name"]
                     else "") for h in hosted]
    cc = doc.get("containerd_config")
    if cc:
        lines.append(f"CONTAINERD CONFIG  {cc['state']}" + (f"  ({cc['detail']})" if cc.get("detail") else "")
                     + (f"  made for containerd {cc['containerd']}" if cc.get("containerd") else ""))
    if "recent_errors" in doc:
        lines.append(f"RECENT ERRORS ({len(doc['recent_errors'])})")
        lines += [f"  {e.get('timestamp', '')[:19]}  {e.get('level', ''):<7} {e.get('event', '')}  "
                  + " ".join(f"{k}={v}" for k, v in e.items() if k not in ("timestamp", "level", "event", "logger"))
                  for e in doc["recent_errors"]]
    return "\n".join(lines)


def _health(peer: dict[str, Any]) -> str:
    if not peer["healthy"]:
        return "UNHEALTHY"
    return "draining" if peer.get("draining") else "healthy"


def _free(peer: dict[str, Any]) -> str:
    if peer.get("free_cpu_cores") is None:
        return "?"
    return f"{peer['free_cpu_cores']} CPU, {(peer['free_memory_bytes'] or 0) >> 20} MiB"


def explain_text(doc: dict[str, Any]) -> str:
    return "\n".join([f"container {doc['container_id']} ({doc['namespace']}/{doc['pod']}/{doc['name']})",
                      *(f"  - {line}" for line in doc["why"])])
