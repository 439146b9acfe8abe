"""What the demo prints: steps, progress on long ones, and the crictl lines to try on a kept demo."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any


def say(step: str, detail: str = "") -> None:
    print(f"==> {step}" + ("\n    " + detail.replace("\n", "\n    ") if detail else ""), flush=True)


@contextlib.contextmanager
def progress(title: str) -> Iterator[None]:
    """A long step: a spinner with the seconds so far on a terminal, a start and an end line otherwise."""
    t0 = time.monotonic()
    tty = sys.stdout.isatty()
    done = threading.Event()

    def spin() -> None:
        for ch in iter(lambda: "|/-\\"[int((time.monotonic() - t0) * 8) % 4], None):
            if done.wait(0.125):
                return
            print(f"\r==> {title} {ch} {time.monotonic() - t0:5.1f}s", end="", flush=True)

    if tty:
        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
    else:
        print(f"==> {title} ...", flush=True)
    try:
        yield
    finally:
        done.set()
        if tty:
            spinner.join()
            print(f"\r==> {title}: {time.monotonic() - t0:.1f}s      ", flush=True)
        else:
            print(f"    ({time.monotonic() - t0:.1f}s)", flush=True)


def crictl_lines(desc: dict[str, Any]) -> list[str]:
    origin = next(n for n in desc["nodes"] if n["name"] == "gpu-1")
    by = {c["name"]: c for c in desc["containers"]}
    sock = f"unix://{origin['weft_socket']}"
    lines = [f"crictl -r {sock} pods",
             f"crictl -r {sock} ps -a",
             f"crictl -r {sock} inspect {by['prepare']['id'][:13]}   # weft.io/placement, weft.io/placement-reason",
             f"crictl -r {sock} logs {by['serve']['id'][:13]}",
             f"crictl -r {sock} exec {by['prepare']['id'][:13]} hostname   # runs on {by['prepare']['node']}",
             f"weft status --socket {origin['weft_socket']}",
             f"weft explain {by['prepare']['id'][:13]} --socket {origin['weft_socket']}"]
    for n in desc["nodes"]:
        if n["name"] != "gpu-1":
            lines.append(f"crictl -r unix://{n['containerd_socket']} ps   # {n['name']}'s containerd: the shadows")
            lines.append(f"weft status --socket {n['weft_socket']}   # {n['name']}: hosted shadows, peers")
    return lines
