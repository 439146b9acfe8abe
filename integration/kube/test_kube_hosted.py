"""Hosted stages that Kubernetes can see, on a real cluster: each a reservation pod on its host.

Two nodes with their own kubelets, the agents given the API as weft's own
service account under the shipped RBAC. A two-stage pod's CPU stage is
rerouted to the CPU host, which makes the stage's reservation pod: bound to
itself, the stage's admitted limits as requests, the origin pod's priority,
labelled with its origin. The scheduler then counts that CPU, kubectl lists
the hosted stage, ``weft status`` shows the reservation, and a higher-priority
pod that needs the CPU preempts it: the shadow stops first, the origin's
kubelet sees the container end with weft's reason, and the restart is placed
afresh (here, locally), never two live copies.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from harness import fixture, preemption
from harness.cluster import KubeCluster, NodeSpec
from harness.workloads import (
    apply,
    container,
    container_status,
    crictl,
    delete,
    get_pod,
    pod,
    wait_ready,
)
from shim.core.reservation import cpu_shares, weight_of_shares
from shim.core.stats import percentile
from shim.localfabric.waiting import wait_for
from shim.shadowhost.group_weight import group_dirs

pytestmark = pytest.mark.slow

ORIGIN, HOST = "gpu-1", "cpu-1"
NS = "weft-system"


@pytest.fixture(scope="module")
def kube(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    # The host's watch acts on a lost reservation 3 s late, as a loaded host may (CI saw a preemptor run beside
    # the shadow it preempted): what keeps the two apart must not be the watch's speed.
    for c in fixture.cluster(request, tmp_path_factory, [NodeSpec(ORIGIN, "gpu"), NodeSpec(HOST, "cpu")],
                             agent_api=True, agent_env={"WEFT_FAILPOINT_DELAYS": "reservation.lost_seen=3"}):
        apply(c, *preemption.PRIORITY_CLASSES)
        yield c


def _two_stage(name: str) -> dict:
    return preemption.two_stage(name)


def _plain(name: str, cpu_millis: int, priority_class: str) -> dict:
    return preemption.plain(name, cpu_millis, priority_class, HOST)


def _reservations(kube: KubeCluster) -> list[dict]:
    return preemption.reservations(kube)


def _shadows(kube: KubeCluster, running: bool = True) -> list:
    return preemption.shadows(kube, ORIGIN, HOST, running)


def _free_cpu_millis(kube: KubeCluster) -> int:
    return preemption.free_cpu_millis(kube, HOST)


@pytest.fixture
def infer(kube: KubeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    apply(kube, _two_stage("infer"))
    try:
        wait_ready(kube, "infer")
        shadow = wait_for(lambda: _shadows(kube), timeout=30, what="the shadow running")[0]
        seen = time.monotonic()
        wait_for(lambda: _reservations(kube), timeout=30, what="the reservation", every=0.05)
        fixture.report(request.config, f"reservation visible {time.monotonic() - seen:.2f} s after the shadow was "
                       f"seen running ({shadow.id[:13]})")
        yield "infer"
    finally:
        delete(kube, "infer", "squeezed", "important")


def test_the_hosted_stage_is_a_pod_on_its_host_with_its_requests_labels_and_priority(kube, infer) -> None:
    (r,) = _reservations(kube)
    assert r["metadata"]["namespace"] == NS and r["spec"]["nodeName"] == HOST
    assert r["spec"]["priorityClassName"] == "low" and r["spec"]["priority"] == 10
    (c,) = r["spec"]["containers"]
    assert c["resources"]["requests"] == {"cpu": "500m", "memory": str(64 << 20)}  # as the host admitted it
    labels = r["metadata"]["labels"]
    assert (labels["weft.io/role"], labels["weft.io/origin-node"], labels["weft.io/origin-namespace"],
            labels["weft.io/origin-pod"], labels["weft.io/origin-container"]) == (
        "hosted-stage", ORIGIN, "default", "infer", "prep")
    wait_for(lambda: _reservations(kube)[0]["status"].get("phase") == "Running", timeout=60,
             what="kubelet running the reservation")
    # kubectl get pods -A -l weft.io/role=hosted-stage -o wide: every hosted stage with its node and origin
    wide = kube.kubectl("get", "pods", "-A", "-l", "weft.io/role=hosted-stage", "-o", "wide",
                        "-L", "weft.io/origin-pod").stdout
    assert HOST in wide and "infer" in wide
    # The host learns the phase from its own watch of its reservations, a moment after the API has it.
    def reservation_seen() -> dict | None:
        (shadow,) = [s for s in kube.agent_status(HOST)["shadows"] if s["name"] == "prep"]
        return shadow["reservation"] if shadow["reservation"]["state"] != "pending" else None

    seen = wait_for(reservation_seen, timeout=15, what="weft status showing the reservation admitted")
    assert seen == {"name": r["metadata"]["name"], "state": "admitted"}


def test_the_scheduler_counts_the_stage_s_cpu(kube, infer) -> None:
    wait_for(lambda: _reservations(kube)[0]["status"].get("phase") == "Running", timeout=60,
             what="the reservation running")
    apply(kube, _plain("squeezed", _free_cpu_millis(kube) + 300, "low"))  # fits only with the stage's CPU
    wait_for(lambda: any("Insufficient cpu" in c.get("message", "")
                         for c in get_pod(kube, "squeezed").get("status", {}).get("conditions", [])),
             timeout=60, what="the plain pod waiting for CPU")
    delete(kube, "infer")
    wait_for(lambda: get_pod(kube, "squeezed").get("status", {}).get("phase") == "Running", timeout=120,
             what="the plain pod running once the stage is gone")
    assert not _reservations(kube)
    # The reservation goes when the shadow stops (a stopped shadow holds no CPU); the shadow itself when the
    # origin's kubelet removes its container, which may come after the plain pod runs on a loaded machine.
    wait_for(lambda: not _shadows(kube, running=False), timeout=60, what="the stage's shadow removed")


PREEMPTIONS = 10


def test_a_higher_priority_pod_preempts_the_stage_which_is_placed_afresh(kube, request) -> None:
    """Ten times over: the preemptor's container never runs beside the shadow (the reservation's preStop hook
    holds the CPU until the host has stopped it), the origin's kubelet sees weft's reason, the restart is placed
    afresh, never two live copies."""
    waits: list[float] = []
    for i in range(PREEMPTIONS):
        seen = preemption.preempt(kube, ORIGIN, HOST, i)
        assert seen.stop_hook, "the reservation carries no preStop hook"
        assert seen.overlap_samples == 0, f"preemption {i + 1}: the preemptor ran beside the shadow"
        assert seen.shadow_stopped_first, f"preemption {i + 1}: the preemptor ran before the shadow stopped"
        assert seen.reason == "ReservationPreempted", seen
        assert seen.most_copies <= 1  # never two live copies
        assert seen.shadows_after == 0  # placed afresh: here, on the origin, not back on the host that lost it
        again = seen.placed_again
        assert again.get("placement") == "local" and "ReservationPreempted" in again.get("detail", ""), again
        waits.append(seen.wait_s)
    waits.sort()
    fixture.report(request.config, f"preemptor created to its container running, {PREEMPTIONS} preemptions with "
                   f"the shadow stopped first: p50 {percentile(waits, 50):.2f} s, max {waits[-1]:.2f} s")


def test_deleting_the_pod_leaves_no_reservation(kube, infer) -> None:
    assert _reservations(kube)
    delete(kube, "infer")
    wait_for(lambda: not _reservations(kube), timeout=60, what="the reservation gone with its pod")
    assert not _shadows(kube, running=False)


def _stage_pod(name: str, prep: dict, volumes: list[dict], model_mounts: list[dict] = ()) -> dict:
    model = container("model", "exec sleep 3600", env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                      volumeMounts=list(model_mounts))
    return pod(name, [model, prep], runtime_class="weft", node_selector={"weft.io/role": "gpu"},
               annotations={"weft.io/gpu-memory.model": "10Gi"}, volumes=volumes)


def _placement(kube: KubeCluster, pod_name: str, container_name: str) -> dict:
    status = kube.agent_status(ORIGIN)
    sandbox = next(s["id"] for s in status["sandboxes"] if s["name"] == pod_name)
    return next(p for p in status["placements"] if p["sandbox_id"] == sandbox and p["name"] == container_name)


def test_placement_reads_the_pod_spec(kube: KubeCluster) -> None:
    limits = {"requests": {"cpu": "100m", "memory": "32Mi"}, "limits": {"cpu": "300m", "memory": "64Mi"}}
    own = _stage_pod("own-scratch", container(
        "prep", "echo kept > /scratch/f; exec sleep 3600", resources=limits,
        volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}]),
        [{"name": "scratch", "emptyDir": {"sizeLimit": "10Mi"}}])
    shared = _stage_pod("shared-scratch", container(
        "prep", "exec sleep 3600", resources=limits, volumeMounts=[{"name": "handoff", "mountPath": "/out"}]),
        [{"name": "handoff", "emptyDir": {}}], model_mounts=[{"name": "handoff", "mountPath": "/in"}])
    by_requests = _stage_pod("no-limits", container(
        "prep", "exec sleep 3600", resources={"requests": {"cpu": "150m", "memory": "48Mi"}}), [])
    apply(kube, own, shared, by_requests)
    try:
        for name in ("own-scratch", "shared-scratch", "no-limits"):
            wait_ready(kube, name)
        # An emptyDir only the CPU stage mounts follows it: the host made it fresh, and it is writable there.
        p = _placement(kube, "own-scratch", "prep")
        assert p["placement"] == f"remote:{HOST}" and "pod spec read" in p["detail"], (p["reason"], p["detail"])
        assert kube.kubectl("exec", "own-scratch", "-c", "prep", "--", "cat", "/scratch/f").stdout == "kept\n"
        # One it shares with the GPU stage keeps it here, and says why.
        p = _placement(kube, "shared-scratch", "prep")
        assert (p["placement"], p["reason"]) == ("local", "unsafe") and "shared" in p["detail"], p
        # No limits: admitted by its requests, which its reservation asks for.
        p = _placement(kube, "no-limits", "prep")
        assert p["placement"] == f"remote:{HOST}", p
        (r,) = [r for r in _reservations(kube) if r["metadata"]["labels"]["weft.io/origin-pod"] == "no-limits"]
        assert r["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "150m", "memory": str(48 << 20)}
    finally:
        delete(kube, "own-scratch", "shared-scratch", "no-limits")


def _started_after(kube: KubeCluster, name: str, container_name: str, since: float) -> float:
    def running() -> float | None:
        for c in get_pod(kube, name).get("status", {}).get("containerStatuses", []):
            if c["name"] == container_name and "running" in c.get("state", {}):
                return time.monotonic() - since
        return None

    return wait_for(running, timeout=120, what=f"{name}/{container_name} running", every=0.05)


def test_figures_start_with_a_reservation_and_the_alternative(kube: KubeCluster, request) -> None:
    """Start of the CPU stage rerouted (with its reservation) against the same pod all local, the
    reservation's delay after the shadow, and, for the design's comparison, a pod bound to the host through
    the API (what a shadow made as a real Pod would take). Reported, not asserted: they measure the machine."""
    rows: dict[str, list[float]] = {"rerouted": [], "local": [], "bound pod": [], "reservation after shadow": []}
    for i in range(2):
        for mode in ("rerouted", "local"):
            p = _two_stage(f"fig-{mode}-{i}")
            if mode == "local":
                p["metadata"]["annotations"].update({"weft.io/stage.prep": "local", "weft.io/stage.model": "local"})
            began = time.monotonic()
            apply(kube, p)
            rows[mode].append(_started_after(kube, p["metadata"]["name"], "prep", began))
            if mode == "rerouted":
                seen = time.monotonic()
                wait_for(lambda n=p["metadata"]["name"]: [r for r in _reservations(kube)
                                                          if r["metadata"]["labels"]["weft.io/origin-pod"] == n],
                         timeout=30, what="the reservation", every=0.02)
                rows["reservation after shadow"].append(time.monotonic() - seen)
            delete(kube, p["metadata"]["name"])
        bound = pod(f"fig-bound-{i}", [container("prep", "exec sleep 3600")], grace=0)
        bound["spec"]["nodeName"] = HOST
        began = time.monotonic()
        apply(kube, bound)
        rows["bound pod"].append(_started_after(kube, f"fig-bound-{i}", "prep", began))
        delete(kube, f"fig-bound-{i}")
    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    fixture.report(request.config, "figures (the later of 2, apply to the CPU stage running): " + ", ".join(
        f"{k} {v:.2f} s" for k, v in med.items()) + f"; rerouted/local {med['rerouted'] / med['local']:.2f}x")
    assert all(rows.values())


def test_the_shadows_cgroup_weighs_what_its_stages_request(kube: KubeCluster) -> None:
    """The cgroup the host's shadows share (a sibling of kubelet's pods cgroup on a node) weighs the sum of its
    running shadows' requests, as kubelet weighs its QoS cgroups, and goes back to the floor when they end."""
    root = kube.node(HOST).containerd.cgroup_root
    (shadows_dir, _), v2 = group_dirs(f"{root}/shadows")
    knob = "cpu.weight" if v2 else "cpu.shares"

    def weight(shares: int) -> str:
        return str(weight_of_shares(shares) if v2 else shares)

    stages = [_two_stage(f"weighed-{i}") for i in range(2)]
    for p, cpu in zip(stages, ("200m", "300m"), strict=True):
        p["spec"]["containers"][1]["resources"]["requests"]["cpu"] = cpu
    try:
        apply(kube, *stages)
        for p in stages:
            wait_ready(kube, p["metadata"]["name"])
        wait_for(lambda: len(_shadows(kube)) == 2, timeout=30, what="both stages running on the host")
        # kubelet's weight for each stage's request, which its shadow was made with; the group has their sum
        wait_for(lambda: (shadows_dir / knob).read_text().strip() == weight(cpu_shares(200) + cpu_shares(300)),
                 timeout=10, what=f"the shadows' {knob} at the sum of the stages' requests")
        delete(kube, stages[1]["metadata"]["name"])
        wait_for(lambda: (shadows_dir / knob).read_text().strip() == weight(cpu_shares(200)), timeout=30,
                 what="the group's weight down to the one stage left")
    finally:
        delete(kube, *(p["metadata"]["name"] for p in stages))


