#!/usr/bin/env bash
# Builds the root filesystem of a test node (what kind's node image is, without Docker): Debian bookworm
# with systemd as PID 1, containerd, runc, the CNI plugins and what kubelet needs, set up to boot under
# systemd-nspawn (harness/nodes/nspawn.py). Built once into a cache outside the checkout:
# ${WEFT_CACHE_ROOT:-/var/cache/weft}/noderoot/<key>/rootfs, where <key> is a hash of this script, so a
# change here builds a new root. Built under a lock into a temporary directory renamed into place: a reader
# never sees half a root, and two runs never build at once.
#
# Usage: harness/nodes/rootfs.sh             build if not cached; prints the root's path last
#        harness/nodes/rootfs.sh --bin-dir   print the root's path only (built or not), as components/*/build.sh do
#        harness/nodes/rootfs.sh --cached    exit 0 if it is built already, 1 if not (builds nothing)
set -euo pipefail
SCRIPT=harness/nodes/rootfs.sh
SELF="$(readlink -f "${BASH_SOURCE[0]}")"
KEY="$(sha256sum "$SELF" | cut -c1-12)"
CACHE="${WEFT_CACHE_ROOT:-/var/cache/weft}/noderoot"
DIR="$CACHE/$KEY"
ROOT="$DIR/rootfs"
SUITE=bookworm
PACKAGES=systemd,systemd-sysv,dbus,containerd,runc,iproute2,iptables,containernetworking-plugins,ca-certificates,util-linux,procps,kmod,conntrack

complete() { [ -f "$ROOT/.complete" ]; }
if [ "${1:-}" = "--bin-dir" ]; then
  echo "$ROOT"
  exit 0
fi
if [ "${1:-}" = "--cached" ]; then
  complete
  exit
fi

# The host's side: nspawn to boot the root, debootstrap to build it.
need=()
command -v systemd-nspawn >/dev/null || need+=(systemd-container)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ "${#need[@]}" -gt 0 ]; then
  echo "$SCRIPT: installing ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q "${need[@]}" >&2; then
    apt-get update -q >&2
    apt-get install -y -q "${need[@]}" >&2
  fi
fi

if complete; then
  echo "$ROOT"
  exit 0
fi

# The Debian mirror this machine's apt uses for the release itself (not -security or -updates): the first
# URI of a deb822 .sources stanza or a one-line .list entry whose suites name $SUITE.
mirror() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    awk -v suite="$SUITE" '
      $1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                    if ($(i + 1) == suite) { print $i; exit } }' "$f"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v suite="$SUITE" '
      function flush() { if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && uri != "") { print uri; exit }
                         types = ""; suites = ""; uri = "" }
      /^[ \t]*$/ { flush(); next }
      /^#/ { next }
      tolower($1) == "types:" { types = substr($0, index($0, ":") + 1); gsub(/^[ \t]+/, "", types) }
      tolower($1) == "suites:" { suites = substr($0, index($0, ":") + 1); gsub(/^[ \t]+/, "", suites) }
      tolower($1) == "uris:" { uri = $2 }
      END { flush() }' "$f"
  done
}
MIRROR="$(mirror)"
MIRROR="${MIRROR%%$'\n'*}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

mkdir -p "$DIR"
exec 9>"$DIR/.build.lock"
flock 9
if complete; then  # another run built it while this one waited
  echo "$ROOT"
  exit 0
fi

# What a run killed midway left: debootstrap's mounts of /proc and /sys inside its target first, so that
# removing the directory never reaches into the host's.
for stale in "$DIR"/rootfs.tmp.*; do
  [ -e "$stale" ] || continue
  findmnt -rn -o TARGET | awk -v p="$stale/" 'index($0, p) == 1' | sort -r | xargs -r -n1 umount -l
  rm -rf --one-file-system "$stale"
done

started=$(date +%s)
TMP="$(mktemp -d "$DIR/rootfs.tmp.XXXXXX")"
chmod 0755 "$TMP"  # the node's / (mktemp makes it 0700: no service user could get past it)
cleanup() {
  findmnt -rn -o TARGET | awk -v p="$TMP/" 'index($0, p) == 1' | sort -r | xargs -r -n1 umount -l || true
  rm -rf --one-file-system "$TMP"
}
trap cleanup EXIT
echo "$SCRIPT: debootstrap $SUITE from $MIRROR into $TMP" >&2
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$TMP" "$MIRROR" >&2

# The entrypoint nspawn runs as the container's first process. nspawn mounts the v1 hierarchies read-only;
# systemd (and later runc) make groups in them, and a remount after systemd has started leaves it without
# the v1 controllers: so remount here, then become systemd. kubelet reads /dev/kmsg, which nspawn does
# not make: link it to the console as kind does.
install -D -m 0755 /dev/stdin "$TMP/usr/local/sbin/weft-node-init" <<'EOF'
#!/bin/sh
# The test node's entrypoint (harness/nodes/rootfs.sh): cgroups writable, /dev/kmsg, then systemd.
set -e
for d in /sys/fs/cgroup/*/; do
  mount -o remount,bind,rw "$d"
done
[ -e /dev/kmsg ] || ln -s /dev/console /dev/kmsg
exec /lib/systemd/systemd
EOF

# Units that have no place in a container node, or fail under nspawn: no consoles to log in on, no clock
# to set, no packages to update, no devices for udev, no kernel modules or binfmt to load, no disks to
# check or trim.
systemctl --root="$TMP" set-default multi-user.target >&2
for unit in getty@.service getty.target console-getty.service serial-getty@.service systemd-timesyncd.service \
            apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer e2scrub_all.timer e2scrub_reap.service \
            fstrim.timer remote-fs.target systemd-pstore.service containerd.service; do
  systemctl --root="$TMP" disable "$unit" >/dev/null 2>&1 || true
done
systemctl --root="$TMP" mask \
  getty.target console-getty.service systemd-udevd.service systemd-udevd-control.socket \
  systemd-udevd-kernel.socket systemd-udev-trigger.service systemd-udev-settle.service \
  systemd-modules-load.service systemd-binfmt.service proc-sys-fs-binfmt_misc.automount \
  proc-sys-fs-binfmt_misc.mount sys-kernel-config.mount sys-kernel-debug.mount sys-kernel-tracing.mount \
  sys-fs-fuse-connections.mount systemd-firstboot.service systemd-hwdb-update.service \
  systemd-remount-fs.service systemd-random-seed.service systemd-pstore.service \
  systemd-machine-id-commit.service dev-hugepages.mount >&2
mkdir -p "$TMP/etc/systemd/journald.conf.d"
printf '[Journal]\nReadKMsg=no\n' > "$TMP/etc/systemd/journald.conf.d/weft-node.conf"

# Each node writes its own machine ID and gets its hostname from nspawn; no package caches in the root.
: > "$TMP/etc/machine-id"
rm -f "$TMP/var/lib/dbus/machine-id" "$TMP/etc/hostname"
rm -rf "$TMP"/var/cache/apt/archives/*.deb "$TMP"/var/lib/apt/lists/*
date -u +%Y-%m-%dT%H:%M:%SZ > "$TMP/.complete"
echo "BUILD_SECONDS=$(( $(date +%s) - started )) MIRROR=$MIRROR" >> "$TMP/.complete"

trap - EXIT
rm -rf --one-file-system "$ROOT"
mv "$TMP" "$ROOT"
echo "$ROOT"
