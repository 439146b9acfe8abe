"""The two-stage workload ``bench.gpu_value`` runs: the kind of pod that rides on GPU nodes today.

``cpu``: the CPU stage. Per item it makes a PNG on the spot (a gradient with noise, encoded here), then does what
an image pipeline's loader does with it: decodes it (zlib, then the PNG filters undone byte by byte) and resizes
it (a box filter) to the model's input. Items go out in batches over the pod's localhost to the GPU stage, one
batch in flight while the next is made, so a pod goes as fast as its CPU stage when the GPU's work per batch is
the smaller part.

``gpu``: the GPU stage. It listens on the port, checks each batch, and runs CUDA work per batch: the spin
kernel of weft's CUDA client (``shim/gpucheck/cuda_client.py``) for a set number of milliseconds, with a working
buffer held in GPU memory for its life. The kernel's length is what sets how busy the GPU is.

Standard library only (the image is this machine's Python, built offline); ``cuda_client.py`` lies beside this
file in the image. Each stage logs one JSON line per batch on stdout (its items done so far among them) and a
last line when SIGTERM ends it::

    python3 -I -S gpu_workload.py cpu --port 9000 [--batch 16] [--side 96] [--out-side 32]
    python3 -I -S gpu_workload.py gpu --port 9000 --kernel-ms 20 [--alloc-mib 256] [--libcuda libcuda.so.1]
    python3 -I -S gpu_workload.py calibrate [--batch 16] [--side 96] [--out-side 32] [--seconds 2]

``calibrate`` makes batches as the CPU stage does, sending nowhere, and prints the CPU time one batch took.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import struct
import sys
import time
import zlib

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEADER_MAX = 4096  # a batch's header line is far smaller; a longer one is not this protocol


class Stop(Exception):
    """SIGTERM: the stage ends, saying what it did."""


def _on_term(*_: object) -> None:
    raise Stop


def say(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


# -- the CPU stage's work ------------------------------------------------------------------------------------
def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def make_png(index: int, side: int) -> bytes:
    """An RGB PNG of ``side`` x ``side``: a gradient with noise drawn from ``index``, each row Sub-filtered."""
    rng = random.Random(index)
    noise = rng.randbytes(side * side * 3)
    raw = bytearray()
    for y in range(side):
        row = bytearray(side * 3)
        for x in range(side):
            o = (y * side + x) * 3
            row[x * 3] = (x * 255 // side + noise[o] // 8) & 255
            row[x * 3 + 1] = (y * 255 // side + noise[o + 1] // 8) & 255
            row[x * 3 + 2] = ((x + y) * 127 // side + noise[o + 2] // 8) & 255
        raw.append(1)  # Sub: each byte less the one a pixel to its left
        raw += bytes((row[i] - (row[i - 3] if i >= 3 else 0)) & 255 for i in range(len(row)))
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return PNG_MAGIC + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(bytes(raw), 6)) + _chunk(b"IEND", b"")


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB bytes) of an 8-bit RGB PNG, every filter type undone."""
    if not data.startswith(PNG_MAGIC):
        raise ValueError("not a PNG")
    pos, idat, width = len(PNG_MAGIC), bytearray(), 0
    height = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            if (depth, colour) != (8, 2):
                raise ValueError(f"only 8-bit RGB, not depth {depth} colour type {colour}")
        elif kind == b"IDAT":
            idat += body
    raw = zlib.decompress(bytes(idat))
    stride = width * 3
    out = bytearray(stride * height)
    prev = bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - 3] if i >= 3 else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + prev[i]) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + prev[i]) // 2) & 255
            elif kind == 4:
                line[i] = (line[i] + _paeth(a, prev[i], prev[i - 3] if i >= 3 else 0)) & 255
        out[y * stride:(y + 1) * stride] = line
        prev = line
    return width, height, bytes(out)


def resize(width: int, height: int, rgb: bytes, side: int) -> bytes:
    """A box filter down to ``side`` x ``side``: each output pixel the mean of the pixels it covers."""
    out = bytearray(side * side * 3)
    for oy in range(side):
        y0, y1 = oy * height // side, max(oy * height // side + 1, (oy + 1) * height // side)
        for ox in range(side):
            x0, x1 = ox * width // side, max(ox * width // side + 1, (ox + 1) * width // side)
            n = (y1 - y0) * (x1 - x0)
            for c in range(3):
                total = 0
                for y in range(y0, y1):
                    base = y * width * 3 + c
                    for x in range(x0, x1):
                        total += rgb[base + x * 3]
                out[(oy * side + ox) * 3 + c] = total // n
    return bytes(out)