def test_without_the_api_shadows_run_on_a_restart_is_placed_by_the_old_rules_and_reserved_once_it_is_back(
        kube: KubeCluster, infer) -> None:
    stopper = _two_stage("stopper")
    stopper["spec"]["containers"][1]["command"] = [
        "sh", "-c", "echo prep up; while [ ! -e /tmp/stop ]; do sleep 0.2; done; exit 3"]
    apply(kube, stopper)
    try:
        wait_ready(kube, "stopper")
        wait_for(lambda: len(_reservations(kube)) == 2 and all(
            r["status"].get("phase") == "Running" for r in _reservations(kube)), timeout=60,
            what="both reservations running")
        origin = kube.agent_status(ORIGIN)
        sandbox = next(s["id"] for s in origin["sandboxes"] if s["name"] == "stopper")
        (first,) = [p for p in origin["placements"] if p["name"] == "prep" and p["sandbox_id"] == sandbox]
        (kept,) = [s["id"] for s in _live(kube) if not s["key"].startswith(sandbox)]
        kube.control.stop_apiserver()
        try:
            # The stopper's CPU stage ends; kubelet, without its API server, restarts it: a new placement.
            crictl(kube.agents[ORIGIN].socket, "exec", first["container_id"], "touch", "/tmp/stop",
                   netns=kube.node(ORIGIN).netns_path)

            def restarted() -> dict | None:
                return next((p for p in kube.agent_status(ORIGIN)["placements"] if p["name"] == "prep"
                             and p["sandbox_id"] == sandbox and p["attempt"] == 1 and p["state"] != "pending"), None)

            again = wait_for(restarted, timeout=90, what="the stopper's CPU stage restarted")
            # Placed by the rules from before reservations, and weft explain says so.
            assert again["placement"] == f"remote:{HOST}" and "did not answer" in again["detail"], again
            (made,) = [s for s in _live(kube) if s["key"] == f"{sandbox}/prep/1"]
            assert made["reservation"] == {"name": made["reservation"]["name"], "state": "unreserved",
                                           "reason": "ApiUnreachable"}, made
            # Past the host's grace, what ran before the API went away runs on: nothing is judged without it.
            time.sleep(15)
            assert kept in {c.id for c in _shadows(kube)}, "a shadow stopped while the API was away"
        finally:
            kube.control.start_apiserver()
        kube.wait_node_ready(ORIGIN)
        # Reconciled once it is back: the restarted stage gets its reservation, kubelet admits it.
        def settled() -> dict | None:
            (s,) = [s for s in _live(kube) if s["key"] == f"{sandbox}/prep/1"] or [None]
            return s if s is None or s["reservation"]["state"] in ("admitted", "lost") else None

        # kubelet's pod watch comes back with client-go's backoff (up to a minute a try); the host waits for it.
        made = wait_for(settled, timeout=180, what="the restarted stage's reservation made and admitted")
        assert made is not None and made["reservation"]["state"] == "admitted", (
            made, kube.kubectl("get", "pods", "-A", "-o", "wide").stdout)
        assert len(_reservations(kube)) == 2 and kept in {c.id for c in _shadows(kube)}
    finally:
        delete(kube, "stopper")


