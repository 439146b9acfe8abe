"""The README's first command does what it says: a whole single-node fabric, then nothing left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_runs_the_fabric_and_cleans_up() -> None:
    res = subprocess.run([sys.executable, "-m", "shim", "demo"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    for line in ("plain pod started through the agent", "weft.io/placement-reason=no-mesh",
                 "weft.io/placement-reason=gpu-leased", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=30720M",
                 "leases left: 0", "cleaned up"):
        assert line in out, f"demo output lacks {line!r}:\n{out}"
    # Both GPU stages were packed onto one simulated GPU.
    leases = [line for line in out.splitlines() if line.strip().startswith("bound on ")]
    assert len(leases) == 2 and len({line.split(":")[0] for line in leases}) == 1
    # Nothing the demo started survives it: no process mentions its containerd's work directory.
    workdir = next(w for w in (t.rstrip(",;") for t in out.split()) if w.endswith("/containerd.sock")).rsplit("/", 1)[0]
    assert not Path(workdir).exists()
    mentions = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _mentions(p, workdir)]
    assert not mentions, f"processes left behind from {workdir}: {mentions}"


def _mentions(proc: Path, text: str) -> bool:
    try:
        return text.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False
