"""What NVML says about the node, judged against what weft's enforcement needs.

Pure: it takes the inventory the NVML backend read and returns checks. Each
device setting is read, never changed; a setting weft cannot work with comes
back as a failed check naming the ``nvidia-smi`` command an operator would run.
"""

from __future__ import annotations

from shim.broker.nvml import DeviceInfo, InstanceInfo, NodeInventory
from shim.gpucheck.report import Check, fail, ok, warn

# set_default_device_pinned_mem_limit arrived with CUDA 11.5's MPS.
MIN_CUDA_DRIVER = 11050
# Active thread percentages (and MPS on Volta's terms) need compute capability 7.0.
MIN_CAPABILITY = (7, 0)


def gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def cuda_text(version: int | None) -> str:
    return "unknown" if version is None else f"{version // 1000}.{version % 1000 // 10}"


def _device(d: DeviceInfo) -> str:
    mig = "MIG on" if d.device.mig_enabled else "MIG off"
    if d.mig_pending != d.device.mig_enabled:
        mig += f" ({'on' if d.mig_pending else 'off'} at its next reset)"
    text = (f"{d.device.index}: {d.device.name} {d.device.uuid}, {gib(d.device.memory_total)} "
            f"({gib(d.memory_used)} used), {mig}, compute capability {d.compute_capability[0]}."
            f"{d.compute_capability[1]}, compute mode {d.compute_mode}")
    if d.instances:
        text += ", MIG instances: " + ", ".join(_instance(i) for i in d.instances)
    return text


def _instance(i: InstanceInfo) -> str:
    dev = i.instance.device
    sms = "" if i.instance.multiprocessors is None else f", {i.instance.multiprocessors} SMs"
    return (f"{dev.uuid} ({dev.name}, {gib(dev.memory_total)}, {gib(i.memory_used)} used{sms}, GPU instance "
            f"{i.instance.gpu_instance_id}, compute instance {i.instance.compute_instance_id})")


def checks(inv: NodeInventory) -> list[Check]:
    out = [ok("nvml", f"driver {inv.driver_version}, CUDA driver {cuda_text(inv.cuda_driver_version)}")]
    if inv.cuda_driver_version is None:
        out.append(warn("cuda-driver", "NVML does not say which CUDA version the driver supports; MPS memory "
                                       "limits need 11.5 or newer. Change: update the NVIDIA driver if it is older"))
    elif inv.cuda_driver_version < MIN_CUDA_DRIVER:
        out.append(fail("cuda-driver", f"CUDA driver {cuda_text(inv.cuda_driver_version)}: MPS memory limits need "
                                       f"11.5 or newer. Change: install a newer NVIDIA driver"))
    else:
        out.append(ok("cuda-driver", f"CUDA {cuda_text(inv.cuda_driver_version)} has MPS memory and compute limits"))
    devices = inv.devices
    if not devices:
        out.append(fail("devices", "NVML shows no GPU. Change: check that the GPUs are visible to the driver "
                                   "(nvidia-smi -L)"))
        return out
    out.append(ok("devices", f"{len(devices)} GPU{'s' if len(devices) > 1 else ''}: "
                             + "; ".join(_device(d) for d in devices)))

    old = [d for d in devices if d.compute_capability < MIN_CAPABILITY]
    out.append(fail("compute-capability", "MPS active thread percentages need compute capability 7.0 (Volta) or "
                                          "newer; GPU " + ", ".join(f"{d.device.index} is {d.compute_capability[0]}."
                                                                    f"{d.compute_capability[1]}" for d in old)
                    + ". Change: lease these GPUs whole only (no weft.io/gpu-memory share)")
               if old else ok("compute-capability", "every GPU is Volta or newer"))

    exclusive = [d for d in devices if d.compute_mode != "Default"]
    out.append(fail("compute-mode", "weft runs one MPS server per lease, so several processes must be able to "
                                    "hold a GPU; " + ", ".join(f"GPU {d.device.index} is {d.compute_mode}"
                                                               for d in exclusive)
                    + ". Change: " + "; ".join(f"nvidia-smi -i {d.device.index} -c DEFAULT" for d in exclusive))
               if exclusive else ok("compute-mode", "every GPU is in compute mode Default"))

    out.append(_mig(devices))

    off = [d for d in devices if d.persistence is False]
    out.append(warn("persistence-mode", "persistence mode is off on GPU " + ", ".join(str(d.device.index) for d in off)
                    + ": the driver is torn down between clients, so each lease's first CUDA call pays for setting "
                      "it up again. Change: " + "; ".join(f"nvidia-smi -i {d.device.index} -pm 1" for d in off)
                    + " (or run nvidia-persistenced)")
               if off else ok("persistence-mode", "on (or not applicable) on every GPU"))
    return out


def _mig(devices: tuple[DeviceInfo, ...]) -> Check:
    """MIG as the broker uses it: a MIG-enabled GPU's instances are leased (whole or shared), the GPU never."""
    with_instances = [d for d in devices if d.device.mig_enabled and d.instances]
    empty = [d for d in devices if d.device.mig_enabled and not d.instances]
    pending = [d for d in devices if d.mig_pending != d.device.mig_enabled]
    if not (with_instances or empty or pending):
        return ok("mig", "MIG is off on every GPU")
    parts = [f"GPU {d.device.index} has MIG on with {len(d.instances)} MIG instance(s) "
             f"({', '.join(i.instance.device.uuid for i in d.instances)}), each leased whole or shared by its own "
             "UUID, the GPU itself never" for d in with_instances]
    parts += [f"GPU {d.device.index} has MIG on and no MIG instances: nothing on it can be leased" for d in empty]
    parts += [f"GPU {d.device.index} has MIG {'on' if d.mig_pending else 'off'} pending (at its next reset)"
              for d in pending]
    if not (empty or pending):
        return ok("mig", "; ".join(parts))
    # Named for an operator to run; gpu-check changes no MIG setting itself.
    fixes = [f"nvidia-smi mig -i {d.device.index} -cgi <profiles> -C to make instances, or nvidia-smi -i "
             f"{d.device.index} -mig 0 and reset the GPU" for d in empty]
    return warn("mig", "; ".join(parts) + (". Change: " + "; ".join(fixes) if fixes else ""))
