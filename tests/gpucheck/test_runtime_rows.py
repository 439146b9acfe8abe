"""gpu-check's rows on the container runtime: weft's place in containerd's configuration and NVIDIA's runtime,
read from host roots laid out like nodes (``tests/data/hostroots``)."""

from __future__ import annotations

from pathlib import Path

from shim.cli import main
from shim.gpucheck import runtime
from shim.install import containerd
from tests.install.conftest import copy_shape


def _rows(root: Path) -> tuple[dict[str, tuple[str, str]], dict]:
    checks, extra = runtime.checks(root)
    return {c.name: (c.result.value, c.detail) for c in checks}, extra


def test_a_node_without_nvidia_s_toolkit_says_so(tmp_path: Path) -> None:
    rows, extra = _rows(copy_shape("kubeadm", tmp_path / "host"))
    assert rows["containerd"][0] == "ok" and "not installed here by weft install" in rows["containerd"][1]
    assert rows["nvidia-runtime"][0] == "ok" and "no NVIDIA runtime handler" in rows["nvidia-runtime"][1]
    assert extra["nvidia_runtime"] is None


def test_nvidia_s_runtime_the_default_but_missing_fails_naming_it(tmp_path: Path) -> None:
    rows, extra = _rows(copy_shape("ctrd2-eks", tmp_path / "host"))
    result, detail = rows["nvidia-runtime"]
    assert result == "fail" and "/usr/bin/nvidia-container-runtime is not on this host" in detail
    assert extra["nvidia_runtime"]["default"] is True and extra["nvidia_runtime"]["binary_present"] is False


def test_its_mode_and_whether_unprivileged_containers_may_ask_by_variable_are_reported(tmp_path: Path) -> None:
    root = copy_shape("ctrd2-eks", tmp_path / "host")
    (root / "usr/bin/nvidia-container-runtime").write_text("#!/bin/sh\n")
    rows, extra = _rows(root)
    assert rows["nvidia-runtime"][0] == "warn" and "mode auto" in rows["nvidia-runtime"][1]
    assert "unprivileged containers may ask for GPUs by NVIDIA_VISIBLE_DEVICES" in rows["nvidia-runtime"][1]
    assert extra["nvidia_runtime"]["envvar_when_unprivileged"] is True and extra["nvidia_runtime"]["config"] is None

    config = root / "etc/nvidia-container-runtime/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('accept-nvidia-visible-devices-envvar-when-unprivileged = false\n'
                      'accept-nvidia-visible-devices-as-volume-mounts = true\n'
                      '[nvidia-container-runtime]\nmode = "cdi"\n')
    rows, extra = _rows(root)
    assert rows["nvidia-runtime"][0] == "ok" and "mode cdi" in rows["nvidia-runtime"][1]
    assert "cannot ask for GPUs by NVIDIA_VISIBLE_DEVICES" in rows["nvidia-runtime"][1]
    assert (extra["nvidia_runtime"]["mode"], extra["nvidia_runtime"]["volume_mounts"]) == ("cdi", True)


def test_an_operator_installed_runtime_s_own_configuration_is_read(tmp_path: Path) -> None:
    """The toolkit's installer puts the runtime in /usr/local/nvidia/toolkit and its configuration in .config."""
    root = copy_shape("ctrd2-eks", tmp_path / "host")
    config = root / "etc/containerd/config.toml"
    config.write_text(config.read_text().replace("/usr/bin/nvidia-container-runtime",
                                                 "/usr/local/nvidia/toolkit/nvidia-container-runtime"))
    toolkit = root / "usr/local/nvidia/toolkit"
    (toolkit / ".config/nvidia-container-runtime").mkdir(parents=True)
    (toolkit / "nvidia-container-runtime").write_text("#!/bin/sh\n")
    (toolkit / ".config/nvidia-container-runtime/config.toml").write_text(
        '[nvidia-container-runtime]\nmode = "legacy"\n')
    rows, extra = _rows(root)
    assert "mode legacy" in rows["nvidia-runtime"][1]
    assert extra["nvidia_runtime"]["config"] == "/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml"


def test_weft_s_place_in_containerd_s_configuration(tmp_path: Path) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    source = tmp_path / "weft-src"
    (source / "bin").mkdir(parents=True)
    (source / "bin" / "weft").write_text("#!/bin/sh\n")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    rows, extra = _rows(root)
    assert rows["containerd"][0] == "ok" and extra["containerd_config"]["state"] == "current"

    cfg = root / "etc/containerd/config.toml"
    cfg.write_text(cfg.read_text() + '\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.extra]\n'
                                     '  runtime_type = "io.containerd.runc.v2"\n')
    rows, _ = _rows(root)
    assert rows["containerd"][0] == "warn" and "containerd's next start makes it again" in rows["containerd"][1]

    cfg.write_text(containerd.without_import(cfg.read_text()))
    rows, extra = _rows(root)
    assert rows["containerd"][0] == "fail" and "no longer imports" in rows["containerd"][1]
    assert extra["containerd_config"]["state"] == "not-imported"