def make_batch(first: int, items: int, side: int, out_side: int) -> bytes:
    """Items ``first``.. made, decoded and resized: the batch the GPU stage gets."""
    parts = []
    for i in range(first, first + items):
        w, h, rgb = decode_png(make_png(i, side))
        parts.append(resize(w, h, rgb, out_side))
    return b"".join(parts)


# -- the wire: a JSON header line, then the payload; one JSON line back per batch ----------------------------
def _read_line(f) -> bytes:
    line = f.readline(HEADER_MAX)
    if not line:
        raise ConnectionError("the other stage closed the connection")
    if not line.endswith(b"\n"):
        raise ValueError(f"a header line longer than {HEADER_MAX} bytes")
    return line


def send_batch(sock: socket.socket, batch: int, items: int, payload: bytes) -> None:
    header = {"batch": batch, "items": items, "bytes": len(payload), "crc32": zlib.crc32(payload)}
    sock.sendall(json.dumps(header).encode() + b"\n" + payload)


# -- the stages ------------------------------------------------------------------------------------------------
def run_cpu(args: argparse.Namespace) -> int:
    """Make batches and stream them to the GPU stage, one in flight while the next is made."""
    made = acked = lost = sent_batches = 0
    pending: tuple[int, int] | None = None  # (batch, items) sent and not yet acknowledged
    sock: socket.socket | None = None
    reader = None
    started = time.time()
    say({"stage": "cpu", "op": "start", "batch_items": args.batch, "side": args.side, "out_side": args.out_side,
         "to": f"{args.host}:{args.port}"})
    try:
        while True:
            t0 = time.process_time()
            payload = make_batch(made, args.batch, args.side, args.out_side)
            made += args.batch
            cpu_ms = (time.process_time() - t0) * 1000
            while True:
                try:
                    if sock is None:
                        sock = socket.create_connection((args.host, args.port), timeout=30)
                        reader = sock.makefile("rb")
                        # A listener that forwards (the stitched network's) accepts before the GPU stage is
                        # there: only its answer says a batch sent now can be served.
                        sock.sendall(b'{"hello": 1}\n')
                        if not json.loads(_read_line(reader)).get("ready"):
                            raise ConnectionError("the GPU stage is not ready")
                        sock.settimeout(None)
                        say({"stage": "cpu", "op": "connected", "to": f"{args.host}:{args.port}", "t": time.time()})
                    if pending is not None:
                        ack = json.loads(_read_line(reader))
                        if ack.get("batch") != pending[0] or not ack.get("ok"):
                            raise ConnectionError(f"batch {pending[0]} answered {ack}")
                        acked += pending[1]
                        pending = None
                    send_batch(sock, sent_batches, args.batch, payload)
                    pending = (sent_batches, args.batch)
                    sent_batches += 1
                    break
                except (OSError, ValueError) as exc:
                    if sock is not None:  # the GPU stage went away: what was in flight is lost
                        if pending is not None:
                            lost += pending[1]
                            say({"stage": "cpu", "op": "lost", "batch": pending[0], "items": pending[1],
                                 "error": str(exc) or type(exc).__name__, "t": time.time()})
                            pending = None
                        sock.close()
                        sock = reader = None
                    time.sleep(0.2)  # not there yet (or gone): try again, holding the batch
            say({"stage": "cpu", "op": "sent", "batch": sent_batches - 1, "items": args.batch, "made": made,
                 "acked": acked, "lost": lost, "cpu_ms": round(cpu_ms, 2), "t": time.time()})
    except Stop:
        pass
    say({"stage": "cpu", "op": "end", "made": made, "acked": acked, "lost": lost,
         "in_flight": pending[1] if pending else 0, "seconds": round(time.time() - started, 3),
         "cpu_s": round(time.process_time(), 3)})
    return 0


def _client(libcuda: str):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cuda_client.py beside this file
    try:
        import cuda_client  # type: ignore[import-not-found]
    except ImportError:  # run from a checkout: shim/bench/checkout/ is three folders below its root
        here = os.path.abspath(__file__)
        for _ in range(4):
            here = os.path.dirname(here)
        sys.path.insert(0, here)
        from shim.gpucheck import cuda_client
    return cuda_client.Client(cuda_client.Driver(libcuda)), cuda_client.CudaError


