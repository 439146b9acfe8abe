"""Rerouting a CPU container: safety, the peer's free capacity and Admit, the origin's ranking and decision.

The tables read as the rules a pod author and an operator rely on; the
property tests check the two promises that matter most against models
written here, apart from the module: no peer is offered a container it has no
room for, and a container is rerouted exactly when it is safe and some live
peer has room.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim.core.reroute import (
    ZERO,
    AdmitReason,
    ContainerFacts,
    MountSort,
    PeerRejection,
    PeerView,
    RerouteReason,
    Resources,
    SafetyReason,
    admit,
    check_safety,
    choose_peers,
    classify_mounts,
    decide,
    free_capacity,
)

GI = 2**30
MI = 2**20
LIMITS = Resources(2.0, 4 * GI)
SAFE = ContainerFacts(limits=LIMITS)
PODS = "/var/lib/kubelet/pods"
UID = "0b5e6c1a-4e1f-4a8e-9a53-0c1d2e3f4a5b"
VOL = f"{PODS}/{UID}/volumes"


def peer(node: str, cpu: float = 8.0, gib: int = 16, *, cpu_host: bool = True, healthy: bool = True,
         age: float = 1.0, draining: bool = False) -> PeerView:
    return PeerView(node, cpu_host, healthy, Resources(cpu, gib * GI), age, draining)


# -- the vocabulary crictl and `weft explain` show ------------------------------
@pytest.mark.parametrize(
    ("enum", "values"),
    [
        pytest.param(SafetyReason, {"safe", "privileged", "host-network", "host-pid", "host-ipc", "host-path-mount",
                                    "shared-writable-volume", "host-devices", "not-baseline", "no-limits"},
                     id="safety"),
        pytest.param(AdmitReason, {"admitted", "insufficient-cpu", "insufficient-memory", "unhealthy",
                                   "not-a-cpu-host", "no-limits", "draining"}, id="admit"),
        pytest.param(PeerRejection, {"stale", "unhealthy", "not-a-cpu-host", "insufficient-cpu",
                                     "insufficient-memory", "no-limits", "draining"}, id="peer-rejection"),
        pytest.param(RerouteReason, {"rerouted", "no-peers", "no-peer-fits", "unsafe", "pinned-local"},
                     id="reroute"),
    ],
)
def test_reason_values_are_the_stable_kebab_case_strings(enum: type, values: set[str]) -> None:
    assert {member.value for member in enum} == values


def test_every_admit_refusal_is_also_a_reason_the_origin_can_reject_a_peer_for() -> None:
    refusals = {r.value for r in AdmitReason if r is not AdmitReason.ADMITTED}
    assert refusals <= {r.value for r in PeerRejection}


# -- Resources -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ask", "room", "fits"),
    [
        pytest.param(Resources(1.0, GI), Resources(2.0, 2 * GI), True, id="smaller-in-both-fits"),
        pytest.param(Resources(2.0, 2 * GI), Resources(2.0, 2 * GI), True, id="exact-fit-fits"),
        pytest.param(Resources(2.001, GI), Resources(2.0, 2 * GI), False, id="a-millicore-too-many"),
        pytest.param(Resources(1.0, 2 * GI + 1), Resources(2.0, 2 * GI), False, id="a-byte-too-many"),
        pytest.param(Resources(0.3, GI), Resources(4.0, GI).minus(Resources(3.7, 0)), True,
                     id="exact-fit-survives-float-rounding-of-a-difference"),
        pytest.param(ZERO, ZERO, True, id="nothing-fits-in-nothing"),
    ],
)
def test_fits_in(ask: Resources, room: Resources, fits: bool) -> None:
    assert ask.fits_in(room) is fits


def test_minus_is_the_plain_difference_and_may_go_negative() -> None:
    assert Resources(1.5, GI).minus(Resources(2.0, 2 * GI)) == Resources(-0.5, -GI)


def test_resources_read_as_cpu_and_memory_for_people() -> None:
    assert str(Resources(2.5, 3 * GI // 2)) == "2.5 CPU, 1.5Gi"
    assert str(Resources(0.1 + 0.2, 512 * MI)) == "0.3 CPU, 512Mi"


# -- safety ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("facts", "reason", "detail"),
    [
        pytest.param(SAFE, SafetyReason.SAFE, "no privilege", id="plain-container-with-limits-is-safe"),
        pytest.param(ContainerFacts(limits=LIMITS, readonly_copyable_mounts=(f"{VOL}/kubernetes.io~secret/s",)),
                     SafetyReason.SAFE, "no privilege", id="copyable-secret-is-safe"),
        pytest.param(ContainerFacts(privileged=True, limits=LIMITS), SafetyReason.PRIVILEGED,
                     "privileged: true", id="privileged"),
        pytest.param(ContainerFacts(host_network=True, limits=LIMITS), SafetyReason.HOST_NETWORK,
                     "hostNetwork: true", id="host-network"),
        pytest.param(ContainerFacts(host_pid=True, limits=LIMITS), SafetyReason.HOST_PID, "hostPID: true",
                     id="host-pid"),
        pytest.param(ContainerFacts(host_ipc=True, limits=LIMITS), SafetyReason.HOST_IPC, "hostIPC: true",
                     id="host-ipc"),
        pytest.param(ContainerFacts(host_path_mounts=("/data", "/var/log"), limits=LIMITS), SafetyReason.HOST_PATH,
                     "/data, /var/log", id="host-path-names-every-path"),
        pytest.param(ContainerFacts(writable_shared_mounts=(f"{VOL}/kubernetes.io~empty-dir/scratch",),
                                    limits=LIMITS),
                     SafetyReason.SHARED_WRITABLE_VOLUME, "kubernetes.io~empty-dir/scratch",
                     id="volume-shared-with-a-local-container"),
        pytest.param(ContainerFacts(devices=("/dev/fuse",), limits=LIMITS), SafetyReason.DEVICES, "/dev/fuse",
                     id="host-device"),
        pytest.param(ContainerFacts(), SafetyReason.NO_LIMITS, "no CPU or memory limit", id="no-limits-at-all"),
        pytest.param(ContainerFacts(limits=ZERO), SafetyReason.NO_LIMITS, "no CPU or memory limit",
                     id="zero-limits-are-cri-for-unlimited"),
        pytest.param(ContainerFacts(limits=Resources(0.0, GI)), SafetyReason.NO_LIMITS, "no CPU limit",
                     id="memory-limit-only"),
        pytest.param(ContainerFacts(limits=Resources(1.0, 0)), SafetyReason.NO_LIMITS, "no memory limit",
                     id="cpu-limit-only"),
        pytest.param(ContainerFacts(privileged=True, host_network=True, devices=("/dev/fuse",)),
                     SafetyReason.PRIVILEGED, "privileged", id="privileged-is-reported-before-everything"),
        pytest.param(ContainerFacts(host_pid=True, host_ipc=True, limits=LIMITS), SafetyReason.HOST_PID, "hostPID",
                     id="pid-before-ipc"),
        pytest.param(ContainerFacts(host_path_mounts=("/data",), devices=("/dev/fuse",), limits=LIMITS),
                     SafetyReason.HOST_PATH, "/data", id="host-path-before-devices"),
        pytest.param(ContainerFacts(writable_shared_mounts=("/v",)), SafetyReason.SHARED_WRITABLE_VOLUME, "/v",
                     id="shared-volume-before-missing-limits"),
    ],
)
def test_check_safety_reports_the_first_rule_broken(facts: ContainerFacts, reason: SafetyReason,
                                                    detail: str) -> None:
    got = check_safety(facts)
    assert got.reason is reason
    assert got.safe is (reason is SafetyReason.SAFE)
    assert detail in got.detail


flags = st.booleans()
some_paths = st.lists(st.sampled_from(["/data", "/dev/fuse", "/v"]), max_size=2).map(tuple)
limit_values = st.one_of(
    st.none(),
    st.builds(Resources, st.sampled_from([0.0, 0.5, 2.0]), st.sampled_from([0, GI])),
)
container_facts = st.builds(
    ContainerFacts, flags, flags, flags, flags, some_paths, some_paths, some_paths, some_paths, limit_values,
    st.sampled_from(["", "capabilities: adds NET_ADMIN"]),
)


def model_first_unsafe(f: ContainerFacts) -> SafetyReason:
    rules = [
        (f.privileged, SafetyReason.PRIVILEGED),
        (f.host_network, SafetyReason.HOST_NETWORK),
        (f.host_pid, SafetyReason.HOST_PID),
        (f.host_ipc, SafetyReason.HOST_IPC),
        (len(f.host_path_mounts) > 0, SafetyReason.HOST_PATH),
        (len(f.writable_shared_mounts) > 0, SafetyReason.SHARED_WRITABLE_VOLUME),
        (len(f.devices) > 0, SafetyReason.DEVICES),
        (bool(f.beyond_baseline), SafetyReason.NOT_BASELINE),
        (f.limits is None or f.limits.cpu_cores == 0 or f.limits.memory_bytes == 0, SafetyReason.NO_LIMITS),
    ]
    return next((reason for broken, reason in rules if broken), SafetyReason.SAFE)


@given(container_facts)
def test_check_safety_follows_the_documented_order(facts: ContainerFacts) -> None:
    assert check_safety(facts).reason is model_first_unsafe(facts)


# -- sorting CRI mounts ----------------------------------------------------------
@pytest.mark.parametrize(
    ("mount", "expected"),
    [
        pytest.param((f"{VOL}/kubernetes.io~configmap/cfg", "/etc/cfg", True),
                     MountSort((), (f"{VOL}/kubernetes.io~configmap/cfg",), ()), id="readonly-configmap-is-copied"),
        pytest.param((f"{VOL}/kubernetes.io~secret/tls", "/tls", True),
                     MountSort((), (f"{VOL}/kubernetes.io~secret/tls",), ()), id="readonly-secret-is-copied"),
        pytest.param((f"{VOL}/kubernetes.io~projected/kube-api-access-x", "/var/run/secrets", True),
                     MountSort((), (f"{VOL}/kubernetes.io~projected/kube-api-access-x",), ()),
                     id="service-account-token-is-copied"),
        pytest.param((f"{VOL}/kubernetes.io~downward-api/info", "/info", True),
                     MountSort((), (f"{VOL}/kubernetes.io~downward-api/info",), ()), id="downward-api-is-copied"),
        pytest.param((f"{VOL}/kubernetes.io~configmap/cfg", "/etc/cfg", False),
                     MountSort((f"{VOL}/kubernetes.io~configmap/cfg",), (), ()),
                     id="writable-configmap-stays-because-a-copy-would-diverge"),
        pytest.param((f"{VOL}/kubernetes.io~empty-dir/scratch", "/scratch", False),
                     MountSort((), (), (f"{VOL}/kubernetes.io~empty-dir/scratch",)), id="empty-dir-is-a-pod-volume"),
        pytest.param((f"{VOL}/kubernetes.io~empty-dir/model", "/model", True),
                     MountSort((), (), (f"{VOL}/kubernetes.io~empty-dir/model",)),
                     id="readonly-empty-dir-is-still-a-pod-volume-a-local-container-may-fill"),
        pytest.param((f"{PODS}/{UID}/etc-hosts", "/etc/hosts", False), MountSort((), (), ()),
                     id="kubelets-etc-hosts-is-ignored"),
        pytest.param((f"{PODS}/{UID}/containers/app/7f3a9c1e", "/dev/termination-log", False),
                     MountSort((), (), ()), id="termination-log-is-ignored"),
        pytest.param(("/data", "/data", False), MountSort(("/data",), (), ()), id="host-path"),
        pytest.param(("/etc/ssl/certs", "/etc/ssl/certs", True), MountSort(("/etc/ssl/certs",), (), ()),
                     id="readonly-host-path-is-still-a-host-path"),
        pytest.param((f"{VOL}/kubernetes.io~csi/pvc-1/mount", "/db", False),
                     MountSort((f"{VOL}/kubernetes.io~csi/pvc-1/mount",), (), ()),
                     id="attached-volume-stays-on-this-node"),
        pytest.param((f"{PODS}/{UID}/volume-subpaths/cfg/app/0", "/etc/app.conf", True),
                     MountSort((f"{PODS}/{UID}/volume-subpaths/cfg/app/0",), (), ()),
                     id="subpath-bind-of-unknown-plugin-stays"),
        pytest.param((f"{VOL}/kubernetes.io~configmap", "/all", True), MountSort((f"{VOL}/kubernetes.io~configmap",),
                                                                                  (), ()),
                     id="a-whole-plugin-directory-is-a-host-path"),
        pytest.param((f"{PODS}/{UID}/containers/app", "/c", False), MountSort((f"{PODS}/{UID}/containers/app",),
                                                                               (), ()),
                     id="a-containers-directory-is-not-the-termination-log"),
        pytest.param((PODS, "/pods", True), MountSort((PODS,), (), ()), id="the-pods-directory-itself"),
        pytest.param((f"{VOL}/kubernetes.io~configmap/../../../../../../../etc", "/x", True),
                     MountSort(("/etc",), (), ()), id="dot-dot-cannot-dress-a-host-path-as-a-volume"),
        pytest.param(("/var/lib/kubelet/podsx/u/etc-hosts", "/etc/hosts", False),
                     MountSort(("/var/lib/kubelet/podsx/u/etc-hosts",), (), ()),
                     id="a-sibling-with-the-same-prefix-is-not-the-pods-dir"),
        pytest.param(("", "/x", False), MountSort((".",), (), ()), id="an-empty-host-path-is-not-trusted"),
    ],
)
def test_classify_mounts(mount: tuple[str, str, bool], expected: MountSort) -> None:
    assert classify_mounts([mount]) == expected


def test_classify_mounts_keeps_order_within_each_kind_and_unpacks_as_three() -> None:
    mounts = [
        ("/b", "/b", False),
        (f"{VOL}/kubernetes.io~empty-dir/e2", "/e2", False),
        (f"{VOL}/kubernetes.io~secret/s", "/s", True),
        ("/a", "/a", False),
        (f"{VOL}/kubernetes.io~empty-dir/e1", "/e1", False),
        (f"{PODS}/{UID}/etc-hosts", "/etc/hosts", False),
    ]
    host, copyable, volumes = classify_mounts(mounts)
    assert host == ("/b", "/a")
    assert copyable == (f"{VOL}/kubernetes.io~secret/s",)
    assert volumes == (f"{VOL}/kubernetes.io~empty-dir/e2", f"{VOL}/kubernetes.io~empty-dir/e1")


@pytest.mark.parametrize(
    ("pods_dir", "host_path", "expected"),
    [
        pytest.param("/data/kubelet/pods", "/data/kubelet/pods/u/volumes/kubernetes.io~secret/s",
                     MountSort((), ("/data/kubelet/pods/u/volumes/kubernetes.io~secret/s",), ()),
                     id="custom-kubelet-root"),
        pytest.param("/var/lib/kubelet/pods/", f"{VOL}/kubernetes.io~secret/s",
                     MountSort((), (f"{VOL}/kubernetes.io~secret/s",), ()), id="trailing-slash-on-the-pods-dir"),
        pytest.param("/data/kubelet/pods", f"{VOL}/kubernetes.io~secret/s",
                     MountSort((f"{VOL}/kubernetes.io~secret/s",), (), ()),
                     id="default-layout-under-another-root-is-a-host-path"),
    ],
)
def test_classify_mounts_under_another_kubelet_root(pods_dir: str, host_path: str, expected: MountSort) -> None:
    assert classify_mounts([(host_path, "/x", True)], pods_dir) == expected


@pytest.mark.parametrize(
    ("uid", "expected"),
    [
        pytest.param(UID, MountSort((), (f"{VOL}/kubernetes.io~secret/s",), ()), id="own-pods-secret-is-copied"),
        pytest.param("another-pod", MountSort((f"{VOL}/kubernetes.io~secret/s",), (), ()),
                     id="another-pods-secret-is-a-host-path"),
    ],
)
def test_classify_mounts_with_the_pod_uid(uid: str, expected: MountSort) -> None:
    assert classify_mounts([(f"{VOL}/kubernetes.io~secret/s", "/s", True)], pod_uid=uid) == expected


# -- free capacity ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("own", "hosted", "used", "reserve", "free"),
    [
        pytest.param(Resources(10, 20 * GI), Resources(4, 8 * GI), Resources(6, 12 * GI), ZERO,
                     Resources(18, 36 * GI), id="books-lower-than-measurement-idle-requests-are-kept"),
        pytest.param(Resources(4, 8 * GI), ZERO, Resources(20, 40 * GI), ZERO, Resources(12, 24 * GI),
                     id="measurement-lower-than-books-bursting-pods-are-kept"),
        pytest.param(Resources(20, 10 * GI), ZERO, Resources(10, 30 * GI), ZERO, Resources(12, 34 * GI),
                     id="each-dimension-takes-its-own-minimum"),
        pytest.param(Resources(10, 20 * GI), Resources(4, 8 * GI), Resources(6, 12 * GI), Resources(2, 4 * GI),
                     Resources(16, 32 * GI), id="reserve-is-kept-free"),
        pytest.param(Resources(30, 60 * GI), Resources(4, 8 * GI), ZERO, ZERO, ZERO,
                     id="overcommitted-books-give-zero-not-negative"),
        pytest.param(ZERO, ZERO, Resources(40, 70 * GI), ZERO, ZERO,
                     id="measured-over-allocatable-gives-zero-not-negative"),
        pytest.param(ZERO, ZERO, ZERO, Resources(40, 80 * GI), ZERO, id="reserve-over-allocatable-gives-zero"),
        pytest.param(ZERO, ZERO, ZERO, ZERO, Resources(32, 64 * GI), id="idle-empty-node-offers-everything"),
    ],
)
def test_free_capacity(own: Resources, hosted: Resources, used: Resources, reserve: Resources,
                       free: Resources) -> None:
    assert free_capacity(Resources(32, 64 * GI), own, hosted, used, reserve=reserve) == free


cores = st.integers(0, 128_000).map(lambda milli: milli / 1000)
memory = st.integers(0, 2**40)
resources = st.builds(Resources, cores, memory)


@given(resources, resources, resources, resources, resources)
def test_free_capacity_is_never_negative_and_never_more_than_either_account(
        allocatable: Resources, own: Resources, hosted: Resources, used: Resources, reserve: Resources) -> None:
    free = free_capacity(allocatable, own, hosted, used, reserve=reserve)
    assert free.cpu_cores >= 0 and free.memory_bytes >= 0
    books_cpu = allocatable.cpu_cores - own.cpu_cores - hosted.cpu_cores - reserve.cpu_cores
    measured_cpu = allocatable.cpu_cores - used.cpu_cores - reserve.cpu_cores
    books_mem = allocatable.memory_bytes - own.memory_bytes - hosted.memory_bytes - reserve.memory_bytes
    measured_mem = allocatable.memory_bytes - used.memory_bytes - reserve.memory_bytes
    assert free.memory_bytes == max(0, min(books_mem, measured_mem))
    assert free.cpu_cores == pytest.approx(max(0.0, min(books_cpu, measured_cpu)), abs=1e-9)


# -- admission on the peer -------------------------------------------------------
FREE = Resources(4.0, 8 * GI)


@pytest.mark.parametrize(
    ("limits", "kwargs", "reason", "detail"),
    [
        pytest.param(Resources(1.0, 2 * GI), {}, AdmitReason.ADMITTED, "leaves 3 CPU, 6Gi", id="fits"),
        pytest.param(FREE, {}, AdmitReason.ADMITTED, "leaves 0 CPU, 0", id="exact-fit-is-admitted"),
        pytest.param(Resources(5.0, 2 * GI), {}, AdmitReason.INSUFFICIENT_CPU, "5 CPU asked, 4 free", id="cpu-short"),
        pytest.param(Resources(1.0, 9 * GI), {}, AdmitReason.INSUFFICIENT_MEMORY, "9Gi memory asked, 8Gi free",
                     id="memory-short"),
        pytest.param(Resources(5.0, 9 * GI), {}, AdmitReason.INSUFFICIENT_CPU, "5 CPU asked, 4 free; 9Gi memory",
                     id="both-short-reports-cpu-and-names-both"),
        pytest.param(Resources(1.0, GI), {"healthy": False}, AdmitReason.UNHEALTHY, "unhealthy", id="unhealthy"),
        pytest.param(Resources(1.0, GI), {"cpu_host": False}, AdmitReason.NOT_A_CPU_HOST, "role",
                     id="gpu-only-node-is-not-a-cpu-host"),
        pytest.param(Resources(1.0, GI), {"cpu_host": False, "healthy": False}, AdmitReason.NOT_A_CPU_HOST, "role",
                     id="role-is-reported-before-health"),
        pytest.param(Resources(9.0, GI), {"healthy": False}, AdmitReason.UNHEALTHY, "unhealthy",
                     id="health-is-reported-before-capacity"),
        pytest.param(Resources(1.0, GI), {"draining": True}, AdmitReason.DRAINING, "draining",
                     id="a-draining-host-admits-nothing-new-however-much-room"),
        pytest.param(Resources(9.0, GI), {"draining": True}, AdmitReason.DRAINING, "draining",
                     id="draining-is-reported-before-capacity"),
        pytest.param(Resources(1.0, GI), {"draining": True, "healthy": False}, AdmitReason.UNHEALTHY, "unhealthy",
                     id="health-is-reported-before-draining"),
        pytest.param(Resources(0.0, GI), {}, AdmitReason.NO_LIMITS, "no CPU limit",
                     id="zero-cpu-limit-is-unlimited-and-refused"),
        pytest.param(ZERO, {"cpu_host": False}, AdmitReason.NO_LIMITS, "no CPU or memory limit",
                     id="missing-limits-are-reported-before-the-host"),
    ],
)
def test_admit(limits: Resources, kwargs: dict[str, bool], reason: AdmitReason, detail: str) -> None:
    got = admit(limits, FREE, **kwargs)
    assert got.reason is reason
    assert got.admitted is (reason is AdmitReason.ADMITTED)
    assert detail in got.detail
    assert got.free_after == (FREE.minus(limits) if got.admitted else FREE)


def test_admit_exact_fit_after_float_rounding_leaves_zero_not_a_negative_sliver() -> None:
    free = Resources(4.0, GI).minus(Resources(3.7, 0))  # 0.2999999999999998
    got = admit(Resources(0.3, GI), free)
    assert got.reason is AdmitReason.ADMITTED
    assert got.free_after == ZERO


# -- the origin's ranking ---------------------------------------------------------
@pytest.mark.parametrize(
    ("peers", "candidates"),
    [
        pytest.param([peer("a", 4), peer("b", 8), peer("c", 6)], ("b", "c", "a"), id="most-free-cpu-first"),
        pytest.param([peer("a", 8, 8), peer("b", 8, 32), peer("c", 8, 16)], ("b", "c", "a"),
                     id="cpu-tie-goes-to-most-free-memory"),
        pytest.param([peer("c"), peer("a"), peer("b")], ("a", "b", "c"), id="full-tie-goes-by-node-name"),
        pytest.param([peer("a", 9, 4), peer("b", 3, 64)], ("a", "b"), id="cpu-outranks-memory"),
        pytest.param([peer("a", 2, 4)], ("a",), id="an-exact-fit-is-a-candidate"),
    ],
)
def test_choose_peers_orders_by_room_left(peers: list[PeerView], candidates: tuple[str, ...]) -> None:
    assert choose_peers(LIMITS, peers).candidates == candidates
    assert choose_peers(LIMITS, list(reversed(peers))).candidates == candidates


def test_with_a_spread_the_roomier_of_two_drawn_peers_goes_first_and_the_rest_by_room() -> None:
    peers = [peer(f"h{i:02d}", 3 + i) for i in range(20)]
    by_room = choose_peers(LIMITS, peers).candidates
    firsts = set()
    for pod in range(200):
        got = choose_peers(LIMITS, peers, spread=f"gpu-1/pod-{pod}").candidates
        assert got == choose_peers(LIMITS, list(reversed(peers)), spread=f"gpu-1/pod-{pod}").candidates  # same draw
        assert sorted(got) == sorted(by_room) and got[1:] == tuple(n for n in by_room if n != got[0])
        firsts.add(got[0])
    # Drawn: many hosts come first, not the roomiest alone; the roomier of two: never the one with the least.
    assert len(firsts) > 10 and by_room[-1] not in firsts
    # Another origin placing the same pod draws afresh.
    assert len({choose_peers(LIMITS, peers, spread=f"gpu-{o}/pod-1").candidates[0] for o in range(50)}) > 5


def test_with_a_spread_two_fitting_peers_still_go_roomiest_first() -> None:
    assert choose_peers(LIMITS, [peer("a", 4), peer("b", 8), peer("c", 1)], spread="x").candidates == ("b", "a")


@pytest.mark.parametrize(
    ("view", "why"),
    [
        pytest.param(peer("p", age=30.5), "stale", id="stale-view"),
        pytest.param(peer("p", healthy=False, cpu_host=False, cpu=0, age=31), "stale",
                     id="stale-view-is-not-trusted-for-anything-else"),
        pytest.param(peer("p", healthy=False), "unhealthy", id="unhealthy"),
        pytest.param(peer("p", cpu_host=False), "not-a-cpu-host", id="not-a-cpu-host"),
        pytest.param(peer("p", cpu=1.5), "insufficient-cpu", id="insufficient-cpu"),
        pytest.param(peer("p", gib=3), "insufficient-memory", id="insufficient-memory"),
        pytest.param(peer("p", draining=True), "draining", id="draining"),
    ],
)
def test_choose_peers_rejects_with_a_reason(view: PeerView, why: str) -> None:
    got = choose_peers(LIMITS, [view, peer("ok")])
    assert got.candidates == ("ok",)
    assert got.rejected == (("p", why),)


@pytest.mark.parametrize(
    ("age", "max_age", "fresh"),
    [
        pytest.param(30.0, 30.0, True, id="exactly-the-max-age-is-fresh"),
        pytest.param(30.001, 30.0, False, id="just-over-is-stale"),
        pytest.param(5.0, 2.0, False, id="max-age-is-configurable"),
    ],
)
def test_choose_peers_staleness_boundary(age: float, max_age: float, fresh: bool) -> None:
    got = choose_peers(LIMITS, [peer("p", age=age)], max_age_s=max_age)
    assert got.candidates == (("p",) if fresh else ())
    assert got.rejected == (() if fresh else (("p", "stale"),))


def test_choose_peers_lists_rejections_by_node_name() -> None:
    got = choose_peers(LIMITS, [peer("c", age=99), peer("a", cpu=0), peer("b", healthy=False)])
    assert got.candidates == ()
    assert got.rejected == (("a", "insufficient-cpu"), ("b", "unhealthy"), ("c", "stale"))


def test_choose_peers_with_no_peers() -> None:
    got = choose_peers(LIMITS, [])
    assert (got.candidates, got.rejected) == ((), ())


# -- the origin's decision --------------------------------------------------------
@pytest.mark.parametrize(
    ("facts", "peers", "pinned", "reason", "candidates", "detail"),
    [
        pytest.param(SAFE, [peer("a", 4), peer("b", 8)], False, RerouteReason.REROUTED, ("b", "a"), "fits on: b, a",
                     id="safe-and-peers-fit-rerouted-in-order"),
        pytest.param(SAFE, [peer("a", 4), peer("b", 1)], False, RerouteReason.REROUTED, ("a",), "fits on: a",
                     id="only-fitting-peers-are-candidates"),
        pytest.param(SAFE, [], False, RerouteReason.NO_PEERS, (), "no peers known", id="no-peers-known"),
        pytest.param(SAFE, [peer("a", age=60), peer("b", healthy=False), peer("c", cpu_host=False)], False,
                     RerouteReason.NO_PEERS, (), "a stale, b unhealthy, c not-a-cpu-host",
                     id="no-live-cpu-host-is-no-peers"),
        pytest.param(SAFE, [peer("a", draining=True), peer("b", 4)], False, RerouteReason.REROUTED, ("b",),
                     "fits on: b", id="a-draining-host-is-skipped-for-the-other"),
        pytest.param(SAFE, [peer("a", draining=True), peer("b", healthy=False)], False, RerouteReason.NO_PEERS, (),
                     "a draining, b unhealthy", id="draining-hosts-are-not-live-like-unhealthy-ones"),
        pytest.param(SAFE, [peer("a", 1), peer("b", gib=1)], False, RerouteReason.NO_PEER_FITS, (),
                     "a insufficient-cpu, b insufficient-memory", id="live-peers-without-room"),
        pytest.param(SAFE, [peer("a", age=60), peer("b", 1)], False, RerouteReason.NO_PEER_FITS, (),
                     "a stale, b insufficient-cpu", id="one-live-peer-without-room-is-no-fit-not-no-peers"),
        pytest.param(ContainerFacts(host_path_mounts=("/data",), limits=LIMITS), [peer("a")], False,
                     RerouteReason.UNSAFE, (), "host-path-mount: mounts data that stays on this node: /data",
                     id="unsafe-detail-starts-with-the-safety-reason"),
        pytest.param(ContainerFacts(), [peer("a")], False, RerouteReason.UNSAFE, (), "no-limits: ",
                     id="no-limits-is-unsafe"),
        pytest.param(SAFE, [peer("a")], True, RerouteReason.PINNED_LOCAL, (), "pinned", id="pinned-local"),
        pytest.param(ContainerFacts(privileged=True), [peer("a")], True, RerouteReason.PINNED_LOCAL, (), "pinned",
                     id="pinned-is-reported-before-safety"),
    ],
)
def test_decide(facts: ContainerFacts, peers: list[PeerView], pinned: bool, reason: RerouteReason,
                candidates: tuple[str, ...], detail: str) -> None:
    got = decide(facts, LIMITS, peers, pinned_local=pinned)
    assert got.reason is reason
    assert got.candidates == candidates
    assert detail in got.detail


def test_decide_passes_max_age_to_the_ranking() -> None:
    assert decide(SAFE, LIMITS, [peer("a", age=10)], max_age_s=5).reason is RerouteReason.NO_PEERS
    assert decide(SAFE, LIMITS, [peer("a", age=10)], max_age_s=15).reason is RerouteReason.REROUTED


# -- properties ------------------------------------------------------------------
# Millicores, as Kubernetes expresses them, so that the models below can
# compare floats exactly.
small_cores = st.integers(0, 8_000).map(lambda milli: milli / 1000)
small_memory = st.integers(0, 16).map(lambda gib: gib * GI)
limits_st = st.builds(Resources, st.integers(1, 8_000).map(lambda milli: milli / 1000),
                      st.integers(1, 16).map(lambda gib: gib * GI))


@st.composite
def peer_views(draw: st.DrawFn) -> list[PeerView]:
    names = draw(st.lists(st.text("abcdef", min_size=1, max_size=3), unique=True, max_size=8))
    return [
        PeerView(name, draw(st.booleans()), draw(st.booleans()), Resources(draw(small_cores), draw(small_memory)),
                 draw(st.sampled_from([0.0, 10.0, 30.0, 31.0])))
        for name in names
    ]


def model_can_host(view: PeerView, limits: Resources, max_age_s: float = 30.0) -> bool:
    return (view.sampled_age_s <= max_age_s and view.cpu_host and view.healthy
            and view.free.cpu_cores >= limits.cpu_cores and view.free.memory_bytes >= limits.memory_bytes)


@given(limits_st, peer_views())
def test_choose_peers_offers_exactly_the_peers_with_room_best_first(limits: Resources,
                                                                   views: list[PeerView]) -> None:
    got = choose_peers(limits, views)
    by_node = {v.node: v for v in views}
    assert {n for n in got.candidates} == {v.node for v in views if model_can_host(v, limits)}
    for node in got.candidates:
        free = by_node[node].free
        assert free.cpu_cores >= limits.cpu_cores and free.memory_bytes >= limits.memory_bytes
    assert sorted([*got.candidates, *(n for n, _ in got.rejected)]) == sorted(by_node)
    room = [(by_node[n].free.cpu_cores, by_node[n].free.memory_bytes) for n in got.candidates]
    assert room == sorted(room, reverse=True)
    assert choose_peers(limits, list(reversed(views))) == got


@given(container_facts, limits_st, peer_views(), st.booleans())
def test_decide_reroutes_exactly_when_safe_and_some_live_peer_has_room(
        facts: ContainerFacts, limits: Resources, views: list[PeerView], pinned: bool) -> None:
    got = decide(facts, limits, views, pinned_local=pinned)
    safe = model_first_unsafe(facts) is SafetyReason.SAFE
    some_fit = any(model_can_host(v, limits) for v in views)
    assert (got.reason is RerouteReason.REROUTED) == (not pinned and safe and some_fit)
    if got.reason is RerouteReason.REROUTED:
        by_node = {v.node: v for v in views}
        assert got.candidates and all(model_can_host(by_node[n], limits) for n in got.candidates)
    else:
        assert got.candidates == ()
