"""A host runs an origin's container as a shadow: real containerd on the host, mTLS between the two agents.

The origin side here is the mesh client the origin agent uses (its CRI verbs
for remote containers come next); everything on the host is real: the agent,
its containerd, the shadow sandbox and container, and its kubelet's view.
"""

from __future__ import annotations

import contextlib
import json
import platform
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from integration.fuzz.mesh_fixture import host_agent, make_mesh_certs
from shim._pb import mesh_pb2 as pb
from shim.crishared.labels import CPU_MAX_ANNOTATION
from shim.errors import WeftError
from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.containerd import Containerd
from shim.localfabric.waiting import wait_for
from shim.mesh.certs import load_node_tls
from shim.mesh.client import PeerClient
from shim.shadowhost.seccomp import NATIVE_ARCH


@contextlib.contextmanager
def _host_agent(containerd: Containerd, tmp_path: Path, origins: tuple[str, ...] = ("gpu-1",),
                mesh_config: str = "") -> Iterator[tuple[AgentProcess, dict[str, PeerClient]]]:
    """A real CPU host agent (cpu-1) and a mesh client for each origin, as that origin's agent dials it."""
    certs = tmp_path / "certs"
    make_mesh_certs(certs, (*origins, "cpu-1"))
    agent, port = host_agent(containerd, tmp_path, certs, origins, mesh_config)
    with agent, contextlib.ExitStack() as stack:
        clients = {o: stack.enter_context(PeerClient("cpu-1", f"127.0.0.1:{port}", load_node_tls(certs, o)))
                   for o in origins}
        yield agent, clients


@pytest.fixture
def host(containerd: Containerd, tmp_path: Path) -> Iterator[tuple[AgentProcess, PeerClient, Containerd]]:
    with _host_agent(containerd, tmp_path) as (agent, clients):
        yield agent, clients["gpu-1"], containerd


def _request(node: Containerd, key: str, command: list[str] | None = None, **container) -> pb.RunShadowRequest:
    sandbox = pods.sandbox_config("infer", node.pod_log_dir, cgroup_parent=node.cgroup_root)
    config = pods.container_config(key.split("/")[1], command or ["sh", "-c", "echo tokenizing; exec sleep 3600"],
                                   **container)
    res = config.linux.resources  # a host admits by limits: 0.1 core and container_config's 64 MiB
    res.cpu_period, res.cpu_quota = 100000, 10000
    return pb.RunShadowRequest(origin_node="gpu-1", origin_sandbox_id="origin-sb-1", key=key,
                               sandbox_config=sandbox.SerializeToString(), container_config=config.SerializeToString())


def _state(message: pb.ShadowState) -> cri.ContainerStatus:
    return cri.ContainerStatus.FromString(message.status)


class _Stream:
    """A server stream read on a thread of its own, so the test can wait for what it should bring."""

    def __init__(self, call) -> None:
        self.call = call
        self.messages: list = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._seen = 0
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for m in self.call:
                self.messages.append(m)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()

    def next(self, pred, what: str, timeout: float = 20.0):
        """The first message after the last one returned that ``pred`` accepts."""
        def found():
            for i in range(self._seen, len(self.messages)):
                if pred(self.messages[i]):
                    self._seen = i + 1
                    return self.messages[i]
            return None

        return wait_for(found, timeout=timeout, what=what)

    def close(self) -> None:
        self.call.cancel()
        self.ended.wait(10)