def _live(kube: KubeCluster) -> list[dict]:
    """The host's shadows that run or are about to: an earlier test's exited ones linger until reaped."""
    return [s for s in kube.agent_status(HOST)["shadows"] if s["state"] in ("created", "running")]


def _books(kube: KubeCluster) -> tuple[set[str], set[str]]:
    """The keys of the host's live shadows, and those its reservation pods are for."""
    shadows = {s["key"] for s in _live(kube)}
    reserved = {(r["metadata"].get("annotations") or {}).get("weft.io/origin-key-full", "") for r in _reservations(kube)
                if not r["metadata"].get("deletionTimestamp")}
    return shadows, reserved


def _restart_host_agent(kube: KubeCluster, failpoint: str = "") -> None:
    agent = kube.agents[HOST]
    agent.stop()
    agent.env.pop("WEFT_FAILPOINTS", None)
    if failpoint:
        agent.env["WEFT_FAILPOINTS"] = failpoint
    agent.start(timeout=60)
    # Placement needs fresh Hellos from the restarted host, or the stage would simply stay on the origin.
    wait_for(lambda: any(p.get("healthy") for p in kube.agent_status(ORIGIN).get("peers", []) if p.get("node") == HOST),
             timeout=60, what=f"{ORIGIN} to see {HOST} healthy again")


