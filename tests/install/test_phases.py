"""The installer's phases (``shim/install/phases.py``): one table that install, rollback and uninstall walk, and the
journal they keep exactly as nodes already have it on disk.

``recorded_journals.json`` holds the journals the installer wrote, before its steps were phases, when stopped at a
few points of an install and an uninstall (a containerd 2.x host with conf.d drop-ins, a broker and a mesh): the
installer still writes them byte for byte, and a node that has one is finished and undone from it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from shim import failpoint
from shim.install import containerd, phases, plan, run, services
from shim.install.host import Host, OriginalFiles
from tests.install.conftest import SHAPES, copy_shape, snapshot

RECORDED = json.loads((Path(__file__).parent / "recorded_journals.json").read_text())
JOURNAL = "var/lib/weft/install/journal.json"
MESH = plan.Mesh(node_name="cpu-7", role="cpu", address="127.0.0.1:7000", peers="kubernetes",
                 ca_crt=b"ca\n", node_crt=b"crt\n", node_key=b"key\n")
OPTIONS = plan.Options(broker="simulated", mesh=MESH)


class _Stopped(BaseException):
    """The process killed at a failpoint, in this process: nothing catches it."""


def _stop_at(monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    def hit(name: str) -> None:
        if name == point:
            raise _Stopped(name)
    monkeypatch.setattr(failpoint, "hit", hit)


def _settings(root: Path, source: Path) -> run.Settings:
    return run.Settings(root=root, source=source, options=OPTIONS, say=lambda line: None)


def _run_until(point: str, settings: run.Settings) -> None:
    """Install, and uninstall after it for an uninstall point, until ``point`` ("installed": to the end)."""
    try:
        run.install(settings)
        if point.startswith("uninstall."):
            run.uninstall(settings)
    except _Stopped:
        pass


def _owners_as_here(text: str) -> str:
    """The journal records each file's owner: the recorded ones ran as root."""
    return re.sub(r'"gid": \d+', f'"gid": {os.getgid()}', re.sub(r'"uid": \d+', f'"uid": {os.getuid()}', text))


def test_the_journal_records_the_steps_by_the_names_nodes_have_on_disk() -> None:
    assert run.INSTALL_STEPS == ("bundle", "units", "containerd-config", "containerd-restart", "weft-start",
                                 "agent-verify", "kubelet-config", "kubelet-restart", "kubelet-health")
    assert run.UNINSTALL_STEPS == ("kubelet-config", "kubelet-restart", "kubelet-health", "weft-stop", "units",
                                   "containerd-config", "containerd-restart", "bundle", "journal")


def test_each_phase_has_one_place_in_the_uninstall_order() -> None:
    undone = [p for p in phases.PHASES if p.undo is not None]
    assert sorted(p.undo_at for p in undone) == list(range(1, len(undone) + 1))
    assert all(p.undo_at == 0 for p in phases.PHASES if p.undo is None)
    assert len({p.name for p in phases.PHASES}) == len(phases.PHASES)
    assert len({p.undone_as for p in undone}) == len(undone)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("options", [plan.Options(), OPTIONS], ids=["plain", "broker-and-mesh"])
def test_every_file_an_install_writes_belongs_to_one_phase(shape: str, options: plan.Options, tmp_path: Path) -> None:
    """What a phase journals and undoes is what it writes, and a file no phase owned would never be written."""
    host = Host(copy_shape(shape, tmp_path / "host"))
    found = services.containerd_version(tmp_path / "no.sock", [host.path(b) for b in containerd.BINARIES])
    assert found is not None
    the_plan = plan.make(OriginalFiles(host, None), options, containerd.Containerd.parse(*found))
    for path in [*the_plan.modified, *the_plan.added]:
        owners = [p.name for p in phases.PHASES if p.owns(path)]
        assert len(owners) == 1, (path, owners)
        assert owners[0] in ("units", "containerd-config", "kubelet-config")


@pytest.mark.parametrize("point", sorted(RECORDED))
def test_the_journal_is_written_byte_for_byte_as_before(
        point: str, tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = copy_shape("ctrd2-gpu-confd", tmp_path / "host")
    _stop_at(monkeypatch, point)
    _run_until(point, _settings(root, source))
    assert (root / JOURNAL).read_text() == _owners_as_here(RECORDED[point])


@pytest.mark.parametrize("then", ["install", "uninstall"])
@pytest.mark.parametrize("point", sorted(RECORDED))
def test_a_node_with_a_recorded_journal_is_finished_and_undone_from_it(
        point: str, then: str, tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host as the installer left it at ``point``, with the recorded journal in place of the one written here:
    installing finishes the install, uninstalling (after it, or at once) gives back every byte."""
    root = copy_shape("ctrd2-gpu-confd", tmp_path / "host")
    before = snapshot(root)
    settings = _settings(root, source)
    with monkeypatch.context() as m:
        _stop_at(m, point)
        _run_until(point, settings)
    (root / JOURNAL).write_text(_owners_as_here(RECORDED[point]))
    if then == "install":
        run.install(settings)
        doc = json.loads((root / JOURNAL).read_text())
        assert doc["state"] == "installed" and tuple(doc["started"]) == run.INSTALL_STEPS
        assert (root / "etc/systemd/system/weft-agent.service").exists()
    run.uninstall(settings)
    assert snapshot(root) == before