def test_a_shadow_runs_hidden_from_the_hosts_kubelet_and_goes_away(host) -> None:
    agent, client, node = host
    state = client.run_shadow(_request(node, "origin-sb-1/tokenize/0"))
    status = cri.ContainerStatus.FromString(state.status)
    assert status.state == cri.CONTAINER_CREATED  # as after CreateContainer: kubelet starts it next
    started = client.start_shadow("gpu-1", "origin-sb-1/tokenize/0")
    assert cri.ContainerStatus.FromString(started.status).state == cri.CONTAINER_RUNNING
    assert status.labels["weft.io/origin-node"] == "gpu-1"
    # Idempotent: the origin retrying gets the same shadow.
    assert client.run_shadow(_request(node, "origin-sb-1/tokenize/0")).shadow_container_id == state.shadow_container_id
    with node.channel() as direct, agent.channel() as kubelet:
        assert state.shadow_container_id in {c.id for c in cri_grpc.RuntimeServiceStub(direct).ListContainers(
            cri.ListContainersRequest()).containers}
        hidden = cri_grpc.RuntimeServiceStub(kubelet)
        wait_for(lambda: state.shadow_sandbox_id not in {s.id for s in hidden.ListPodSandbox(
            cri.ListPodSandboxRequest()).items}, what="the host's kubelet view to hide the shadow")
        assert state.shadow_container_id not in {c.id for c in hidden.ListContainers(
            cri.ListContainersRequest()).containers}
    # Low CPU weight, so the host's own pods win.
    out = node_exec(node, state.shadow_container_id, ["cat", "/sys/fs/cgroup/cpu/cpu.shares"])
    assert out.strip() == b"2"
    assert client.shadow_status("gpu-1", "origin-sb-1/tokenize/0").shadow_container_id == state.shadow_container_id
    assert client.remove_shadow("gpu-1", "origin-sb-1/tokenize/0") is True
    with node.channel() as direct:
        rt = cri_grpc.RuntimeServiceStub(direct)
        listed = rt.ListContainers(cri.ListContainersRequest()).containers
        assert state.shadow_container_id not in {c.id for c in listed}
        assert state.shadow_sandbox_id not in {s.id for s in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items}
    assert client.remove_shadow("gpu-1", "origin-sb-1/tokenize/0") is False


def node_exec(node: Containerd, cid: str, cmd: list[str]) -> bytes:
    with node.channel() as ch:
        req = cri.ExecSyncRequest(container_id=cid, cmd=cmd, timeout=10)
        return cri_grpc.RuntimeServiceStub(ch).ExecSync(req).stdout


def test_a_host_never_runs_what_must_not_be_rerouted(host) -> None:
    _, client, node = host
    req = _request(node, "origin-sb-1/priv/0")
    config = cri.ContainerConfig.FromString(req.container_config)
    config.linux.security_context.privileged = True
    req.container_config = config.SerializeToString()
    with pytest.raises(WeftError) as err:
        client.run_shadow(req)
    assert "privileged" in err.value.message
    with node.channel() as direct:
        assert not cri_grpc.RuntimeServiceStub(direct).ListContainers(cri.ListContainersRequest()).containers


def test_a_peer_cannot_ask_in_another_origins_name(host) -> None:
    _, client, node = host
    req = _request(node, "origin-sb-1/tokenize/0")
    req.origin_node = "cpu-1"  # gpu-1's certificate, claiming to be someone else
    with pytest.raises(WeftError) as err:
        client.run_shadow(req)
    assert err.value.code is grpc.StatusCode.PERMISSION_DENIED


def _shadow_ids(node: Containerd) -> set[str]:
    with node.channel() as direct:
        listed = cri_grpc.RuntimeServiceStub(direct).ListContainers(cri.ListContainersRequest())
        return {c.id for c in listed.containers}


def _exec(client: PeerClient, key: str, cmd: list[str]) -> cri.ExecSyncResponse:
    req = cri.ExecSyncRequest(container_id="origin-virtual-id", cmd=cmd, timeout=10)
    return cri.ExecSyncResponse.FromString(client.call("gpu-1", key, "ExecSync", req.SerializeToString(), 30))


WAIT_FOR_GO = ["sh", "-c", "echo started; while [ ! -e /tmp/go ]; do sleep 0.1; done; exit 3"]


def test_watch_sends_every_shadow_then_each_change_as_it_happens_and_heartbeats(host) -> None:
    _, client, node = host
    key = "origin-sb-1/tokenize/0"
    client.run_shadow(_request(node, key, WAIT_FOR_GO))
    started = client.start_shadow("gpu-1", key)
    watch = _Stream(client.watch("gpu-1", [key], 0.2))
    try:
        first = watch.next(lambda m: True, "the snapshot")
        assert (first.key, first.shadow_container_id) == (key, started.shadow_container_id)
        assert _state(first).state == cri.CONTAINER_RUNNING
        watch.next(lambda m: m.heartbeat and not m.key, "the heartbeat that closes the snapshot")
        watch.next(lambda m: m.heartbeat, "another heartbeat")
        assert _exec(client, key, ["touch", "/tmp/go"]).exit_code == 0
        exited = watch.next(lambda m: m.key == key, "the shadow's exit")
        assert _state(exited).state == cri.CONTAINER_EXITED
        assert _state(exited).exit_code == 3
        assert client.remove_shadow("gpu-1", key) is True
        gone = watch.next(lambda m: m.key == key, "the shadow gone")
        assert gone.gone and gone.shadow_container_id == started.shadow_container_id
        watch.next(lambda m: m.heartbeat, "heartbeats after the last shadow went")
    finally:
        watch.close()
    assert watch.error is not None and watch.error.code() is grpc.StatusCode.CANCELLED