def run_gpu(args: argparse.Namespace) -> int:
    """Serve batches: check each, run the kernel for it, answer; one connection at a time."""
    try:
        client, cuda_error = _client(args.libcuda)
    except (OSError, AttributeError) as exc:
        say({"stage": "gpu", "op": "ready", "ok": False, "error": f"cannot load {args.libcuda}: {exc}"})
        return 3
    done = batches = failed = 0
    kernel_s = 0.0
    started = time.time()
    try:
        try:
            init = client.init()
            if args.alloc_mib:
                client.alloc(args.alloc_mib)
        except cuda_error as exc:
            say({"stage": "gpu", "op": "ready", "ok": False, "error": exc.name, "call": exc.call})
            return 4
        server = socket.create_server(("", args.port), family=socket.AF_INET, reuse_port=False)
        say({"stage": "gpu", "op": "ready", "ok": True, "sms": init["sms"], "total_bytes": init["total_bytes"],
             "alloc_mib": args.alloc_mib, "kernel_ms": args.kernel_ms, "port": args.port, "t": time.time()})
        while True:
            conn, peer = server.accept()
            say({"stage": "gpu", "op": "accepted", "from": f"{peer[0]}:{peer[1]}", "t": time.time()})
            with conn, conn.makefile("rb") as reader:
                try:
                    while True:
                        header = json.loads(_read_line(reader))
                        if "hello" in header:
                            conn.sendall(b'{"ready": true}\n')
                            continue
                        payload = reader.read(int(header["bytes"]))
                        if len(payload) != header["bytes"]:
                            raise ConnectionError("the batch ended early")
                        if zlib.crc32(payload) != header["crc32"]:
                            raise ValueError(f"batch {header['batch']}: its checksum does not match")
                        try:
                            busy = client.busy(args.kernel_ms)
                        except cuda_error as exc:
                            failed += 1
                            say({"stage": "gpu", "op": "failed", "batch": header["batch"], "error": exc.name,
                                 "t": time.time()})
                            conn.sendall(json.dumps({"batch": header["batch"], "ok": False}).encode() + b"\n")
                            continue
                        done += int(header["items"])
                        batches += 1
                        kernel_s += busy["seconds"]
                        conn.sendall(json.dumps({"batch": header["batch"], "ok": True}).encode() + b"\n")
                        say({"stage": "gpu", "op": "batch", "batch": header["batch"], "items": header["items"],
                             "done": done, "kernel_s": busy["seconds"], "sms_used": busy["sms_used"],
                             "t": time.time()})
                except (OSError, ValueError, KeyError) as exc:
                    say({"stage": "gpu", "op": "dropped", "error": str(exc) or type(exc).__name__, "t": time.time()})
    except Stop:
        pass
    finally:
        with contextlib.suppress(cuda_error):
            client.close()
    say({"stage": "gpu", "op": "end", "done": done, "batches": batches, "failed": failed,
         "kernel_s": round(kernel_s, 4), "seconds": round(time.time() - started, 3)})
    return 0


def calibrate(args: argparse.Namespace) -> dict:
    """The CPU time one batch takes here (median of those made in ``args.seconds``)."""
    times = []
    made = 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline or len(times) < 3:
        t0 = time.process_time()
        make_batch(made, args.batch, args.side, args.out_side)
        times.append(time.process_time() - t0)
        made += args.batch
    times.sort()
    return {"batch_cpu_ms": round(times[len(times) // 2] * 1000, 2), "batches": len(times),
            "batch_items": args.batch, "side": args.side, "out_side": args.out_side}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_workload", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="stage", required=True)
    for name in ("cpu", "calibrate"):
        s = sub.add_parser(name)
        s.add_argument("--batch", type=int, default=16, help="items per batch")
        s.add_argument("--side", type=int, default=96, help="each generated image's side, pixels")
        s.add_argument("--out-side", type=int, default=32, help="the side it is resized to")
        if name == "cpu":
            s.add_argument("--host", default="127.0.0.1")
            s.add_argument("--port", type=int, default=9000)
        else:
            s.add_argument("--seconds", type=float, default=2.0)
    g = sub.add_parser("gpu")
    g.add_argument("--port", type=int, default=9000)
    g.add_argument("--kernel-ms", type=int, required=True, help="the kernel's length per batch")
    g.add_argument("--alloc-mib", type=int, default=0, help="GPU memory held for the stage's life")
    g.add_argument("--libcuda", default="libcuda.so.1")
    args = p.parse_args(argv)
    if args.stage in ("cpu", "calibrate") and not (args.batch >= 1 and 8 <= args.side <= 4096
                                                   and 1 <= args.out_side <= args.side):
        p.error("want --batch >= 1, --side within 8..4096 and --out-side within 1..--side")
    if args.stage == "gpu" and not 1 <= args.kernel_ms <= 60_000:
        p.error(f"--kernel-ms must be within 1..60000, got {args.kernel_ms}")
    signal.signal(signal.SIGTERM, _on_term)
    if args.stage == "cpu":
        return run_cpu(args)
    if args.stage == "gpu":
        return run_gpu(args)
    print(json.dumps(calibrate(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
