"""A small CUDA client for ``weft gpu-check``'s live test: the CUDA driver API through ``ctypes``, no toolkit.

It runs as a lease's container would: a process on its own, started with
``python -I -S`` and only the standard library (so a cleared environment, or a
mount namespace without the virtual environment, does not stop it). Its
kernel is PTX text, which the driver compiles for whatever GPU it finds.

It reads one command per line on stdin and answers each with one JSON line on
stdout, so ``weft gpu-check`` can hold two clients in step::

    init            load the device's primary context; answers the device's memory and the SM count the
                    client sees (under an MPS active thread percentage, the driver shows that share of the SMs)
    alloc MIB       allocate MIB MiB and keep it; ok false with the CUDA error name when the driver refuses
    busy MS [SMS]   run a kernel for about MS ms with enough blocks for SMS SMs (default: the count it sees);
                    answers how many SMs ran its blocks, which MPS holds to the client's share
    free            free what alloc kept
    sleep MS        wait MS ms (a pause in a scripted run, while something outside changes)
    devices         the GPU device nodes under /dev and the visible-devices variables this process has
    exit            (or end of input) release the context and exit 0

``--commands "init; alloc 512; exit"`` reads the commands from its argument instead, for a container
whose output is its log and that nobody talks to.

Exit codes: 0 done, 2 bad arguments, 3 libcuda cannot be loaded, 4 ran past
``--max-seconds`` (the kill of last resort for a client that hangs).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time

EXIT_OK, EXIT_USAGE, EXIT_NO_LIBCUDA, EXIT_TIMEOUT = 0, 2, 3, 4
CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13  # kHz
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
BLOCKS_PER_SM = 4
THREADS_PER_BLOCK = 32
MAX_ALLOC_MIB = 1 << 24  # 16 TiB: anything larger is a typo, not a test
MAX_SMS = 4096  # far above any GPU's; bounds the grid and the host buffer it is read back into

# Each block's first thread writes the SM it runs on (%smid) to out[block], then
# every thread spins until ``cycles`` clock ticks have passed: busy SMs, and a
# record of which SMs the client could use (MPS's active thread percentage
# limits that set).
SPIN_PTX = b"""
.version 6.0
.target sm_70
.address_size 64

