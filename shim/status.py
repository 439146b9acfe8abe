"""``weft status`` and ``weft explain``: read from the running agent or from the state files.

With ``--socket`` the agent answers (and asks its broker for live leases);
with ``--state-dir`` the files are read directly (``agent.db``, and
``broker.db`` when the broker keeps its state there too), which works while
the agent is down. Both give the same JSON document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from shim.cri.methods import ADMIN_EXPLAIN, ADMIN_STATUS
from shim.errors import UnknownContainer, WeftError
from shim.state import report
from shim.state.agent import AgentStore
from shim.state.leases import LeaseStore


def from_agent(socket: Path, explain: str | None = None) -> dict[str, Any]:
    import json

    with grpc.insecure_channel(f"unix://{socket}") as ch:
        path, body = (ADMIN_EXPLAIN, explain.encode()) if explain is not None else (ADMIN_STATUS, b"")
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
    lines = [f"SANDBOXES ({len(doc['sandboxes'])})"]
    lines += [f"  {s['id'][:13]}  {s['namespace']}/{s['name']}  opted_in={s['opted_in']}" for s in doc["sandboxes"]]
    lines.append(f"PLACEMENTS ({len(doc['placements'])})")
    lines += [f"  {(p['container_id'] or '(pending)')[:13]}  {p['name']:<16} {p['stage']:<5} {p['placement']:<8} "
              f"{p['reason']}" for p in doc["placements"]]
    lines.append(f"LEASES ({len(doc['leases'])})")
    lines += [f"  {lease['lease_id']}  {lease['state']:<8} {','.join(lease['devices'])}  "
              f"{lease['memory_bytes'] >> 20} MiB  {lease['compute_percent']}%  {lease['container_id'][:13]}"
              for lease in doc["leases"]]
    return "\n".join(lines)


def explain_text(doc: dict[str, Any]) -> str:
    return "\n".join([f"container {doc['container_id']} ({doc['namespace']}/{doc['pod']}/{doc['name']})",
                      *(f"  - {line}" for line in doc["why"])])