def test_a_watch_with_an_idle_heartbeat_pushes_changes_and_the_hosts_state_and_stays_quiet_between(host) -> None:
    _, client, node = host
    key = "origin-sb-1/tokenize/0"
    client.run_shadow(_request(node, key, WAIT_FOR_GO))
    client.start_shadow("gpu-1", key)
    watch = _Stream(client.watch("gpu-1", [key], 0.2, idle_heartbeat_s=30.0))
    try:
        assert _state(watch.next(lambda m: m.key == key, "the snapshot")).state == cri.CONTAINER_RUNNING
        closing = watch.next(lambda m: m.heartbeat, "the heartbeat that closes the snapshot")
        assert closing.HasField("peer") and closing.peer.node == "cpu-1" and "cpu" in closing.peer.role
        assert closing.peer.allocatable.cpu_cores == 8  # the host's fixed capacity, as its Hello answers
        assert _exec(client, key, ["touch", "/tmp/go"]).exit_code == 0
        exited = watch.next(lambda m: m.key == key, "the shadow's exit, told at once", timeout=5.0)
        assert _state(exited).exit_code == 3
        seen = len(watch.messages)
        threading.Event().wait(3.0)
        # Nothing changed and the room did not move: no heartbeat before the idle interval (the exec's stream
        # and the exit may have moved nothing the host pushes).
        assert all(m.HasField("peer") and not m.key for m in watch.messages[seen:]), watch.messages[seen:]
        assert len(watch.messages) - seen <= 1
    finally:
        watch.close()


def test_watch_removes_the_shadows_an_origin_no_longer_owns(host) -> None:
    agent, client, node = host
    kept, orphan = "origin-sb-1/tokenize/0", "origin-sb-1/detok/0"
    kept_id = client.run_shadow(_request(node, kept)).shadow_container_id
    orphan_id = client.run_shadow(_request(node, orphan)).shadow_container_id
    client.start_shadow("gpu-1", orphan)
    watch = _Stream(client.watch("gpu-1", [kept], 0.2))
    try:
        watch.next(lambda m: m.heartbeat, "the end of the snapshot")
        assert [m.key for m in watch.messages if not m.heartbeat] == [kept]
    finally:
        watch.close()
    assert kept_id in _shadow_ids(node)
    assert orphan_id not in _shadow_ids(node)
    assert any(e.get("event") == "shadow.orphan_removed" and e.get("key") == orphan for e in agent.events())
    with pytest.raises(WeftError) as err:
        client.shadow_status("gpu-1", orphan)
    assert err.value.status is grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


def test_shadow_calls_reach_the_shadow_and_keep_its_low_cpu_weight(host) -> None:
    _, client, node = host
    key = "origin-sb-1/tokenize/0"
    client.run_shadow(_request(node, key))
    shadow = client.start_shadow("gpu-1", key).shadow_container_id

    out = _exec(client, key, ["sh", "-c", "echo hello from the host; exit 4"])
    assert (out.stdout, out.exit_code) == (b"hello from the host\n", 4)

    stats = cri.ContainerStatsResponse.FromString(client.call(
        "gpu-1", key, "ContainerStats", cri.ContainerStatsRequest(container_id="v").SerializeToString(), 30))
    assert stats.stats.attributes.id == shadow
    assert stats.stats.memory.working_set_bytes.value > 0

    update = cri.UpdateContainerResourcesRequest(container_id="v", linux=cri.LinuxContainerResources(
        cpu_shares=1024, memory_limit_in_bytes=128 << 20, cpu_period=100000, cpu_quota=50000))
    client.call("gpu-1", key, "UpdateContainerResources", update.SerializeToString(), 30)
    assert node_exec(node, shadow, ["cat", "/sys/fs/cgroup/cpu/cpu.shares"]).strip() == b"2"
    assert node_exec(node, shadow, ["cat", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]).strip() == \
        str(128 << 20).encode()

    client.call("gpu-1", key, "ReopenContainerLog",
                cri.ReopenContainerLogRequest(container_id="v").SerializeToString(), 30)
    client.call("gpu-1", key, "StopContainer", cri.StopContainerRequest(container_id="v", timeout=0)
                .SerializeToString(), 30)
    assert _state(client.shadow_status("gpu-1", key)).state == cri.CONTAINER_EXITED

    with pytest.raises(WeftError) as err:
        client.call("gpu-1", key, "RemoveContainer", cri.RemoveContainerRequest(container_id="v")
                    .SerializeToString(), 30)
    assert err.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert "RemoveContainer" in err.value.message
    assert shadow in _shadow_ids(node)
    with pytest.raises(WeftError) as err:
        client.call("gpu-1", "origin-sb-1/nothing/0", "ExecSync", cri.ExecSyncRequest(cmd=["true"])
                    .SerializeToString(), 30)
    assert err.value.status is grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


