"""The agent's look at weft's place in containerd's configuration (``shim.install.dropin.Watch``), on host roots."""

from __future__ import annotations

from pathlib import Path

from shim.cli import main
from shim.install import containerd, dropin
from shim.install.host import Host
from tests.install.conftest import copy_shape

CTRD = containerd.Containerd("1.6.20~ds1", 1, 6, "test")
CONFIG = "etc/containerd/config.toml"


def _watch(root: Path) -> tuple[dropin.Watch, list[dropin.Status]]:
    seen: list[dropin.Status] = []
    return dropin.Watch(Host(root), lambda: CTRD, seen.append), seen


def test_a_node_weft_did_not_install_is_left_alone(tmp_path: Path) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    watch, seen = _watch(root)
    assert watch.check().state is dropin.State.NOT_INSTALLED and seen == []
    assert not (root / containerd.DROPIN.lstrip("/")).exists()


def test_each_change_is_seen_once_made_good_where_weft_can_and_said_where_it_cannot(
        tmp_path: Path, source: Path) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    watch, seen = _watch(root)
    assert watch.check().state is dropin.State.CURRENT
    assert watch.check().state is dropin.State.CURRENT and len(seen) == 1, "nothing new: said once"

    cfg = root / CONFIG  # another tool adds a runtime: the 1.x drop-in is made again with it
    cfg.write_text(cfg.read_text() + '\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
                                     '  runtime_type = "io.containerd.runc.v2"\n')
    status = watch.check()
    assert status.state is dropin.State.REGENERATED and status.wrote == [containerd.DROPIN]
    assert "runtimes.nvidia" in (root / containerd.DROPIN.lstrip("/")).read_text()

    cfg.write_text(containerd.without_import(cfg.read_text()))  # written anew without weft's import
    status = watch.check()
    assert status.state is dropin.State.NOT_IMPORTED and status.problem and seen[-1] is status
    assert containerd.DROPIN not in cfg.read_text(), "config.toml is not weft's to write back"
    assert watch.check() is status and len(seen) == 3


def test_a_file_weft_cannot_read_leaves_the_drop_in_as_it_was(tmp_path: Path, source: Path) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    before = (root / containerd.DROPIN.lstrip("/")).read_bytes()
    (root / CONFIG).write_text((root / CONFIG).read_text() + "[broken\n")
    watch, _ = _watch(root)
    status = watch.check()
    assert status.state is dropin.State.UNREADABLE and "/etc/containerd/config.toml: not valid TOML" in status.detail
    assert (root / containerd.DROPIN.lstrip("/")).read_bytes() == before


def test_the_agent_s_check_answers_what_its_status_shows(tmp_path: Path, source: Path) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    check = dropin.agent_watch(tmp_path / "no-containerd.sock", "", "weft-system", None, root=root)
    assert check() is None, "nothing to show where weft was not installed"
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    doc = check()
    assert doc is not None and (doc["state"], doc["problem"]) == ("current", False)
    assert doc["containerd"].startswith("1.6")