def test_a_restarted_host_agent_hides_its_shadows_from_kubelet_before_its_first_reconciliation(
        kube: KubeCluster, infer) -> None:
    """The host's kubelet would take a shadow for an unknown pod and kill it; the list verbs hide shadows from
    the restarted agent's first answer, not from when its reconciler first looks (late on a loaded node, as
    in a DaemonSet rollout under load, where this restarted the rerouted stage)."""
    (shadow,) = wait_for(lambda: _shadows(kube), timeout=30, what="the shadow running")
    (r,) = wait_for(lambda: _reservations(kube), timeout=30, what="the reservation")
    agent = kube.agents[HOST]
    delays = agent.env.get("WEFT_FAILPOINT_DELAYS", "")
    # The agent serves kubelet 8 s before it opens its host side and its reconciler looks: a loaded node's
    # moment between the two, made long enough that kubelet surely lists and cleans up inside it.
    agent.env["WEFT_FAILPOINT_DELAYS"] = ",".join(filter(None, [delays, "agent.serving=8", "recovery.settle=8"]))
    try:
        _restart_host_agent(kube)
        time.sleep(3)  # what kubelet did inside that moment, seen by the origin
    finally:
        agent.env["WEFT_FAILPOINT_DELAYS"] = delays
        _restart_host_agent(kube)
    assert [s.id for s in _shadows(kube)] == [shadow.id], "the shadow is the one that ran before the restart"
    prep = container_status(get_pod(kube, "infer"), "prep")
    assert prep["restartCount"] == 0 and "running" in prep["state"], prep
    assert [x["metadata"]["uid"] for x in _reservations(kube)] == [r["metadata"]["uid"]], "the reservation kept"


