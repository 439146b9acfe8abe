"""weft beside NVIDIA's container toolkit, as the GPU Operator runs it, on host roots laid out like nodes.

NVIDIA's ``nvidia-ctk`` (v1.17.8, which edits ``config.toml``, and v1.20.2, which writes
``/etc/containerd/conf.d/99-nvidia.toml`` with a copy of the whole CRI section and appends an import), built from
its Go module (``components/nvidia-toolkit``), runs as the operator's installer runs it
(``nvidia-ctk runtime configure --runtime=containerd --config=/etc/containerd/config.toml --config-source=file``,
with and without ``--nvidia-set-as-default``) inside a mount namespace where the root's ``/etc/containerd`` is the
node's, so every path it writes is the node's own. Each containerd line (Debian's 1.6, 1.7 and 2.x built from Go
modules, each on the file its own ``config default`` writes) then says what it makes of the files with its own
``containerd config dump``. A containerd restart is what containerd's unit runs before it starts:
``weft containerd-dropin``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harness import binaries
from shim.install import containerd as ctrd_config
from shim.localfabric.containerd import bin_dir
from tests.install.conftest import copy_shape

REPO = Path(__file__).resolve().parents[2]
LINES = ("1.6", "1.7", "2")
TOOLKITS = ("1.17", "1.20")
RUNTIME = "/usr/local/nvidia/toolkit/nvidia-container-runtime"
RUNTIME_2 = "/usr/local/nvidia-2/toolkit/nvidia-container-runtime"


def _containerd(line: str) -> str:
    found = bin_dir(line)
    return str(found / "containerd") if found is not None else "containerd"


def _on_node(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` in a private mount namespace whose /etc/containerd is the root's: as on the node itself."""
    script = f'mount --bind "{root}/etc/containerd" /etc/containerd && exec "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "_", *argv],
                          capture_output=True, text=True, timeout=120)


def _node(line: str, tmp: Path) -> Path:
    """A kubeadm-shaped root whose config.toml is the line's own `config default`, its containerd that line's."""
    binary = _containerd(line)
    default = subprocess.run([binary, "config", "default"], capture_output=True, text=True, timeout=60, check=True)
    root = copy_shape("kubeadm", tmp / "host")
    (root / "etc/containerd/config.toml").write_text(default.stdout)
    (root / "usr/bin/containerd").write_text(f'#!/bin/sh\nexec {binary} "$@"\n')
    return root


def _toolkit(root: Path, line: str, *flags: str) -> None:
    ctk = binaries.nvidia_toolkit(line) / "nvidia-ctk"
    res = _on_node(root, str(ctk), "runtime", "configure", "--runtime=containerd",
                   "--config=/etc/containerd/config.toml", "--config-source=file", *flags)
    assert res.returncode == 0, res.stderr


def _restart(root: Path) -> None:
    """What containerd's unit runs before each start (the toolkit restarts containerd after its change)."""
    res = _weft("containerd-dropin", root)
    assert res.returncode == 0, res.stdout + res.stderr


