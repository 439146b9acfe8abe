"""A shadow's log cannot fill its host's disk.

The attack: a rerouted container that writes as fast as it can (``yes``),
its log streamed to the origin as it runs, or streamed by no one (the origin
away). The host's copy of the log keeps only what the origin may still need
(the last MiB sent and at most 64 MiB unsent); before, it kept every byte
(563 MiB in 8 s in the review that found it).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri

from integration.fuzz.mesh_fixture import MESH, MeshHost, run_shadow_request
from shim._pb import mesh_pb2 as pb
from shim.localfabric.waiting import wait_for
from shim.shadowhost.logs import KEEP_SENT, MAX_BACKLOG
from shim.shadowhost.side import LOG_CAP_S

RUN_S = 20.0


def _drain(call, received: list[int]) -> None:
    try:
        for chunk in call:
            received[0] += len(pb.LogChunk.FromString(chunk).data)
    except grpc.RpcError:
        pass  # cancelled at the end


def _drain_watch(call) -> None:
    try:
        for _ in call:
            pass
    except grpc.RpcError:
        pass  # cancelled at the end


def _still_writing(mesh: MeshHost, container_id: str) -> bool:
    """True while the writer runs; an AssertionError naming why once it does not (fenced, say)."""
    from cri_api.v1 import api_pb2_grpc as cri_grpc

    with mesh.containerd.channel() as c:
        status = cri_grpc.RuntimeServiceStub(c).ContainerStatus(
            cri.ContainerStatusRequest(container_id=container_id), timeout=10).status
    if status.state != cri.CONTAINER_RUNNING:
        fenced = [m for m in mesh.agent.metrics_text().splitlines() if m.startswith("weft_shadows_fenced_total")]
        raise AssertionError(f"the writer stopped before its log passed the cap: "
                             f"{cri.ContainerState.Name(status.state)}, reason {status.reason!r}, fenced: {fenced}")
    return True


def _yes(mesh: MeshHost, key: str) -> pb.RunShadowRequest:
    req = run_shadow_request(mesh.containerd, "gpu-1", key, sandbox=key.split("/")[0])
    config = cri.ContainerConfig.FromString(req.container_config)
    config.command[:] = ["yes"]
    config.linux.resources.cpu_quota = 100000  # a whole core
    req.container_config, req.start = config.SerializeToString(), True
    return req


def _unstarved(container_id: str) -> None:
    """The writer at a local container's CPU weight rather than a shadow's lowest: on a loaded machine (a CI
    run's other workers) it would otherwise write too little to reach the cap, and these tests are about the
    cap, not the weight (a shadow's weight is ``test_kube_hosted``'s)."""
    found = list(Path("/sys/fs/cgroup/cpu/weft-shadows").glob(f"*/{container_id}/cpu.shares"))
    assert found, container_id
    for shares in (found[0], found[0].parent.parent / "cpu.shares"):  # the container's, and its pod's
        shares.write_text("1024\n")


def test_a_fast_writer_does_not_fill_the_hosts_disk_with_its_log(mesh: MeshHost) -> None:
    key = "origin-sb-yes/yes/0"
    req = _yes(mesh, key)
    received = [0]
    with mesh.channel("gpu-1") as ch:
        state = pb.ShadowState.FromString(ch.unary_unary(MESH + "RunShadow")(req.SerializeToString(), timeout=120))
        _unstarved(state.shadow_container_id)
        log = Path(cri.ContainerStatus.FromString(state.status).log_path)
        stream = ch.unary_stream(MESH + "StreamLog")(pb.LogRequest(origin_node="gpu-1", key=key).SerializeToString())
        reader = threading.Thread(target=_drain, args=(stream, received), daemon=True)
        reader.start()
        try:
            time.sleep(RUN_S)
            written = log.stat().st_size
            allocated = log.stat().st_blocks * 512
        finally:
            stream.cancel()
            ch.unary_unary(MESH + "RemoveShadow")(pb.ShadowRef(origin_node="gpu-1", key=key).SerializeToString(),
                                                  timeout=120)
    print(f"\nyes for {RUN_S:.0f} s: {written >> 20} MiB written, {allocated >> 20} MiB on disk, "
          f"{received[0] >> 20} MiB received by the origin")
    assert written > KEEP_SENT + MAX_BACKLOG + (16 << 20), "the writer was too slow to show anything"
    assert allocated <= KEEP_SENT + MAX_BACKLOG + (4 << 20)


def test_a_fast_writer_no_origin_reads_does_not_fill_the_hosts_disk_either(mesh: MeshHost) -> None:
    key = "origin-sb-idle/yes/0"
    with mesh.channel("gpu-1") as ch:
        state = pb.ShadowState.FromString(ch.unary_unary(MESH + "RunShadow")(_yes(mesh, key).SerializeToString(),
                                                                             timeout=120))
        # No StreamLog, but the origin is still there: a Watch keeps it in contact, so that a machine too slow
        # to write past the cap within a fence timeout does not see its writer fenced (the host stops the
        # shadows of an origin silent that long) rather than capped.
        watch = ch.unary_stream(MESH + "Watch")(pb.WatchRequest(origin_node="gpu-1", keys=[key],
                                                                heartbeat_s=1).SerializeToString())
        threading.Thread(target=_drain_watch, args=(watch,), daemon=True).start()
        _unstarved(state.shadow_container_id)
        log = Path(cri.ContainerStatus.FromString(state.status).log_path)
        try:
            # The host's timer alone keeps the log to its cap. Past the cap by a margin, however fast this
            # machine lets the writer go, then one more round of the timer.
            began = time.monotonic()
            wait_for(lambda: _still_writing(mesh, state.shadow_container_id) and log.exists()
                     and log.stat().st_size > MAX_BACKLOG + (32 << 20), timeout=180,
                     what="the log past its cap", every=0.5)
            time.sleep(LOG_CAP_S + 1)
            written = log.stat().st_size
            allocated = log.stat().st_blocks * 512
            rate = written / (time.monotonic() - began)
        finally:
            watch.cancel()
            ch.unary_unary(MESH + "RemoveShadow")(pb.ShadowRef(origin_node="gpu-1", key=key).SerializeToString(),
                                                  timeout=120)
    print(f"\nyes, no reader: {written >> 20} MiB written, {allocated >> 20} MiB on disk")
    # The cap, and what the writer adds between two rounds of the timer.
    assert allocated <= MAX_BACKLOG + rate * (LOG_CAP_S + 1), (written, allocated)

