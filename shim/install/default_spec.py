"""containerd 1.6's default OCI spec for Linux (``ctr oci spec``), the base of the ``weft`` handler's spec.

GENERATED from ``ctr oci spec`` of containerd 1.6.20, less ``hostname`` (a
base_runtime_spec must not carry one). containerd applies a handler's
``base_runtime_spec`` *instead of* its built-in default, so the base must be a
complete default spec; the installer uses the host's own runc base spec when
the default runtime has one, and this one otherwise.
"""

import json

# ctr oci spec gives the process one capability set, as bounding, effective and permitted alike: written once here.
_CAPABILITIES = json.dumps([
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
])

# Its two tmpfs mounts (/dev and /run) take the same options.
_TMPFS_OPTIONS = json.dumps(["nosuid", "strictatime", "mode=755", "size=65536k"])

SPEC = json.loads(r"""
{
 "ociVersion": "1.0.2-dev",
 "process": {
  "user": {
   "uid": 0,
   "gid": 0
  },
  "cwd": "/",
  "capabilities": {
   "bounding": @CAPABILITIES@,
   "effective": @CAPABILITIES@,
   "permitted": @CAPABILITIES@
  },
  "rlimits": [
   {
    "type": "RLIMIT_NOFILE",
    "hard": 1024,
    "soft": 1024
   }
  ],
  "noNewPrivileges": true
 },
 "root": {
  "path": "rootfs"
 },
 "mounts": [
  {
   "destination": "/proc",
   "type": "proc",
   "source": "proc",
   "options": [
    "nosuid",
    "noexec",
    "nodev"
   ]
  },
  {
   "destination": "/dev",
   "type": "tmpfs",
   "source": "tmpfs",
   "options": @TMPFS_OPTIONS@
  },
  {
   "destination": "/dev/pts",
   "type": "devpts",
   "source": "devpts",
   "options": [
    "nosuid",
    "noexec",
    "newinstance",
    "ptmxmode=0666",
    "mode=0620",
    "gid=5"
   ]
  },
  {
   "destination": "/dev/shm",
   "type": "tmpfs",
   "source": "shm",
   "options": [
    "nosuid",
    "noexec",
    "nodev",
    "mode=1777",
    "size=65536k"
   ]
  },
  {
   "destination": "/dev/mqueue",
   "type": "mqueue",
   "source": "mqueue",
   "options": [
    "nosuid",
    "noexec",
    "nodev"
   ]
  },
  {
   "destination": "/sys",
   "type": "sysfs",
   "source": "sysfs",
   "options": [
    "nosuid",
    "noexec",
    "nodev",
    "ro"
   ]
  },
  {
   "destination": "/run",
   "type": "tmpfs",
   "source": "tmpfs",
   "options": @TMPFS_OPTIONS@
  }
 ],
 "linux": {
  "resources": {
   "devices": [
    {
     "allow": false,
     "access": "rwm"
    }
   ]
  },
  "cgroupsPath": "/default",
  "namespaces": [
   {
    "type": "pid"
   },
   {
    "type": "ipc"
   },
   {
    "type": "uts"
   },
   {
    "type": "mount"
   },
   {
    "type": "network"
   }
  ],
  "maskedPaths": [
   "/proc/acpi",
   "/proc/asound",
   "/proc/kcore",
   "/proc/keys",
   "/proc/latency_stats",
   "/proc/timer_list",
   "/proc/timer_stats",
   "/proc/sched_debug",
   "/sys/firmware",
   "/proc/scsi"
  ],
  "readonlyPaths": [
   "/proc/bus",
   "/proc/fs",
   "/proc/irq",
   "/proc/sys",
   "/proc/sysrq-trigger"
  ]
 }
}
""".replace("@CAPABILITIES@", _CAPABILITIES).replace("@TMPFS_OPTIONS@", _TMPFS_OPTIONS))
