"""PullImage: remember which image kubelet pulled with which credentials, for a host's pull.

A rerouted container's image must be pulled on its host with the
credentials kubelet gave the origin, and kubelet's CreateContainer names the
image by the ID PullImage returned, which means nothing to another node. So
while this node has a mesh, PullImage is intercepted: forwarded unchanged,
and the image name, the ID containerd answered and the AuthConfig are kept
in memory (never on disk, never logged), for the last ``MAX_IMAGES`` images.
"""

from __future__ import annotations

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim.cri.fabric import Fabric
from shim.cri.route import Route

PATH = "/runtime.v1.ImageService/PullImage"
def route(fabric: Fabric) -> Route:
    def pull_image(request: bytes, context: grpc.ServicerContext) -> bytes:
        response = fabric.upstream.unary(PATH, request, context)
        try:
            req = cri.PullImageRequest.FromString(request)
            ref = cri.PullImageResponse.FromString(response).image_ref
        except DecodeError:
            return response
        auth = req.auth if req.HasField("auth") else None
        if fabric.origin is not None:
            fabric.origin.images.remember(req.image.image, ref, auth)
        return response

    return Route(pull_image, when=lambda: fabric.origin is not None)