LINES_THEN_WAIT = ["sh", "-c", 'i=0; while [ $i -lt 3000 ]; do echo "line $i"; i=$((i+1)); done; '
                   'while [ ! -e /tmp/go ]; do sleep 0.1; done; '
                   'i=0; while [ $i -lt 500 ]; do echo "after $i"; i=$((i+1)); done']


def _joined(chunks: list[pb.LogChunk], start: int) -> bytes:
    """The chunks' bytes, checked to follow each other from ``start`` with nothing missing or repeated."""
    at = start
    for c in chunks:
        assert c.offset == at
        at += len(c.data)
    return b"".join(c.data for c in chunks)


def _messages(log: bytes) -> list[str]:
    """What the container printed, from CRI log lines (``<time> <stream> <tag> <message>``)."""
    return [line.split(b" ", 3)[3].decode() for line in log.splitlines()]


def _cpu_quota(node: Containerd, cid: str) -> int:
    """The CFS quota of a container's cgroup as the container sees it (cgroup v1 or v2); -1: none."""
    out = node_exec(node, cid, ["sh", "-c", "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || "
                                            "cut -d' ' -f1 /sys/fs/cgroup/cpu.max"]).strip()
    return -1 if out in (b"-1", b"max") else int(out)


def _spec_linux(node: Containerd, cid: str) -> dict:
    """The ``linux`` part of a container's OCI spec, as containerd's verbose status gives it."""
    with node.channel() as direct:
        resp = cri_grpc.RuntimeServiceStub(direct).ContainerStatus(
            cri.ContainerStatusRequest(container_id=cid, verbose=True))
    return json.loads(resp.info["info"])["runtimeSpec"]["linux"]


def _spec_resources(node: Containerd, cid: str) -> dict:
    return _spec_linux(node, cid)["resources"]


def test_a_shadow_is_made_without_its_cpu_quota_and_given_it_once_it_runs(host) -> None:
    _, client, node = host
    key = "origin-sb-1/tokenize/0"
    made = client.run_shadow(_request(node, key)).shadow_container_id
    # runc sets a container up inside its cgroup (the host's seccomp profile compiled there): not throttled
    resources = _spec_resources(node, made)
    assert not resources.get("cpu", {}).get("quota")
    assert resources["memory"]["limit"] == 64 << 20  # the memory limit holds from the start
    client.start_shadow("gpu-1", key)
    wait_for(lambda: _cpu_quota(node, made) == 10000, timeout=10, what="the shadow's CPU quota once it runs")
    assert _spec_resources(node, made)["cpu"]["quota"] == 10000

    started = _request(node, "origin-sb-1/started/0")  # made and started by one RunShadow
    started.start = True
    at_once = client.run_shadow(started).shadow_container_id
    wait_for(lambda: _cpu_quota(node, at_once) == 10000, timeout=10, what="the quota of a shadow started at once")


