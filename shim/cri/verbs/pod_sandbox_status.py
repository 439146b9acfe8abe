"""PodSandboxStatus: a pod's remote containers listed with its local ones, where containerd lists them.

containerd 1.7 and 2.x answer with the statuses of the pod's containers
beside the sandbox's (``containers_statuses``, with a ``timestamp``), and a
kubelet with evented PLEG takes that list as the pod's containers whenever
the timestamp is set. containerd has never heard of a remote container, so
weft adds them; without that, kubelet would take them for gone and start
them again. Intercepted only while this node has remote containers, and then
only for a sandbox that has some (``pick``); an answer without the list
(containerd 1.6) is left as it is, since kubelet then lists containers itself.
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import with_remote_statuses

PATH = "/runtime.v1.RuntimeService/PodSandboxStatus"


def route(fabric: Fabric) -> Route:
    def handle(request: bytes, context) -> bytes:
        response = fabric.upstream.unary(PATH, request, context)
        try:
            sandbox_id = cri.PodSandboxStatusRequest.FromString(request).pod_sandbox_id
            out = cri.PodSandboxStatusResponse.FromString(response)
        except DecodeError:
            return response
        if not out.timestamp or not with_remote_statuses(fabric, sandbox_id, out.containers_statuses):
            return response
        return out.SerializeToString()

    def pick(body: bytes) -> bool:
        return bool(fabric.remotes.in_sandbox(cri.PodSandboxStatusRequest.FromString(body).pod_sandbox_id))

    return Route(handle, when=lambda: fabric.remotes.present, pick=pick)