.visible .entry spin(
    .param .u64 out,
    .param .u64 cycles
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<4>;
    .reg .b64 %rd<9>;

    ld.param.u64 %rd1, [out];
    ld.param.u64 %rd2, [cycles];
    mov.u32 %r1, %tid.x;
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra SPIN;
    mov.u32 %r2, %smid;
    mov.u32 %r3, %ctaid.x;
    cvta.to.global.u64 %rd3, %rd1;
    mul.wide.u32 %rd4, %r3, 4;
    add.s64 %rd5, %rd3, %rd4;
    st.global.u32 [%rd5], %r2;
SPIN:
    mov.u64 %rd6, %clock64;
LOOP:
    mov.u64 %rd7, %clock64;
    sub.s64 %rd8, %rd7, %rd6;
    setp.lt.u64 %p2, %rd8, %rd2;
    @%p2 bra LOOP;
    ret;
}
\x00"""


class CudaError(Exception):
    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call}: {name} ({code})")
        self.call, self.code, self.name = call, code, name


_C = ctypes
_SIGNATURES = {
    "cuInit": [_C.c_uint],
    "cuDeviceGet": [_C.POINTER(_C.c_int), _C.c_int],
    "cuDeviceGetAttribute": [_C.POINTER(_C.c_int), _C.c_int, _C.c_int],
    "cuDeviceGetName": [_C.c_char_p, _C.c_int, _C.c_int],
    "cuDevicePrimaryCtxRetain": [_C.POINTER(_C.c_void_p), _C.c_int],
    "cuDevicePrimaryCtxRelease_v2": [_C.c_int],
    "cuCtxSetCurrent": [_C.c_void_p],
    "cuCtxSynchronize": [],
    "cuMemGetInfo_v2": [_C.POINTER(_C.c_size_t), _C.POINTER(_C.c_size_t)],
    "cuMemAlloc_v2": [_C.POINTER(_C.c_uint64), _C.c_size_t],
    "cuMemFree_v2": [_C.c_uint64],
    "cuMemcpyDtoH_v2": [_C.c_void_p, _C.c_uint64, _C.c_size_t],
    "cuModuleLoadData": [_C.POINTER(_C.c_void_p), _C.c_char_p],
    "cuModuleGetFunction": [_C.POINTER(_C.c_void_p), _C.c_void_p, _C.c_char_p],
    "cuModuleUnload": [_C.c_void_p],
    "cuLaunchKernel": [_C.c_void_p, _C.c_uint, _C.c_uint, _C.c_uint, _C.c_uint, _C.c_uint, _C.c_uint, _C.c_uint,
                       _C.c_void_p, _C.POINTER(_C.c_void_p), _C.POINTER(_C.c_void_p)],
    "cuGetErrorName": [_C.c_int, _C.POINTER(_C.c_char_p)],
}


class Driver:
    """The few CUDA driver calls the client makes, each checked: a failure raises CudaError naming it."""

    def __init__(self, path: str) -> None:
        self._lib = ctypes.CDLL(path)
        self._fns = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self._lib, name)  # AttributeError: not a libcuda
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self._fns[name] = fn

    def call(self, name: str, *args) -> None:
        code = self._fns[name](*args)
        if code != 0:
            raise CudaError(name, code, self.error_name(code))

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self._fns["cuGetErrorName"](code, ctypes.byref(text)) != 0 or not text.value:
            return f"CUDA_ERROR_{code}"
        return text.value.decode(errors="replace")


class Client:
    def __init__(self, driver: Driver) -> None:
        self.cu = driver
        self.device = ctypes.c_int()
        self.ctx: ctypes.c_void_p | None = None
        self.kept: list[ctypes.c_uint64] = []
        self.held_bytes = 0
        self.sms = 0
        self.clock_khz = 0

    def init(self) -> dict:
        cu = self.cu
        cu.call("cuInit", 0)
        cu.call("cuDeviceGet", ctypes.byref(self.device), 0)
        ctx = ctypes.c_void_p()
        cu.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self.device)
        self.ctx = ctx
        cu.call("cuCtxSetCurrent", ctx)
        name = ctypes.create_string_buffer(256)
        cu.call("cuDeviceGetName", name, len(name), self.device)
        value = ctypes.c_int()
        cu.call("cuDeviceGetAttribute", ctypes.byref(value), CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.device)
        self.sms = value.value
        cu.call("cuDeviceGetAttribute", ctypes.byref(value), CU_DEVICE_ATTRIBUTE_CLOCK_RATE, self.device)
        self.clock_khz = value.value
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        cu.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        # The device's memory: an MPS memory limit is not shown here, only enforced at allocation.
        return {"name": name.value.decode(errors="replace"), "sms": self.sms, "free_bytes": free.value,
                "total_bytes": total.value}

    def alloc(self, mib: int) -> dict:
        ptr = ctypes.c_uint64()
        self.cu.call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(mib << 20))
        self.kept.append(ptr)
        self.held_bytes += mib << 20
        return {"bytes": mib << 20, "held_bytes": self.held_bytes}

    def busy(self, ms: int, sms: int | None = None) -> dict:
        cu = self.cu
        if self.sms <= 0:
            raise CudaError("busy", -1, "NOT_INITIALIZED (send init first)")
        # Sized for the whole device when the caller knows it: blocks for SMs outside the share would spread onto
        # them if MPS did not hold the client back.
        blocks = (sms or self.sms) * BLOCKS_PER_SM
        size = blocks * 4
        out = ctypes.c_uint64()
        cu.call("cuMemAlloc_v2", ctypes.byref(out), ctypes.c_size_t(size))
        module = ctypes.c_void_p()
        try:
            cu.call("cuModuleLoadData", ctypes.byref(module), SPIN_PTX)
            fn = ctypes.c_void_p()
            cu.call("cuModuleGetFunction", ctypes.byref(fn), module, b"spin")
            cycles = ctypes.c_uint64(max(1, self.clock_khz) * max(1, ms))
            target = ctypes.c_uint64(out.value)
            params = (ctypes.c_void_p * 2)(ctypes.addressof(target), ctypes.addressof(cycles))
            started = time.monotonic()
            cu.call("cuLaunchKernel", fn, blocks, 1, 1, THREADS_PER_BLOCK, 1, 1, 0, None, params, None)
            cu.call("cuCtxSynchronize")
            seconds = time.monotonic() - started
            smids = (ctypes.c_uint32 * blocks)()
            cu.call("cuMemcpyDtoH_v2", smids, out, ctypes.c_size_t(size))
        finally:
            if module.value:
                self.cu.call("cuModuleUnload", module)
            self.cu.call("cuMemFree_v2", out)
        return {"sms_used": len(set(smids)), "sms_total": self.sms, "blocks": blocks, "seconds": round(seconds, 4)}

    def free(self) -> dict:
        while self.kept:
            self.cu.call("cuMemFree_v2", self.kept.pop())
        self.held_bytes = 0
        return {}

    def close(self) -> None:
        if self.ctx is not None:
            self.free()
            self.cu.call("cuDevicePrimaryCtxRelease_v2", self.device)
            self.ctx = None


def _number(arg: str, what: str, low: int, high: int) -> int:
    try:
        value = int(arg)
    except ValueError:
        raise ValueError(f"{what} must be a whole number, got {arg!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{what} must be within {low}..{high}, got {value}")
    return value


def answer(client: Client, line: str) -> dict | None:
    """One command's answer; None for exit."""
    words = line.split()
    if not words:
        return {"ok": False, "error": "empty command (init, alloc MIB, busy MS [SMS], free, sleep MS, devices, exit)"}
    op, args = words[0], words[1:]
    want = {"init": (0, 0), "alloc": (1, 1), "busy": (1, 2), "free": (0, 0), "sleep": (1, 1), "devices": (0, 0),
            "exit": (0, 0)}
    if op not in want:
        return {"op": op, "ok": False,
                "error": f"unknown command {op!r} (init, alloc MIB, busy MS [SMS], free, sleep MS, devices, exit)"}
    low, high = want[op]
    if not low <= len(args) <= high:
        takes = f"{low}" if low == high else f"{low} to {high}"
        return {"op": op, "ok": False, "error": f"{op} takes {takes} argument(s), got {len(args)}"}
    if op == "exit":
        return None
    try:
        if op == "init":
            out = client.init()
        elif op == "alloc":
            out = client.alloc(_number(args[0], "alloc MIB", 1, MAX_ALLOC_MIB))
        elif op == "sleep":
            time.sleep(_number(args[0], "sleep MS", 1, 600_000) / 1000)
            out = {}
        elif op == "devices":
            out = _devices()
        elif op == "busy":
            out = client.busy(_number(args[0], "busy MS", 1, 60_000),
                              _number(args[1], "busy SMS", 1, MAX_SMS) if len(args) > 1 else None)
        else:
            out = client.free()
    except ValueError as exc:
        return {"op": op, "ok": False, "error": str(exc)}
    except CudaError as exc:
        return {"op": op, "ok": False, "error": exc.name, "code": exc.code, "call": exc.call}
    return {"op": op, "ok": True, **out}