def _killed_at_its_failpoint(kube: KubeCluster) -> None:
    proc = kube.agents[HOST].proc
    assert proc is not None
    assert proc.wait(60) == -9, kube.agents[HOST].log_text()[-2000:]
    _restart_host_agent(kube)  # systemd's Restart=always


@pytest.mark.parametrize("point", ["run_shadow.created", "run_shadow.reserved"])
def test_the_host_agent_killed_while_making_a_reservation_leaves_the_books_whole(kube: KubeCluster,
                                                                                point: str) -> None:
    """kill -9 between the shadow and its reservation, or just after the reservation: after the restart every
    live shadow has its reservation and every reservation its shadow, and the stage runs once."""
    _restart_host_agent(kube, point)
    try:
        apply(kube, _two_stage("crashed"))
        _killed_at_its_failpoint(kube)
        wait_ready(kube, "crashed")
        grace = 10.0 + 5.0  # the host's reservation grace, and a reconciliation round
        deadline = time.monotonic() + grace + 30
        while True:
            shadows, reserved = _books(kube)
            if shadows == reserved or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert shadows == reserved, (shadows, reserved)
        prep = container_status(get_pod(kube, "crashed"), "prep")
        assert "running" in prep["state"] and len(shadows) <= 1, (prep, shadows)  # one live copy at most
    finally:
        delete(kube, "crashed")
        kube.agents[HOST].env.pop("WEFT_FAILPOINTS", None)
        if kube.agents[HOST].proc is None:
            _restart_host_agent(kube)
    wait_for(lambda: _books(kube) == (set(), set()), timeout=60, what="no shadow and no reservation left")


def test_the_host_agent_killed_while_removing_a_reservation_leaves_no_orphan(kube: KubeCluster, infer) -> None:
    wait_for(lambda: _books(kube)[1], timeout=30, what="the reservation")
    _restart_host_agent(kube, "remove_shadow.removed")
    try:
        delete(kube, "infer")  # the host removes the shadow, and dies before it deletes the reservation
        _killed_at_its_failpoint(kube)
    finally:
        kube.agents[HOST].env.pop("WEFT_FAILPOINTS", None)
        if kube.agents[HOST].proc is None:
            _restart_host_agent(kube)
    wait_for(lambda: _books(kube) == (set(), set()), timeout=60,
             what="the orphan reservation deleted once the host is back")
