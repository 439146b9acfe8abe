"""``weft status`` in a terminal: node, peers and their health, sandboxes, placements, leases, hosted, recent errors."""

from __future__ import annotations

from shim import status

DOC = {
    "node": {"name": "gpu-1", "role": "gpu", "mesh_address": "10.0.0.1:7443", "draining": False, "gpu_broker": True},
    "peers": [
        {"node": "cpu-1", "address": "10.0.0.2:7443", "role": "cpu", "healthy": True, "draining": True,
         "free_cpu_cores": 3.5, "free_memory_bytes": 8 << 30, "last_seen_s": 0.4, "error": None},
        {"node": "cpu-2", "address": "10.0.0.3:7443", "role": "cpu", "healthy": False, "draining": False,
         "free_cpu_cores": None, "free_memory_bytes": None, "last_seen_s": None, "error": "connection refused"},
    ],
    "sandboxes": [{"id": "a" * 64, "opted_in": True, "name": "infer", "namespace": "default",
                   "runtime_handler": "weft"}],
    "placements": [
        {"container_id": "b" * 64, "name": "prepare", "stage": "cpu", "placement": "remote:cpu-1",
         "reason": "rerouted"},
        {"container_id": "c" * 64, "name": "tokenize", "stage": "cpu", "placement": "local",
         "reason": "no-peer-fits"},
    ],
    "leases": [],
    "hosted": [],
    "recent_errors": [{"timestamp": "2026-01-01T00:00:00.123Z", "level": "warning", "event": "peer.lost",
                       "logger": "weft.mesh", "peer": "cpu-2", "error": "connection refused"}],
}


def test_the_table_shows_every_section_a_running_agent_reports() -> None:
    text = status.table(DOC)
    assert "NODE  gpu-1  role=gpu  mesh=10.0.0.1:7443  gpu-broker" in text
    assert "PEERS (2)" in text
    cpu1, cpu2 = (line for line in text.splitlines() if line.startswith("  cpu-"))
    assert "draining" in cpu1 and "3.5 CPU, 8192 MiB" in cpu1
    assert "UNHEALTHY" in cpu2 and "(connection refused)" in cpu2
    assert "remote:cpu-1   rerouted" in text and "local          no-peer-fits" in text
    assert "RECENT ERRORS (1)" in text
    assert "2026-01-01T00:00:00  warning peer.lost  peer=cpu-2 error=connection refused" in text
    assert "HOSTED" not in text  # a GPU node hosts nothing; no empty section for it


def test_a_host_shows_what_it_hosts_and_that_it_drains() -> None:
    doc = {**DOC, "node": {**DOC["node"], "name": "cpu-1", "role": "cpu", "draining": True, "gpu_broker": False},
           "hosted": [{"id": "d" * 64, "name": "prepare", "origin": "gpu-1", "state": "running"}]}
    text = status.table(doc)
    assert "DRAINING" in text.splitlines()[0]
    assert "HOSTED (1)" in text and "prepare          running  for gpu-1" in text


def test_state_files_alone_give_the_three_sections_they_hold() -> None:
    text = status.table({k: DOC[k] for k in ("sandboxes", "placements", "leases")})
    assert text.splitlines()[0] == "SANDBOXES (1)"
    assert "PEERS" not in text and "RECENT ERRORS" not in text
