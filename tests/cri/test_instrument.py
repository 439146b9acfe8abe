"""What every CRI call's ``cri.call`` line says: the container or sandbox, the pod, and containerd's share."""

from __future__ import annotations

import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from structlog.testing import capture_logs

from shim.cri.instrument import Instrument, ids_of, note_pod
from shim.cri.methods import lookup
from shim.cri.passthrough import Upstream
from shim.errors import UnknownContainer
from shim.metrics import Metrics

RT = "/runtime.v1.RuntimeService/"


class Ctx:
    trailing_metadata = ()

    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None

    def send_initial_metadata(self, md):
        pass

    def set_trailing_metadata(self, md):
        pass


def _calls(logs):
    return [e for e in logs if e["event"] == "cri.call"]


def _upstream_seconds(metrics: Metrics, method: str) -> float:
    return metrics.registry.get_sample_value("weft_cri_upstream_duration_seconds_sum",
                                             {"method": method, "code": "OK"}) or 0.0


@pytest.mark.parametrize(("path", "request_", "field"), [
    pytest.param(RT + "StopContainer", cri.StopContainerRequest(container_id="c" * 64, timeout=3), "container_id",
                 id="container-verb"),
    pytest.param(RT + "RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id="s" * 64), "pod_sandbox_id",
                 id="sandbox-verb"),
    pytest.param(RT + "CreateContainer", cri.CreateContainerRequest(pod_sandbox_id="s" * 64), "pod_sandbox_id",
                 id="create-names-its-sandbox"),
])
def test_the_line_names_what_the_call_is_about(path, request_, field) -> None:
    inst = Instrument(Metrics())
    with capture_logs() as logs:
        inst.intercepted(lookup(path), lambda req, ctx: b"", request_.SerializeToString(), Ctx())
    (line,) = _calls(logs)
    assert line[field] == getattr(request_, field) and line["kind"] == "intercepted"


def test_a_verb_that_knows_the_pod_says_so_and_otherwise_the_node_is_asked() -> None:
    asked = []

    def pod_of(field, value):
        asked.append((field, value))
        return ("infer", "ml")

    inst = Instrument(Metrics(), pod_of=pod_of)
    request = cri.StartContainerRequest(container_id="c" * 64).SerializeToString()
    with capture_logs() as logs:
        inst.intercepted(lookup(RT + "StartContainer"), lambda req, ctx: b"", request, Ctx())

        def run(req, ctx):
            note_pod("web", "default")
            return b""

        inst.intercepted(lookup(RT + "RunPodSandbox"), run, cri.RunPodSandboxRequest().SerializeToString(), Ctx())
    first, second = _calls(logs)
    assert (first["pod"], first["namespace"]) == ("infer", "ml") and asked == [("container_id", "c" * 64)]
    assert (second["pod"], second["namespace"]) == ("web", "default")


def test_a_pod_nobody_knows_is_left_out_rather_than_guessed() -> None:
    inst = Instrument(Metrics(), pod_of=lambda field, value: None)
    with capture_logs() as logs:
        inst.intercepted(lookup(RT + "ContainerStatus"), lambda req, ctx: b"",
                         cri.ContainerStatusRequest(container_id="c" * 64).SerializeToString(), Ctx())
    assert "pod" not in _calls(logs)[0]


def test_a_failed_call_still_names_its_container() -> None:
    def fail(req, ctx):
        raise UnknownContainer("weft placed no such container")

    inst = Instrument(Metrics())
    with capture_logs() as logs:
        inst.intercepted(lookup(RT + "ContainerStatus"), fail,
                         cri.ContainerStatusRequest(container_id="d" * 64).SerializeToString(), Ctx())
    (line,) = _calls(logs)
    assert line["code"] == "NOT_FOUND" and line["container_id"] == "d" * 64


@pytest.fixture
def slow_containerd(tmp_path: Path):
    """A gRPC server on a unix socket that takes 30 ms to answer StopContainer."""
    def stop(request: bytes, context) -> bytes:
        time.sleep(0.03)
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("runtime.v1.RuntimeService", {
        "StopContainer": grpc.unary_unary_rpc_method_handler(stop)}),))
    sock = tmp_path / "containerd.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    up = Upstream(str(sock))
    yield up
    up.close()
    server.stop(None).wait()


def test_containerd_s_share_of_an_intercepted_call_is_recorded_apart(slow_containerd) -> None:
    metrics = Metrics()
    inst = Instrument(metrics)
    path = RT + "StopContainer"
    request = cri.StopContainerRequest(container_id="c" * 64).SerializeToString()

    def handler(req, ctx):
        slow_containerd.unary(path, req, ctx)
        time.sleep(0.02)  # weft's own work after containerd answered
        return b""

    with capture_logs() as logs:
        inst.intercepted(lookup(path), handler, request, Ctx())
    (line,) = _calls(logs)
    assert 30 <= line["upstream_ms"] < line["ms"]
    assert _upstream_seconds(metrics, "StopContainer") == pytest.approx(line["upstream_ms"] / 1e3, abs=1e-3)


def test_a_call_weft_answers_alone_spends_nothing_on_containerd() -> None:
    metrics = Metrics()
    inst = Instrument(metrics)
    with capture_logs() as logs:
        inst.intercepted(lookup(RT + "ContainerStatus"), lambda req, ctx: b"",
                         cri.ContainerStatusRequest(container_id="c" * 64).SerializeToString(), Ctx())
    assert _calls(logs)[0]["upstream_ms"] == 0


def test_a_passthrough_line_names_what_the_relay_read_off_the_wire() -> None:
    inst = Instrument(Metrics())
    method = lookup(RT + "StopPodSandbox")
    body = cri.StopPodSandboxRequest(pod_sandbox_id="s" * 64).SerializeToString()
    with capture_logs() as logs:
        inst.passthrough(method, grpc.StatusCode.OK, "", 0.001, ids_of(method, body))
        inst.passthrough(method, grpc.StatusCode.OK, "", 0.001, ids_of(method, body[:20]))  # a frame cut short
    whole, cut = _calls(logs)
    assert whole["kind"] == "passthrough" and whole["pod_sandbox_id"] == "s" * 64
    assert "pod_sandbox_id" not in cut  # nothing rather than half an ID


def test_methods_without_an_id_in_their_first_field_name_nothing() -> None:
    assert ids_of(lookup(RT + "Version"), b"\n\x02v1") == {}
    assert ids_of(lookup(RT + "ListContainers"), b"") == {}