def test_a_resize_before_the_start_wins_over_the_quota_the_start_leaves_to_set(host) -> None:
    _, client, node = host
    key = "origin-sb-1/tokenize/0"
    made = client.run_shadow(_request(node, key)).shadow_container_id
    update = cri.UpdateContainerResourcesRequest(container_id="v", linux=cri.LinuxContainerResources(
        memory_limit_in_bytes=64 << 20, cpu_period=100000, cpu_quota=5000))
    client.call("gpu-1", key, "UpdateContainerResources", update.SerializeToString(), 30)
    client.start_shadow("gpu-1", key)
    assert _cpu_quota(node, made) == 5000
    time.sleep(6)  # past the host's next upkeep round (5 s), whose settle must not put the deferred quota back
    assert _cpu_quota(node, made) == 5000


def test_a_shadow_started_while_its_hosts_agent_was_down_gets_its_cpu_quota_when_it_is_back(
        containerd: Containerd, tmp_path: Path) -> None:
    with _host_agent(containerd, tmp_path) as (agent, clients):
        made = clients["gpu-1"].run_shadow(_request(containerd, "origin-sb-1/tokenize/0")).shadow_container_id
        agent.stop()
        with containerd.channel() as direct:  # as if the agent died between the start and the limit
            direct_rt = cri_grpc.RuntimeServiceStub(direct)
            direct_rt.StartContainer(cri.StartContainerRequest(container_id=made))
            assert direct_rt.ContainerStatus(cri.ContainerStatusRequest(container_id=made)).status.annotations[
                CPU_MAX_ANNOTATION] == "10000 100000"
        assert _cpu_quota(containerd, made) == -1
        agent.start()
        wait_for(lambda: _cpu_quota(containerd, made) == 10000, timeout=20,
                 what="the quota a running shadow was left without, set by the restarted agent")


def _spec_seccomp(node: Containerd, cid: str) -> dict:
    return _spec_linux(node, cid)["seccomp"]


def test_a_shadow_that_asked_for_no_seccomp_profile_gets_the_runtime_default_for_the_hosts_own_arch(host) -> None:
    _, client, node = host
    native = NATIVE_ARCH[platform.machine()]
    first = client.run_shadow(_request(node, "origin-sb-1/first/0")).shadow_container_id
    second = client.run_shadow(_request(node, "origin-sb-1/second/0")).shadow_container_id
    asked = _request(node, "origin-sb-1/asked/0")
    config = cri.ContainerConfig.FromString(asked.container_config)
    config.linux.security_context.seccomp.profile_type = cri.SecurityProfile.RuntimeDefault
    asked.container_config = config.SerializeToString()
    explicit = client.run_shadow(asked).shadow_container_id

    learnt_from, narrowed, as_asked = (_spec_seccomp(node, c) for c in (first, second, explicit))
    assert native in learnt_from["architectures"] and len(learnt_from["architectures"]) > 1  # containerd's own
    assert narrowed["architectures"] == [native]
    # The same profile in all else: calls allowed with the same arguments, default action, errno, flags.
    assert {**narrowed, "architectures": None} == {**learnt_from, "architectures": None}
    assert narrowed["defaultAction"] == "SCMP_ACT_ERRNO" and narrowed["syscalls"]
    assert as_asked["architectures"] == learnt_from["architectures"]  # RuntimeDefault asked is given as it is
    client.start_shadow("gpu-1", "origin-sb-1/second/0")
    status = node_exec(node, second, ["cat", "/proc/self/status"]).decode()
    assert "Seccomp:\t2" in status, status  # filtered


def test_the_log_streams_as_it_grows_from_any_offset_and_ends_after_the_exit(host) -> None:
    _, client, node = host
    key = "origin-sb-1/tokenize/0"
    client.run_shadow(_request(node, key, LINES_THEN_WAIT))
    client.start_shadow("gpu-1", key)
    stream = _Stream(client.stream_log("gpu-1", key, 0))
    try:
        wait_for(lambda: b"line 2999\n" in b"".join(c.data for c in stream.messages), what="the first 3000 lines")
        assert not stream.ended.is_set()  # still running: the stream waits for more
        assert _exec(client, key, ["touch", "/tmp/go"]).exit_code == 0
        wait_for(stream.ended.is_set, what="the log stream to end after the container exited")
    finally:
        stream.close()
    assert stream.error is None
    whole = _joined(stream.messages, 0)
    assert _messages(whole) == [f"line {i}" for i in range(3000)] + [f"after {i}" for i in range(500)]
    assert _state(client.shadow_status("gpu-1", key)).state == cri.CONTAINER_EXITED

    middle = whole.index(b"\n", len(whole) // 2) + 1
    rest = _Stream(client.stream_log("gpu-1", key, middle))
    wait_for(rest.ended.is_set, what="a stream of an exited container's log to end")
    assert rest.error is None
    assert _joined(rest.messages, middle) == whole[middle:]


def _volumes(config: bytes = b"level=info\n") -> list[pb.Volume]:
    return [pb.Volume(container_path="/etc/app", files=[
                pb.VolumeFile(path="app.conf", data=config, mode=0o644),
                pb.VolumeFile(path="keys/token", data=b"s3cret", mode=0o600)]),
            pb.Volume(container_path="/etc/motd", single_file=True, files=[pb.VolumeFile(data=b"hello\n")])]


def _files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if not p.is_dir()] if path.exists() else []