def _devices() -> dict:
    try:
        nodes = sorted(f"/dev/{n}" for n in os.listdir("/dev") if n.startswith("nvidia"))
    except OSError:
        nodes = []
    env = {k: v for k, v in os.environ.items() if k in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")}
    return {"nodes": nodes, "env": env}


def _say(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cuda_client", description="weft gpu-check's CUDA client (commands on stdin)")
    p.add_argument("--libcuda", default="libcuda.so.1", help="the CUDA driver library (default libcuda.so.1)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="exit 4 after this long, whatever happens")
    p.add_argument("--commands", help="the commands, separated by ';', instead of stdin's lines")
    args = p.parse_args(argv)
    if not 0 < args.max_seconds <= 3600:
        p.error(f"--max-seconds must be within 0..3600, got {args.max_seconds}")

    def expire() -> None:
        _say({"ok": False, "error": f"ran past --max-seconds {args.max_seconds:g}"})
        os._exit(EXIT_TIMEOUT)  # the main thread may be stuck in a CUDA call: no clean-up, just go

    # A thread, not a signal: a signal's Python handler waits for the main thread, which may sit in a driver
    # call that never returns; ctypes lets go of the interpreter during the call, so the thread can act.
    timer = threading.Timer(args.max_seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        driver = Driver(args.libcuda)
    except (OSError, AttributeError) as exc:
        _say({"op": "load", "ok": False, "error": f"cannot load {args.libcuda}: {exc}"})
        return EXIT_NO_LIBCUDA
    client = Client(driver)
    _say({"op": "load", "ok": True, "pid": os.getpid()})
    try:
        lines = sys.stdin if args.commands is None else [c for c in args.commands.split(";") if c.strip()]
        for line in lines:
            doc = answer(client, line)
            if doc is None:
                break
            _say(doc)
    finally:
        try:
            client.close()
        except CudaError as exc:
            _say({"op": "exit", "ok": False, "error": exc.name, "code": exc.code, "call": exc.call})
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
