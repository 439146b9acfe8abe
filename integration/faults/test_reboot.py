"""A host rebooted under its shadows: everything on it killed, its network namespace torn down and rebuilt.

Down longer than the loss timeout, the origin reports the container
``WeftPeerLost`` while the host is away; back within it, the Watch finds the
shadow exited (its process died with the host) and the origin reports that.
Either way kubelet is told the container exited, with a reason, and its
restart is placed afresh, on the rebooted host too; the dead shadow and its
sandbox go when kubelet removes the old container.
"""

from __future__ import annotations

import time

from cri_api.v1 import api_pb2 as cri

from integration.faults.checks import (
    HOSTS,
    LOST,
    ORIGIN,
    Kubelet,
    LiveCopies,
    explain,
    power_off,
    power_on,
    settled,
)
from shim.localfabric.waiting import wait_for

RUNNING, EXITED = cri.CONTAINER_RUNNING, cri.CONTAINER_EXITED


def _other(host: str) -> str:
    return next(h for h in HOSTS if h != host)


def test_host_down_past_the_loss_timeout(kube: Kubelet) -> None:
    f = kube.f
    cid = kube.run_one("reboot-long")
    host = kube.host_of(cid)
    with LiveCopies(f, kube):
        down = time.monotonic()
        power_off(f, host)
        st = kube.wait_state(cid, EXITED, timeout=f.loss_s + 10)
        assert (st.reason, st.exit_code) == (LOST, 137)
        assert time.monotonic() - down >= f.loss_s - 1
        again = kube.restart(cid)  # placed afresh while the host is away: on the other one
        kube.wait_state(again, RUNNING)
        assert kube.host_of(again) == _other(host)
        power_on(f, host)
        f.wait_meshed()
        settled(f, kube)  # the dead shadow is still the lost container's, until kubelet removes it
        kube.remove(cid)
        settled(f, kube)
    assert not f.shadows(host)


def test_host_back_within_the_loss_timeout_and_the_restart_placed_on_it(kube: Kubelet) -> None:
    f = kube.f
    cid = kube.run_one("reboot-quick")
    host = kube.host_of(cid)
    with LiveCopies(f, kube):
        power_off(f, host)
        power_on(f, host)
        st = kube.wait_state(cid, EXITED, timeout=f.loss_s + 10)
        assert st.reason, st  # WeftPeerLost, or the exit the Watch found after the reboot
        print(f"\nquick reboot of {host}: reported {st.reason} ({st.exit_code})")
        # The other host away for a moment: kubelet's restart must go to the rebooted host, where the
        # old shadow sandbox of this pod is now dead.
        f.agents[_other(host)].stop()
        wait_for(lambda: not next(p for p in f.status(ORIGIN)["peers"] if p["node"] == _other(host))["healthy"],
                 what=f"the origin to see {_other(host)} down")
        wait_for(lambda: next(p for p in f.status(ORIGIN)["peers"] if p["node"] == host)["healthy"],
                 what=f"the origin to see {host} back")
        again = kube.restart(cid)
        kube.wait_state(again, RUNNING)
        assert kube.host_of(again) == host, explain(f, again)
        f.agents[_other(host)].start()
        f.wait_meshed()
        settled(f, kube)
        kube.remove(cid)
        settled(f, kube)