def test_copied_volumes_are_mounted_read_only_and_follow_updates(host) -> None:
    agent, client, node = host
    key = "origin-sb-1/tokenize/0"
    req = _request(node, key)
    req.volumes.extend(_volumes())
    client.run_shadow(req)
    client.start_shadow("gpu-1", key)

    assert _exec(client, key, ["cat", "/etc/app/app.conf"]).stdout == b"level=info\n"
    assert _exec(client, key, ["cat", "/etc/motd"]).stdout == b"hello\n"
    assert _exec(client, key, ["stat", "-c", "%a", "/etc/app/keys/token"]).stdout.strip() == b"600"
    refused = _exec(client, key, ["sh", "-c", "echo x > /etc/app/app.conf"])
    assert refused.exit_code != 0 and b"Read-only file system" in refused.stderr

    updated = _volumes(b"level=debug\n")
    updated[0].files[1].CopyFrom(pb.VolumeFile(path="extra.conf", data=b"new\n"))  # keys/token goes
    assert client.sync_volumes("gpu-1", key, updated) == 3
    assert _exec(client, key, ["cat", "/etc/app/app.conf"]).stdout == b"level=debug\n"
    assert _exec(client, key, ["cat", "/etc/app/extra.conf"]).stdout == b"new\n"
    assert _exec(client, key, ["ls", "/etc/app"]).stdout.split() == [b"app.conf", b"extra.conf"]

    assert client.remove_shadow("gpu-1", key) is True
    assert _files_under(agent.state_dir / "shadow-volumes") == []
    assert _files_under(agent.state_dir / "shadow-logs") == []


def _as_an_older_origin(client: PeerClient, certs: Path, method: str, request) -> tuple[grpc.StatusCode, str]:
    """``method`` as an origin of the weft before volume streams made it: the volumes inside the one message."""
    tls = load_node_tls(certs, "gpu-1")
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca_pem, private_key=tls.key_pem,
                                         certificate_chain=tls.cert_pem)
    with grpc.secure_channel(client.address, creds, options=[("grpc.ssl_target_name_override", "cpu-1"),
                                                              ("grpc.max_send_message_length", 80 << 20)]) as ch:
        try:
            ch.unary_unary(f"/weft.mesh.v1.Mesh/{method}")(request.SerializeToString(), timeout=300)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details() or ""


def test_an_older_origins_volumes_are_taken_inside_the_request_up_to_the_message_limit(host, tmp_path: Path) -> None:
    """A rolling upgrade, the host first: an origin not yet upgraded sends its volumes as it did."""
    agent, client, node = host
    key = "origin-sb-1/tokenize/0"
    req = _request(node, key)
    req.volumes.extend(_volumes())
    assert _as_an_older_origin(client, tmp_path / "certs", "RunShadow", req) == (grpc.StatusCode.OK, "")
    client.start_shadow("gpu-1", key)
    assert _exec(client, key, ["cat", "/etc/app/app.conf"]).stdout == b"level=info\n"
    synced = pb.SyncVolumesRequest(origin_node="gpu-1", key=key, volumes=_volumes(b"level=debug\n"))
    assert _as_an_older_origin(client, tmp_path / "certs", "SyncVolumes", synced) == (grpc.StatusCode.OK, "")
    assert _exec(client, key, ["cat", "/etc/app/app.conf"]).stdout == b"level=debug\n"
    assert client.remove_shadow("gpu-1", key) is True

    big = _request(node, "origin-sb-1/tokenize/1")
    big.volumes.add(container_path="/etc/big", files=[pb.VolumeFile(path="blob", data=b"b" * (5 << 20))])
    code, details = _as_an_older_origin(client, tmp_path / "certs", "RunShadow", big)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and f"vs. {4 << 20})" in details, details
    assert _shadow_ids(node) == set() and _files_under(agent.state_dir / "shadow-volumes") == []


