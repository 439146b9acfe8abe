"""One three-node fabric per test module, repaired and emptied between tests.

A fault test breaks things on purpose; the teardown brings every link,
containerd, agent and the broker back, removes the test's pods through the
origin and waits until no placement, lease or shadow is left. A fabric that
cannot be brought back that way is closed, and the next test gets a new one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.faults.checks import HOSTS, ORIGIN, Kubelet, repair
from shim.localfabric.fabric import Fabric3
from shim.localfabric.waiting import wait_for

PREPARED_SANDBOX_TTL_S = 5.0
FENCE_S = 5.0
LOSS_S = 12.0


class FabricHolder:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.fabric: Fabric3 | None = None
        self.opened = 0

    def get(self) -> Fabric3:
        if self.fabric is None:
            self.opened += 1
            # A short TTL for shadow sandboxes without a container (prepared ones a fault left unused), so the
            # checks' settle window sees the hosts remove them.
            # Fencing and loss a little later than the fabric's defaults: an agent restarted by a test (a new
            # Python process, on a machine running other tests beside it) must be back before its hosts fence.
            self.fabric = Fabric3(self.workdir / f"fabric{self.opened}", fence_s=FENCE_S, loss_s=LOSS_S,
                                  mesh_config=f"prepared_sandbox_ttl = {PREPARED_SANDBOX_TTL_S}\n")
            self.fabric.__enter__()
        return self.fabric

    def discard(self) -> None:
        if self.fabric is not None:
            self.fabric.close()
            self.fabric = None


def empty(f: Fabric3) -> bool:
    doc = f.status(ORIGIN)
    assert f.broker is not None
    return (not doc["placements"] and not doc["sandboxes"] and not f.broker.leases()
            and not any(f.shadows(h) for h in HOSTS))


@pytest.fixture(scope="module")
def fabric_holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FabricHolder]:
    holder = FabricHolder(tmp_path_factory.mktemp("faults"))
    try:
        yield holder
    finally:
        holder.discard()


@pytest.fixture
def kube(fabric_holder: FabricHolder) -> Iterator[Kubelet]:
    k = Kubelet(fabric_holder.get())
    yield k
    try:
        repair(k.f)
        k.cleanup()
        wait_for(lambda: empty(k.f), timeout=20, what="the fabric to be empty after the test's pods were removed")
    except BaseException:
        fabric_holder.discard()
        raise
