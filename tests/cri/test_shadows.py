"""The host's pure rules for shadows: which are orphans, how often Watch beats, what is never run."""

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.shadows import KEY_LABEL, _label, _unsafe, heartbeat_s, orphans


def _shadow(cid: str, key: str) -> cri.Container:
    return cri.Container(id=cid, labels={KEY_LABEL: _label(key)})


@pytest.mark.parametrize(("keys", "orphaned"), [
    (["sb/a/0", "sb/b/0"], []),
    (["sb/a/0"], ["2"]),
    ([], ["1", "2"]),
    (["sb/a/1", "other/x/0"], ["1", "2"]),  # another attempt of the same container is another key
], ids=["all-owned", "one-dropped", "origin-owns-nothing", "other-attempt-is-not-owned"])
def test_shadows_whose_key_the_origin_no_longer_lists_are_orphans(keys: list[str], orphaned: list[str]) -> None:
    shadows = [_shadow("1", "sb/a/0"), _shadow("2", "sb/b/0")]
    assert [c.id for c in orphans(shadows, keys)] == orphaned


def test_a_shadow_without_a_key_label_is_an_orphan() -> None:
    assert [c.id for c in orphans([cri.Container(id="x")], ["sb/a/0"])] == ["x"]


@pytest.mark.parametrize(("asked", "expected"), [(0.0, 1.0), (0.5, 0.5), (0.01, 0.2), (60.0, 5.0), (-1.0, 1.0)],
                         ids=["host-default", "as-asked", "floor", "ceiling", "negative-means-default"])
def test_the_watch_interval_is_what_the_origin_asked_within_bounds(asked: float, expected: float) -> None:
    assert heartbeat_s(asked, 1.0) == expected


@pytest.mark.parametrize(("log_path", "refused"), [
    ("tokenize/0.log", False), ("0.log", False), ("../../etc/cron.d/x", True), ("/var/log/x.log", True),
    ("a/../../x", True)], ids=["kubelet-style", "flat", "dotdot", "absolute", "dotdot-inside"])
def test_a_log_path_may_not_leave_the_pods_log_directory(log_path: str, refused: bool) -> None:
    assert bool(_unsafe(cri.PodSandboxConfig(), cri.ContainerConfig(log_path=log_path))) is refused
