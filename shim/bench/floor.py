"""The floors: the cheapest CRI servers Python's grpcio can be, and the cheapest relay.

Three modes; the first two are each a sync ``grpc.server`` on the agent's thread pool size (64
workers) with one generic handler and nothing else: no routing table, no
metadata handling, no metrics, no logging.

- echo (``python -m shim.bench.floor SOCKET [RESPONSE_HEX]``) answers every unary
  call with the same pre-serialized bytes. What it adds over containerd is what
  a Python grpcio server costs by itself. RESPONSE_HEX lets the caller hand
  over containerd's own VersionResponse, so both return exactly the same bytes.
- forward (``python -m shim.bench.floor SOCKET --forward UPSTREAM_SOCKET``) sends
  every unary call on, as raw bytes, over one grpcio channel to UPSTREAM_SOCKET
  and returns the reply. What it adds is the least any grpcio forwarder can
  add: a server plus a client hop.
- splice (``python -m shim.bench.floor SOCKET --splice UPSTREAM_SOCKET``) is no gRPC
  at all: an asyncio byte pipe between each client connection and its own
  upstream connection. What it adds is the least any user-space relay written
  in Python can add; an HTTP/2-aware relay (frames passed verbatim, only the
  request headers decoded to route) would sit just above it.

So the proxy benchmark can split the agent's overhead into the part that comes
with the server library, the part that comes with forwarding through grpcio at
all, and the part that is weft's own code. Either mode serves until SIGTERM or
SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from cri_api.v1 import api_pb2 as cri

# The agent's default ``agent.workers``: the floors differ from it only by what
# the handler does.
WORKERS = 64


class _Echo(grpc.GenericRpcHandler):
    def __init__(self, response: bytes) -> None:
        # Built once: the handler must cost nothing but grpcio itself.
        self._handler = grpc.unary_unary_rpc_method_handler(lambda request, context: response)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return self._handler


class _Forward(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        # One handler per method, built on first use, as the agent's router
        # does: building a multicallable per call would be a cost of this
        # floor, not of grpcio. A lost race only builds one twice.
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        path = handler_call_details.method
        handler = self._handlers.get(path)
        if handler is None:
            # No serializers either side: bytes in, bytes out.
            upstream: Callable[[bytes], bytes] = self._channel.unary_unary(path)
            handler = grpc.unary_unary_rpc_method_handler(lambda request, context: upstream(request))
            self._handlers[path] = handler
        return handler


def serve(socket: str, handler: grpc.GenericRpcHandler) -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=WORKERS), handlers=[handler])
    if server.add_insecure_port(f"unix:{socket}") == 0:
        raise SystemExit(f"shim.bench.floor: could not bind {socket}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    stop.wait()
    server.stop(0).wait()


def splice(socket: str, upstream: str) -> None:
    import asyncio

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(upstream)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        server = await asyncio.start_unix_server(handle, socket)
        async with server:
            await stop.wait()

    asyncio.run(run())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m shim.bench.floor")
    parser.add_argument("socket")
    parser.add_argument("response_hex", nargs="?", help="echo mode: the bytes to answer with")
    parser.add_argument("--forward", metavar="UPSTREAM_SOCKET", help="forward mode: where to send every call")
    parser.add_argument("--splice", metavar="UPSTREAM_SOCKET", help="splice mode: relay bytes to this socket")
    args = parser.parse_args(argv)
    if args.splice is not None:
        splice(args.socket, args.splice)
        return 0
    if args.forward is not None:
        if args.response_hex is not None:
            parser.error("RESPONSE_HEX and --forward exclude each other")
        with grpc.insecure_channel(f"unix://{args.forward}") as channel:
            serve(args.socket, _Forward(channel))
        return 0
    if args.response_hex is not None:
        response = bytes.fromhex(args.response_hex)
    else:
        response = cri.VersionResponse(version="0.1.0", runtime_name="floor", runtime_version="0",
                                       runtime_api_version="v1").SerializeToString()
    serve(args.socket, _Echo(response))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
