"""``weft demo --keep`` and ``weft demo --down``: a demo fabric that outlives the command, and its removal.

The harness's slots (network namespaces, bridges, subnets, cgroup roots) are
held by flocks that die with their holder, and a slot whose holder is gone is
reaped by the next one to claim it. So a kept fabric needs a live holder: the
*keeper*. ``weft demo --keep`` starts the demo in a child process in a session
of its own and waits until it says the fabric is up (a pipe: its exit code,
then end of file); the child prints the demo, writes the state file, points
its own output at a log file and keeps the fabric until SIGTERM. Then it
removes everything, with the same ``Fabric3.close`` as an ordinary run, and
deletes the state file.

``weft demo --down`` reads the state file, sends the keeper SIGTERM and waits
for it. Should the keeper be gone already (killed outright, the machine's
``/run`` kept over a crash) or not finish, what the state file names is
removed from this process (``Fabric3.remove_detached``). With no state file
there is nothing to remove: ``--down`` is idempotent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from shim.errors import WeftError
from shim.localfabric.fabric import Fabric3
from shim.localfabric.show import crictl_lines, progress, say

STATE_FILE = Path("/run/weft-demo/state.json")
KEEPER_ENV = "WEFT_DEMO_KEEPER_FD"
MARKER = "shim demo"  # in the keeper's command line


def _state_file(path: Path | None) -> Path:
    return path or STATE_FILE


def _alive(pid: int, marker: str) -> bool:
    """``pid`` runs and is the keeper (its command line names ``marker``), not a process that took its number."""
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") and \
            Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def refuse_if_kept(state_file: Path | None) -> None:
    path = _state_file(state_file)
    if path.exists():
        with open(path) as fh:
            keeper = json.load(fh).get("keeper", {})
        if keeper and _alive(keeper["pid"], keeper["marker"]):
            raise WeftError(f"a kept demo is running (keeper pid {keeper['pid']}, {path}); "
                            "run 'weft demo --down' first")


def launch(argv: list[str]) -> int:
    """In the command's process: run the demo in a keeper child and return its code once the fabric is up."""
    r, w = os.pipe()
    env = {**os.environ, KEEPER_ENV: str(w)}
    proc = subprocess.Popen([sys.executable, "-m", "shim", *argv], env=env, pass_fds=(w,),
                            start_new_session=True, stdin=subprocess.DEVNULL)
    os.close(w)
    with os.fdopen(r) as pipe:
        said = pipe.read().strip()
    if said:
        return int(said)
    return proc.wait()  # it ended before the fabric was up: its own exit code


def keep(f: Fabric3, desc: dict[str, Any], state_file: Path | None, as_json: bool) -> bool:
    """In the keeper: hand the fabric over to ``--down``; returns only after it was removed (True)."""

    fd = os.environ.get(KEEPER_ENV)
    if fd is None:
        raise WeftError("internal: --keep runs in a keeper process (shim.localfabric.demo_keep.launch)")
    path = _state_file(state_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {**desc, "keeper": {"pid": os.getpid(), "marker": MARKER, "log": str(f.workdir / "keeper.log"),
                                "fabric": f.detach_info()}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.chmod(tmp, 0o600)
    tmp.replace(path)
    say("kept running: try", "\n".join(crictl_lines(desc)) +
        "\n(crictl comes with the cri-tools package; 'weft demo --down' removes everything)")
    say("state", f"{path} (keeper pid {os.getpid()}, its log {f.workdir / 'keeper.log'})")
    if as_json:
        print(json.dumps(desc), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # From here nothing may write to the command's terminal or pipe: it has returned.
    log = os.open(f.workdir / "keeper.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    os.write(int(fd), b"0\n")
    os.close(int(fd))
    while not stop.wait(1.0):
        pass
    with progress("removing the kept fabric"):
        try:
            f.close()
        finally:
            path.unlink(missing_ok=True)
            import shutil

            shutil.rmtree(f.workdir, ignore_errors=True)
    return True


def down(state_file: Path | None, timeout: float = 180.0) -> int:

    path = _state_file(state_file)
    if not path.exists():
        say("nothing to remove", f"no kept demo ({path} does not exist)")
        return 0
    state = json.loads(path.read_text())
    keeper = state.get("keeper", {})
    pid = keeper.get("pid", 0)
    if pid and _alive(pid, keeper.get("marker", MARKER)):
        with progress(f"the keeper (pid {pid}) removes the fabric"):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while _alive(pid, keeper.get("marker", MARKER)) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _alive(pid, keeper.get("marker", MARKER)):
                os.kill(pid, signal.SIGKILL)
    if path.exists() and keeper.get("fabric"):
        with progress("the keeper is gone: removing what the state file names from here"):
            left = Fabric3.remove_detached(keeper["fabric"])
        if left:
            say("could not remove", "\n".join(left))
            return 1
    path.unlink(missing_ok=True)
    say("demo removed", f"nodes {', '.join(n['name'] for n in state.get('nodes', []))}: agents, broker, "
        "containerds, network namespaces, bridge and cgroups gone")
    return 0
