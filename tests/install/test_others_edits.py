"""Another tool's later edits of containerd's and kubelet's files survive weft: install, re-install and uninstall.

What NVIDIA's toolkit does to a node is run for real in ``integration/install/test_gpu_operator.py``; here its
shape is written by hand (a runtime table added to ``config.toml``, a drop-in imported after weft's), so every
path of the journal is covered on every host shape.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from shim.cli import main
from shim.install import containerd, dropin
from shim.install.host import Host
from tests.install.conftest import SHAPES, SHAPES_1X, copy_shape, snapshot

CONFIG = "etc/containerd/config.toml"
NVIDIA = "/usr/local/nvidia/toolkit/nvidia-container-runtime"


def _section(root: Path) -> str:
    version = tomllib.loads((root / CONFIG).read_text()).get("version", 1)
    return containerd.CRI if version == 2 else containerd.CRI_RUNTIME


def _toolkit_edit(root: Path, binary: str = NVIDIA) -> str:
    """What the toolkit's installer adds to config.toml: a runtime of its own (appended here, as text; named
    `nvidia-legacy`, which no shape has, as the eks one has an `nvidia` already)."""
    section = _section(root)
    text = (root / CONFIG).read_text()
    name = "nvidia-legacy"
    added = (f'\n[plugins."{section}".containerd.runtimes.{name}]\n  runtime_type = "io.containerd.runc.v2"\n'
             f'[plugins."{section}".containerd.runtimes.{name}.options]\n  BinaryName = "{binary}"\n')
    (root / CONFIG).write_text(text + added)
    return added


def _effective_cri_without_weft(root: Path) -> dict:
    """containerd 1.x's CRI section from config.toml and its imports but weft's: each import's replaces the last."""
    doc = tomllib.loads((root / CONFIG).read_text())
    cri = doc.get("plugins", {}).get(containerd.CRI, {})
    for imp in doc.get("imports", []):
        if imp != containerd.DROPIN:
            for f in sorted(root.glob(imp.lstrip("/"))):
                cri = tomllib.loads(f.read_text()).get("plugins", {}).get(containerd.CRI, cri)
    return cri


def _runtimes_in_dropin(root: Path) -> dict:
    doc = tomllib.loads((root / containerd.DROPIN.lstrip("/")).read_text())
    section = next(iter(doc["plugins"].values()))
    return section["containerd"]["runtimes"]