def _weft(cmd: str, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WEFT_FAILPOINTS": ""}
    return subprocess.run([sys.executable, "-m", "shim", cmd, "--root", str(root), *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)


def _install(root: Path, tmp: Path) -> None:
    src = tmp / "weft-src"
    (src / "bin").mkdir(parents=True, exist_ok=True)
    (src / "bin" / "weft").write_text("#!/bin/sh\necho weft\n")
    res = _weft("install", root, "--source", str(src))
    assert res.returncode == 0, res.stdout + res.stderr


def _effective(root: Path, line: str) -> tuple[str, dict]:
    """(the default runtime's name, every runtime) in the line's own `config dump` of the node's files."""
    res = _on_node(root, _containerd(line), "config", "dump")
    assert res.returncode == 0, res.stderr
    plugins = tomllib.loads(res.stdout)["plugins"]
    section = plugins[ctrd_config.CRI_RUNTIME] if line == "2" else plugins[ctrd_config.CRI]
    return section["containerd"]["default_runtime_name"], section["containerd"]["runtimes"]


def _binary(runtime: dict) -> str:
    return runtime.get("options", {}).get("BinaryName", "")


def _naming_weft(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in (root / "etc/containerd").rglob("*.toml")
            if ctrd_config.BASE_SPEC in p.read_text()]


CASES = [(line, tk, default) for line in LINES for tk in TOOLKITS for default in (True, False)]


@pytest.mark.parametrize(("line", "toolkit", "default"), CASES,
                         ids=[f"containerd-{a}-toolkit-{b}-{'default' if c else 'not-default'}" for a, b, c in CASES])
def test_the_toolkit_first_then_weft_keeps_runc_nvidia_and_weft(line: str, toolkit: str, default: bool,
                                                                tmp_path: Path) -> None:
    root = _node(line, tmp_path)
    _toolkit(root, toolkit, f"--nvidia-runtime-path={RUNTIME}", *(["--nvidia-set-as-default"] if default else []))
    _install(root, tmp_path)
    name, runtimes = _effective(root, line)
    assert {"runc", "nvidia", "weft"} <= set(runtimes), sorted(runtimes)
    assert name == ("nvidia" if default else "runc")
    assert _binary(runtimes["nvidia"]) == RUNTIME
    # weft's handler is the default runtime's: through NVIDIA's runtime where that is the default.
    assert _binary(runtimes["weft"]) == (RUNTIME if default else _binary(runtimes["runc"]))
    assert runtimes["weft"]["base_runtime_spec"] == ctrd_config.BASE_SPEC

    res = _weft("uninstall", root)
    assert res.returncode == 0, res.stdout + res.stderr
    name, runtimes = _effective(root, line)
    assert "weft" not in runtimes and _binary(runtimes["nvidia"]) == RUNTIME
    assert _naming_weft(root) == []


@pytest.mark.parametrize(("line", "toolkit"), [(a, b) for a in LINES for b in TOOLKITS],
                         ids=[f"containerd-{a}-toolkit-{b}" for a in LINES for b in TOOLKITS])
def test_weft_first_then_the_toolkit_and_its_later_change_reach_containerd_beside_weft(
        line: str, toolkit: str, tmp_path: Path) -> None:
    root = _node(line, tmp_path)
    _install(root, tmp_path)
    _toolkit(root, toolkit, f"--nvidia-runtime-path={RUNTIME}", "--nvidia-set-as-default")
    _restart(root)
    name, runtimes = _effective(root, line)
    assert name == "nvidia" and {"runc", "nvidia", "weft"} <= set(runtimes), sorted(runtimes)
    assert _binary(runtimes["nvidia"]) == _binary(runtimes["weft"]) == RUNTIME

    # The toolkit changes its runtime (an operator upgrade moving its install directory), then restarts containerd.
    _toolkit(root, toolkit, f"--nvidia-runtime-path={RUNTIME_2}", "--nvidia-set-as-default")
    _restart(root)
    name, runtimes = _effective(root, line)
    assert name == "nvidia" and _binary(runtimes["nvidia"]) == _binary(runtimes["weft"]) == RUNTIME_2
    imports = tomllib.loads((root / "etc/containerd/config.toml").read_text()).get("imports", [])
    assert imports[-1] == ctrd_config.DROPIN, "weft's drop-in imported last, after the toolkit's"

    # weft goes; the toolkit's latest runtime and its default stay, and nothing names weft's base spec.
    res = _weft("uninstall", root)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "keeping the changes made to it since weft's install" in res.stdout
    name, runtimes = _effective(root, line)
    assert name == "nvidia" and "weft" not in runtimes and _binary(runtimes["nvidia"]) == RUNTIME_2
    assert _naming_weft(root) == []
    assert ctrd_config.DROPIN not in tomllib.loads((root / "etc/containerd/config.toml").read_text()).get(
        "imports", [])


@pytest.mark.parametrize("line", ("1.6", "2"))
def test_a_config_toml_written_from_containerd_config_dump_is_given_back_without_weft(line: str,
                                                                                     tmp_path: Path) -> None:
    """`--config-source=command` (the v1.17 installer's first choice) writes the whole `config dump` into
    config.toml: weft's handler inline, imports a fixed list. After weft's uninstall, containerd must not find
    a handler whose base spec is gone."""
    root = _node(line, tmp_path)
    _install(root, tmp_path)
    ctk = binaries.nvidia_toolkit("1.17") / "nvidia-ctk"
    res = _on_node(root, str(ctk), "runtime", "configure", "--runtime=containerd",
                   "--config=/etc/containerd/config.toml", "--config-source=command",
                   f"--executable-path={_containerd(line)}", f"--nvidia-runtime-path={RUNTIME}")
    assert res.returncode == 0, res.stderr
    assert ctrd_config.BASE_SPEC in (root / "etc/containerd/config.toml").read_text(), "weft's handler, inline"
    _restart(root)
    _, runtimes = _effective(root, line)
    assert {"nvidia", "weft"} <= set(runtimes)

    res = _weft("uninstall", root)
    assert res.returncode == 0, res.stdout + res.stderr
    _, runtimes = _effective(root, line)
    assert "weft" not in runtimes and _binary(runtimes["nvidia"]) == RUNTIME
    assert _naming_weft(root) == []
