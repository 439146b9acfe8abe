"""The grpcio floor: the cheapest CRI server Python's grpcio can be.

A sync ``grpc.server`` on a thread pool whose one generic handler answers
every unary call with the same pre-serialized bytes: no routing table, no
forwarding, no metrics, no logging. Whatever latency it adds over containerd
is what any Python grpcio server costs by itself, so the proxy benchmark can
tell the part of the agent's overhead that forwarding could ever win back
from the part that comes with the server library.

Run as ``python -m bench.floor SOCKET [RESPONSE_HEX]``; it serves until
SIGTERM or SIGINT. RESPONSE_HEX lets the caller hand over containerd's own
VersionResponse, so both servers return exactly the same bytes.
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from cri_api.v1 import api_pb2 as cri


class _Echo(grpc.GenericRpcHandler):
    def __init__(self, response: bytes) -> None:
        # Built once: the handler must cost nothing but grpcio itself.
        self._handler = grpc.unary_unary_rpc_method_handler(lambda request, context: response)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return self._handler


def serve(socket: str, response: bytes) -> None:
    # Same pool shape as the agent's server, so the floor differs only by
    # what the handler does.
    server = grpc.server(ThreadPoolExecutor(max_workers=16), handlers=[_Echo(response)])
    if server.add_insecure_port(f"unix:{socket}") == 0:
        raise SystemExit(f"bench.floor: could not bind {socket}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    stop.wait()
    server.stop(0).wait()


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m bench.floor SOCKET [RESPONSE_HEX]", file=sys.stderr)
        return 2
    if len(argv) == 2:
        response = bytes.fromhex(argv[1])
    else:
        response = cri.VersionResponse(version="0.1.0", runtime_name="floor", runtime_version="0",
                                       runtime_api_version="v1").SerializeToString()
    serve(argv[0], response)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
