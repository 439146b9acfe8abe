"""gpu-check's rows on the node's container runtime: weft's place in containerd's configuration, and NVIDIA's runtime.

On a GPU Operator's node NVIDIA's toolkit makes its runtime containerd's default (weft's handler copies it). What
that runtime gives a container is set by its own configuration: its mode (legacy: the prestart hook hands the
devices ``NVIDIA_VISIBLE_DEVICES`` names to ``nvidia-container-cli``; cdi; auto), and whether a container that
is not privileged may ask for GPUs by that variable at all. weft voids it for every container under its handler
that holds no lease; a pod that did not opt in is the runtime's, and may take a GPU weft has leased to others
by its image's variable alone. Both are read here, never changed.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from shim.errors import WeftError
from shim.gpucheck.report import Check, fail, ok, warn
from shim.install import containerd, dropin
from shim.install.host import Host

NVIDIA_RUNTIME = "nvidia-container-runtime"
SYSTEM_CONFIG = "/etc/nvidia-container-runtime/config.toml"


def _runtime_config(host: Host, binary: str) -> tuple[str, dict[str, Any]]:
    """(where, the runtime's configuration): beside an operator-installed runtime (its wrapper points it at
    ``<install dir>/.config/nvidia-container-runtime/config.toml``), else the system's; {} where there is none."""
    candidates = [str(Path(binary).parent / ".config/nvidia-container-runtime/config.toml"), SYSTEM_CONFIG]
    for path in candidates:
        raw = host.read(path)
        if raw is not None:
            try:
                return path, tomllib.loads(raw.decode())
            except (UnicodeDecodeError, tomllib.TOMLDecodeError):
                return path, {"unreadable": True}
    return "", {}


def checks(root: Path = Path("/")) -> tuple[list[Check], dict[str, Any]]:
    """The ``containerd`` and ``nvidia-runtime`` rows, and their JSON fields."""
    host = Host(root)
    out: list[Check] = []
    extra: dict[str, Any] = {}
    try:
        ctrd = dropin.containerd_of(host)
        docs = containerd.documents(host)
    except WeftError as exc:
        return [warn("containerd", f"not read: {exc.message}")], {}
    if dropin.installed(host):
        status = dropin.regenerate(host, ctrd, write=False)
        extra["containerd_config"] = status.as_dict()
        if status.state in (dropin.State.NOT_IMPORTED, dropin.State.UNREADABLE):
            out.append(fail("containerd", f"{status.detail}. Change: roll weft's DaemonSet pod on this node "
                                          "(weft install puts weft's import back)"))
        elif status.wrote:
            out.append(warn("containerd", f"weft's drop-in is older than the files it copies ({', '.join(status.wrote)}"
                                          " would change): containerd's next start makes it again, and the agent "
                                          "does within 30 s"))
        else:
            out.append(ok("containerd", f"containerd {ctrd.version}: weft's drop-in imported last and made from the "
                                        "files as they are"))
    else:
        out.append(ok("containerd", f"containerd {ctrd.version}; weft was not installed here by weft install"))
    default, runtimes = containerd.effective_runtimes(docs, ctrd)
    nvidia = {name: containerd.binary_of(rt) for name, rt in runtimes.items()
              if Path(containerd.binary_of(rt)).name.startswith(NVIDIA_RUNTIME)}
    if not nvidia:
        out.append(ok("nvidia-runtime", "containerd has no NVIDIA runtime handler (no GPU Operator toolkit here): "
                                        "GPUs reach containers by their device nodes or CDI devices alone"))
        extra["nvidia_runtime"] = None
        return out, extra
    name = default if default in nvidia else sorted(nvidia)[0]
    binary = nvidia[name]
    present = not binary.startswith("/") or host.exists(binary)
    where, cfg = _runtime_config(host, binary)
    section = cfg.get("nvidia-container-runtime", {}) if isinstance(cfg.get("nvidia-container-runtime"), dict) else {}
    mode = str(section.get("mode", "auto"))
    by_env = bool(cfg.get("accept-nvidia-visible-devices-envvar-when-unprivileged", True))
    by_mounts = bool(cfg.get("accept-nvidia-visible-devices-as-volume-mounts", False))
    extra["nvidia_runtime"] = {
        "handler": name, "handlers": sorted(nvidia), "binary": binary, "binary_present": present,
        "default": name == default, "config": where or None, "mode": mode,
        "envvar_when_unprivileged": by_env, "volume_mounts": by_mounts,
        "weft_handler_runs_it": containerd.binary_of(runtimes.get(containerd.HANDLER, {})) == binary}
    said = (f"{name!r} ({binary}){', the default' if name == default else ''}; mode {mode}"
            + (f" ({where})" if where else " (no configuration file: its defaults)"))
    if not present and name == default:
        out.append(fail("nvidia-runtime", f"{said}: {binary} is not on this host, and every container of the node "
                                          "runs it (weft's handler copies the default). Change: let the GPU "
                                          "Operator's toolkit finish installing, or make runc the default again"))
    elif by_env:
        out.append(warn("nvidia-runtime", f"{said}; unprivileged containers may ask for GPUs by "
                                          "NVIDIA_VISIBLE_DEVICES (accept-nvidia-visible-devices-envvar-when-"
                                          "unprivileged = true): weft voids it in every container under its handler "
                                          "that holds no lease, but a pod that did not opt in can take a GPU weft "
                                          "leased to others by its image's variable. Change: set it false, with the "
                                          "device plugin's volume-mounts or CDI device lists"))
    else:
        out.append(ok("nvidia-runtime", f"{said}; unprivileged containers cannot ask for GPUs by "
                                        "NVIDIA_VISIBLE_DEVICES" + ("; device lists as mounts are read" if by_mounts
                                                                     else "")))
    return out, extra