@pytest.mark.parametrize("shape", SHAPES)
def test_uninstall_after_another_tool_changed_config_toml_keeps_its_change_and_takes_out_only_weft(
        shape: str, tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_shape(shape, tmp_path / "host")
    before = snapshot(root)
    original = (root / CONFIG).read_text()
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    added = _toolkit_edit(root)

    assert main(["uninstall", "--root", str(root)]) == 0
    assert "keeping the changes made to it since weft's install" in capsys.readouterr().out
    assert (root / CONFIG).read_text() == original + added, "the toolkit's runtime kept, weft's import gone"
    after = snapshot(root)
    assert {p: v for p, v in after.items() if p != CONFIG} == {p: v for p, v in before.items() if p != CONFIG}


@pytest.mark.parametrize("shape", SHAPES)
def test_a_reinstall_plans_from_the_changed_file_and_a_later_uninstall_gives_that_back(
        shape: str, tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_shape(shape, tmp_path / "host")
    original = (root / CONFIG).read_text()
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    added = _toolkit_edit(root)
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    assert "was changed since weft's install" in capsys.readouterr().out
    assert containerd.DROPIN in tomllib.loads((root / CONFIG).read_text())["imports"]
    if shape in SHAPES_1X:  # the 1.x drop-in carries the whole effective CRI section, made again from the change
        runtimes = dict(_runtimes_in_dropin(root))
        runtimes.pop("weft")
        assert runtimes == _effective_cri_without_weft(root)["containerd"]["runtimes"]
    assert main(["uninstall", "--root", str(root)]) == 0
    assert (root / CONFIG).read_text() == original + added


def test_an_import_line_removed_by_a_rewrite_is_put_back_by_the_next_install_keeping_the_rewrite(
        tmp_path: Path, source: Path) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    rewritten = containerd.without_import((root / CONFIG).read_text()) + "# rewritten by an admin\n"
    (root / CONFIG).write_text(rewritten)
    status = dropin.regenerate(Host(root), containerd.Containerd("1.6.20", 1, 6, "test"), write=False)
    assert status.state is dropin.State.NOT_IMPORTED and "weft's DaemonSet puts the import back" in status.detail

    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    text = (root / CONFIG).read_text()
    assert "# rewritten by an admin" in text and tomllib.loads(text)["imports"][-1] == containerd.DROPIN
    assert main(["uninstall", "--root", str(root)]) == 0
    assert (root / CONFIG).read_text() == rewritten


def test_a_later_import_is_put_behind_weft_s_and_the_dropin_made_again_from_it(tmp_path: Path, source: Path) -> None:
    """The toolkit v1.20 appends /etc/containerd/conf.d/*.toml after weft's drop-in and writes there a copy of the
    whole CRI section: on containerd 1.x that copy, imported last, would replace weft's handler."""
    root = copy_shape("kubeadm", tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    doc = tomllib.loads((root / CONFIG).read_text())
    conf_d = root / "etc/containerd/conf.d"
    conf_d.mkdir(parents=True)
    cri = tomllib.loads((root / containerd.DROPIN.lstrip("/")).read_text())["plugins"][containerd.CRI]
    cri["containerd"]["runtimes"]["nvidia"] = {"runtime_type": containerd.RUNC_V2, "options": {"BinaryName": NVIDIA}}
    cri["containerd"]["default_runtime_name"] = "nvidia"
    from shim.install import tomlw

    (conf_d / "99-nvidia.toml").write_text(tomlw.dumps({"version": 2, "plugins": {containerd.CRI: cri}}))
    (root / CONFIG).write_text(containerd.with_import((root / CONFIG).read_text(), doc, "/etc/containerd/conf.d/*.toml")
                               .replace("/etc/containerd/conf.d/*.toml", "/etc/containerd/conf.d/*.toml", 1))
    assert tomllib.loads((root / CONFIG).read_text())["imports"][-1] == "/etc/containerd/conf.d/*.toml"

    assert main(["containerd-dropin", "--root", str(root)]) == 0
    imports = tomllib.loads((root / CONFIG).read_text())["imports"]
    assert imports[-2:] == ["/etc/containerd/conf.d/*.toml", containerd.DROPIN]
    runtimes = _runtimes_in_dropin(root)
    assert runtimes["nvidia"]["options"]["BinaryName"] == NVIDIA
    assert runtimes["weft"]["options"]["BinaryName"] == NVIDIA, "weft's handler is the default runtime's, now nvidia"


def test_a_config_weft_cannot_read_after_another_tool_s_edit_is_refused_naming_it_and_nothing_changes(
        tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    (root / CONFIG).write_text((root / CONFIG).read_text() + "\n[plugins.broken\n")
    installed = snapshot(root)
    assert main(["containerd-dropin", "--root", str(root)]) == 2
    assert "/etc/containerd/config.toml: not valid TOML" in capsys.readouterr().err
    assert main(["install", "--root", str(root), "--source", str(source)]) == 2
    assert "/etc/containerd/config.toml" in capsys.readouterr().err
    assert snapshot(root) == installed


@pytest.mark.parametrize("shape", ["kubeadm", "ctrd2-kubeadm"])
def test_copies_of_weft_s_handler_another_tool_took_are_taken_out_at_uninstall(
        shape: str, tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The toolkit v1.20 copies the whole CRI section, weft's handler with it, into its drop-in; v1.17's
    installer writes config.toml from `containerd config dump`, weft's handler inline. Left behind, either would
    stop containerd's CRI plugin from starting once weft's base spec is gone."""
    root = copy_shape(shape, tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    section = _section(root)
    copy = (f'[plugins."{section}".containerd.runtimes.nvidia]\n  runtime_type = "io.containerd.runc.v2"\n'
            f'[plugins."{section}".containerd.runtimes.weft]\n  base_runtime_spec = "{containerd.BASE_SPEC}"\n'
            f'  runtime_type = "io.containerd.runc.v2"\n'
            f'[plugins."{section}".containerd.runtimes.weft.options]\n  SystemdCgroup = true\n')
    conf_d = root / "etc/containerd/conf.d"
    conf_d.mkdir(parents=True)
    version = tomllib.loads((root / CONFIG).read_text())["version"]
    (conf_d / "99-nvidia.toml").write_text(f"version = {version}\n{copy}")
    text = (root / CONFIG).read_text()
    (root / CONFIG).write_text(containerd.with_import(text, tomllib.loads(text), "/etc/containerd/conf.d/*.toml"))

    assert main(["uninstall", "--root", str(root)]) == 0
    assert "took the copy of weft's runtime handler out of /etc/containerd/conf.d/99-nvidia.toml" in \
        capsys.readouterr().out
    left = tomllib.loads((conf_d / "99-nvidia.toml").read_text())["plugins"][section]["containerd"]["runtimes"]
    assert list(left) == ["nvidia"], "the toolkit's own runtime stays"
    assert not (root / containerd.BASE_SPEC.lstrip("/")).exists()
    imports = tomllib.loads((root / CONFIG).read_text())["imports"]
    assert imports[-1] == "/etc/containerd/conf.d/*.toml" and containerd.DROPIN not in imports


def test_a_copy_that_cannot_be_taken_out_keeps_weft_s_base_spec_so_containerd_still_starts(
        tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    conf_d = root / "etc/containerd/conf.d"
    conf_d.mkdir(parents=True)
    (conf_d / "99-other.toml").write_text(  # an inline table: no header of its own to remove
        f'version = 2\n[plugins."{containerd.CRI}".containerd.runtimes]\n'
        f'weft = {{ base_runtime_spec = "{containerd.BASE_SPEC}", runtime_type = "io.containerd.runc.v2" }}\n')
    text = (root / CONFIG).read_text()
    (root / CONFIG).write_text(containerd.with_import(text, tomllib.loads(text), "/etc/containerd/conf.d/*.toml"))
    assert main(["uninstall", "--root", str(root)]) == 2
    out = capsys.readouterr()
    assert "99-other.toml: holds a copy of weft's 'weft' runtime handler" in out.out + out.err
    assert (root / containerd.BASE_SPEC.lstrip("/")).exists()


def test_install_says_when_the_default_runtime_s_program_is_not_on_the_host(
        tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """NVIDIA's runtime made the default, its program not (or no longer) there: weft's handler copies it."""
    root = copy_shape("ctrd2-eks", tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    out = capsys.readouterr().out
    assert "containerd's default runtime 'nvidia' runs /usr/bin/nvidia-container-runtime, which is not on this " \
           "host" in out
    assert main(["uninstall", "--root", str(root)]) == 0
    (root / "usr/bin/nvidia-container-runtime").write_text("#!/bin/sh\n")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    assert "which is not on this host" not in capsys.readouterr().out