@pytest.mark.parametrize(("path", "where"), [
    ("../escape", "/etc/app"), ("/etc/shadow", "/etc/app"), ("a/../../escape", "/etc/app"), ("a\0b", "/etc/app"),
    ("ok", "etc/relative"), ("ok", "/etc/../root")],
    ids=["dotdot", "absolute", "dotdot-inside", "nul", "relative-mount", "dotdot-mount"])
def test_volume_paths_that_escape_are_refused(host, path: str, where: str) -> None:
    agent, client, node = host
    req = _request(node, "origin-sb-1/tokenize/0")
    req.volumes.append(pb.Volume(container_path=where, files=[pb.VolumeFile(path=path, data=b"x")]))
    with pytest.raises(WeftError) as err:
        client.run_shadow(req)
    assert err.value.status is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "volume" in err.value.message
    assert _shadow_ids(node) == set()
    assert _files_under(agent.state_dir / "shadow-volumes") == []
    assert not (agent.state_dir / "escape").exists() and not (agent.state_dir.parent / "escape").exists()


def test_a_mount_in_the_container_config_is_still_refused(host) -> None:
    _, client, node = host
    req = _request(node, "origin-sb-1/tokenize/0")
    config = cri.ContainerConfig.FromString(req.container_config)
    config.mounts.append(cri.Mount(container_path="/host", host_path="/"))
    req.container_config = config.SerializeToString()
    with pytest.raises(WeftError) as err:
        client.run_shadow(req)
    assert err.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert _shadow_ids(node) == set()


def test_a_hosts_hello_counts_its_own_pods_requests_and_what_it_hosts(host) -> None:
    agent, client, node = host
    me = pb.PeerState(node="gpu-1", role="gpu")
    assert client.hello(me).hosted_limits.memory_bytes == 0
    with node.channel() as direct:  # one of the host's own pods: 0.5 core requested, 32 MiB limit
        rt = cri_grpc.RuntimeServiceStub(direct)
        sandbox = pods.sandbox_config("own", node.pod_log_dir, cgroup_parent=node.cgroup_root)
        sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox)).pod_sandbox_id
        config = pods.container_config("own", ["sleep", "3600"])
        config.linux.resources.cpu_shares = 512
        config.linux.resources.memory_limit_in_bytes = 32 << 20
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=config,
                                                            sandbox_config=sandbox)).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    key = "origin-sb-1/tokenize/0"
    req = _request(node, key)
    config = cri.ContainerConfig.FromString(req.container_config)
    config.linux.resources.cpu_quota, config.linux.resources.cpu_period = 150000, 100000
    config.linux.resources.memory_limit_in_bytes = 256 << 20
    req.container_config = config.SerializeToString()
    client.run_shadow(req)
    client.start_shadow("gpu-1", key)

    state = wait_for(lambda: (s := client.hello(me)).hosted_limits.memory_bytes and s,
                     what="the hosted shadow in the host's books")
    assert (state.hosted_limits.cpu_cores, state.hosted_limits.memory_bytes) == (1.5, 256 << 20)
    assert (state.own_requests.cpu_cores, state.own_requests.memory_bytes) == (0.5, 32 << 20)
    assert "weft_shadows_hosted 1.0" in agent.metrics_text()


FAST_FENCE = "fence_timeout = 3\nloss_timeout = 10\nhello_interval = 1\nheartbeat_interval = 0.5\n"


def test_an_origin_that_falls_silent_has_its_shadows_killed_and_one_that_talks_keeps_them(
        containerd: Containerd, tmp_path: Path) -> None:
    with _host_agent(containerd, tmp_path, ("gpu-1", "gpu-2"), FAST_FENCE) as (agent, clients):
        talking, silent = clients["gpu-1"], clients["gpu-2"]
        stop = threading.Event()

        def hello_loop() -> None:  # what gpu-1's agent does every hello_interval
            while not stop.is_set():
                with contextlib.suppress(WeftError):
                    talking.hello(pb.PeerState(node="gpu-1", role="gpu"))
                stop.wait(0.5)

        hellos = threading.Thread(target=hello_loop, daemon=True)
        hellos.start()
        try:
            kept = talking.run_shadow(_request(containerd, "origin-sb-1/tokenize/0"))
            talking.start_shadow("gpu-1", "origin-sb-1/tokenize/0")
            req = _request(containerd, "origin-sb-2/tokenize/0")
            req.origin_node, req.origin_sandbox_id = "gpu-2", "origin-sb-2"
            fenced = silent.run_shadow(req)
            silent.start_shadow("gpu-2", "origin-sb-2/tokenize/0")
            # gpu-2 says nothing more and holds no call or stream open (an open one is its live connection,
            # which counts as contact).
            exited = wait_for(lambda: (s := _node_status(containerd, fenced.shadow_container_id)).state
                              == cri.CONTAINER_EXITED and s, timeout=30,
                              what="gpu-2's shadow killed for its silence")
            assert exited.exit_code == 137  # SIGKILL: no grace for a fenced copy
            # gpu-1's shadow is older than gpu-2's: only gpu-1's Hellos kept it alive.
            assert _node_state(containerd, kept.shadow_container_id) == cri.CONTAINER_RUNNING
        finally:
            stop.set()
            hellos.join()
        assert fenced.shadow_container_id in _shadow_ids(containerd)  # killed, not removed: the origin removes it
        events = [e for e in agent.events() if e.get("event") == "shadow.fenced"]
        assert [(e["origin"], e["key"], e["container_id"]) for e in events] == [
            ("gpu-2", "origin-sb-2/tokenize/0", fenced.shadow_container_id)]
        assert events[0]["silent_s"] >= 3  # the fence timeout (the logged figure is rounded)
        assert 'weft_shadows_fenced_total{peer="gpu-2"} 1.0' in agent.metrics_text()


def _node_status(node: Containerd, cid: str) -> cri.ContainerStatus:
    with node.channel() as direct:
        return cri_grpc.RuntimeServiceStub(direct).ContainerStatus(
            cri.ContainerStatusRequest(container_id=cid)).status


def _node_state(node: Containerd, cid: str) -> int:
    with node.channel() as direct:
        return cri_grpc.RuntimeServiceStub(direct).ContainerStatus(
            cri.ContainerStatusRequest(container_id=cid)).status.state


def test_a_restarted_host_still_fences_the_shadows_of_an_origin_that_never_comes_back(
        containerd: Containerd, tmp_path: Path) -> None:
    with _host_agent(containerd, tmp_path, mesh_config=FAST_FENCE) as (agent, clients):
        state = clients["gpu-1"].run_shadow(_request(containerd, "origin-sb-1/tokenize/0"))
        clients["gpu-1"].start_shadow("gpu-1", "origin-sb-1/tokenize/0")
        agent.stop()
        agent.start()
        wait_for(lambda: _node_state(containerd, state.shadow_container_id) == cri.CONTAINER_EXITED, timeout=30,
                 what="the shadow of an origin silent since before the restart to be fenced")
        # The fencer logs once StopContainer has returned, so the line may come a moment after the exit shows.
        wait_for(lambda: [e["key"] for e in agent.events() if e.get("event") == "shadow.fenced"]
                 == ["origin-sb-1/tokenize/0"], timeout=10, what="the fence in the agent's log, once")


def test_the_host_keeps_answering_after_many_origin_streams_come_and_go(host) -> None:
    _, client, node = host
    key = "origin-sb-1/tokenize/0"
    client.run_shadow(_request(node, key))
    client.start_shadow("gpu-1", key)
    # More streams than the mesh server has workers: each one must end when its origin hangs up.
    for _ in range(40):
        watch = _Stream(client.watch("gpu-1", [key], 5.0))
        watch.next(lambda m: m.heartbeat, "a Watch's snapshot")
        watch.close()
        log = _Stream(client.stream_log("gpu-1", key, 0))
        log.next(lambda m: m.data, "the log's first chunk")
        log.close()
        assert watch.ended.is_set() and log.ended.is_set()
    assert client.hello(pb.PeerState(node="gpu-1", role="gpu")).node == "cpu-1"
    assert _state(client.shadow_status("gpu-1", key)).state == cri.CONTAINER_RUNNING
