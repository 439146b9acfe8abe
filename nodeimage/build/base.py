"""The base image: the Containerfile's pinned registry base copied with skopeo, or one made from Debian's own
packages (``--base debian-packages``), or any OCI layout; cached so later builds are offline."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import tarfile
from pathlib import Path

from nodeimage.build import apt
from nodeimage.build.common import _MT_LAYER, CACHE, BuildError, _digest, _run, _run_bytes
from nodeimage.build.layout import Layout, layer_tar, write_layout
from nodeimage.build.pins import REFRESH, Pins, candidate, read_pins


def fetch_registry_base(ref: str, cache: Path = CACHE, arch: str = "amd64") -> Layout:
    """``ref`` (``docker.io/...@sha256:...``) for ``arch`` as an OCI layout, from the cache or with skopeo."""
    if "@sha256:" not in ref:
        raise BuildError(f"base {ref!r} is not pinned by digest (NAME@sha256:...)")
    dest = cache / "bases" / (ref.rsplit("@sha256:", 1)[1] + ("" if arch == "amd64" else f"-{arch}"))
    if (dest / "index.json").exists():
        return Layout(dest)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        _run(["skopeo", "copy", "--override-os", "linux", "--override-arch", arch,
              f"docker://{ref}", f"oci:{tmp}:base"], f"fetch base image {ref}", timeout=900)
    except BuildError as exc:
        raise BuildError(
            f"{exc}\nThe pinned base is fetched from its registry once and then cached in {dest}; this needs "
            f"network access to {ref.split('/', 1)[0]}. Without it, build on Debian's packages instead "
            f"(--base debian-packages, which needs only apt's mirror), or copy a layout of the base there."
        ) from None
    os.replace(tmp, dest)
    return Layout(dest)


# Debian bookworm packages for a Python 3.11 base: the interpreter and its
# standard library, a shell and coreutils; what they need is added by apt's
# dependency closure, minus what a container never runs (dpkg, perl, debconf).
DEBIAN_ROOTS = ("base-files", "netbase", "dash", "coreutils", "python3.11-minimal", "libpython3.11-stdlib",
                "libstdc++6",  # grpcio's wheel links libstdc++ (manylinux leaves it to the system)
                "util-linux")  # nsenter: the installer runs the host's systemctl through it
DEBIAN_EXCLUDE = frozenset({
    "debconf", "cdebconf", "dpkg", "perl", "perl-base", "perl-modules-5.36", "libperl5.36", "install-info",
    "gawk", "mawk", "original-awk", "tar", "libdebian-installer4", "libnewt0.52", "libslang2", "libtextwrap1",
    "mailcap", "mime-support", "libgdbm-compat4", "libmpfr6", "libsigsegv2", "tzdata", "ca-certificates",
    "openssl", "debconf-2.0", "libelogind0",
})
_DROP_PREFIXES = ("usr/share/doc/", "usr/share/man/", "usr/share/info/", "usr/share/lintian/", "usr/share/locale/")
_MERGED = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}


def debian_closure(arch: str = "amd64") -> list[tuple[str, str]]:
    """``(package, version)`` for the roots and their Depends/Pre-Depends, as apt resolves them here (``arch``'s
    packages)."""
    opts = apt.options(arch)
    res = _run(["apt-cache", *opts, "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
                "--no-breaks", "--no-replaces", "--no-enhances", *DEBIAN_ROOTS], "resolve Debian packages")
    names = sorted({ln.strip().split(":", 1)[0] for ln in res.stdout.splitlines()
                    if ln and not ln.startswith((" ", "<")) and ln.strip() not in DEBIAN_EXCLUDE})
    pol = _run(["apt-cache", *opts, "policy", *names], "resolve Debian package versions").stdout
    versions, current = {}, ""
    for ln in pol.splitlines():
        if ln and not ln.startswith(" "):
            current = ln.rstrip(":")
        elif ln.strip().startswith("Candidate:"):
            versions[current] = ln.split(":", 1)[1].strip()
    missing = [n for n in names if versions.get(n) in (None, "(none)")]
    if missing:
        raise BuildError(f"Debian packages not available from apt here: {missing} (run apt-get update)")
    return [(n, versions[n]) for n in names]


# Bump when what build_debian_base makes of the same packages changes (what it drops, adds or how it unpacks):
# the cached base is keyed by this and the pinned versions.
_RECIPE = 2


def download_debs(pins: dict[str, str], debs: Path, arch: str = "amd64") -> dict[str, Path]:
    """The ``.deb`` of each pinned ``package=version`` (by package; ``arch``'s), from ``debs`` or, for those it
    lacks, ``apt-get download`` (apt checks each file against its index's hash).

    Debian's mirror carries only the newest version of a package: once a point release or a security update
    replaced a pinned one, and ``debs`` does not hold it, that package is taken at apt's version instead, said
    on stderr with the refresh to run. The build then goes on (a fresh machine's tests must), as a different
    image from the pinned one; refreshing the pins makes it the pinned one again."""
    debs.mkdir(parents=True, exist_ok=True)
    missing = [n for n in sorted(pins) if _find_deb(debs, n, pins[n], arch) is None]
    if missing:
        opts = apt.options(arch, debs.parent)
        try:
            _run(["apt-get", *opts, "download", *(f"{n}={pins[n]}" for n in missing)],
                 "download the pinned Debian packages (apt-get download)", cwd=debs)
        except BuildError:
            _download_each(pins, missing, debs, arch, opts)
    found = {n: _find_deb(debs, n, v, arch) for n, v in sorted(pins.items())}
    lost = [f"{n}={pins[n]}" for n, f in found.items() if f is None]
    if lost:
        raise BuildError(f"apt-get download left no .deb for {lost} in {debs}")
    return {n: f for n, f in found.items() if f is not None}


def _download_each(pins: dict[str, str], names: list[str], debs: Path, arch: str, opts: list[str]) -> None:
    """One by one; a pinned version the mirror no longer carries is replaced in ``pins`` by apt's."""
    gone = []
    for n in names:
        try:
            _run(["apt-get", *opts, "download", f"{n}={pins[n]}"], f"download {n}={pins[n]}", cwd=debs)
        except BuildError:
            now = candidate(n) if arch == "amd64" else candidate(n, arch)
            _run(["apt-get", *opts, "download", f"{n}={now}"], f"download {n}={now}", cwd=debs)
            gone.append(f"{n} {pins[n]} -> {now}")
            pins[n] = now
    if gone:
        print(f"nodeimage.build: warning: Debian's mirror no longer carries these pinned versions, built with "
              f"apt's instead, so this image is not the pinned one: {'; '.join(gone)}. Refresh the pins "
              f"({REFRESH}) and commit them, or put the pinned .deb files in {debs}", file=sys.stderr)


def _base_dir(cache: Path, versions: dict[str, str], arch: str = "amd64") -> Path:
    want = [f"{n}={v}" for n, v in sorted(versions.items())]
    key = hashlib.sha256("\n".join([f"recipe={_RECIPE}", *([] if arch == "amd64" else [f"arch={arch}"]), *want])
                         .encode()).hexdigest()[:16]
    return cache / "bases" / f"debian-python3.11-{key}"


def build_debian_base(cache: Path = CACHE, pins: Pins | None = None, arch: str = "amd64") -> Layout:
    """A Python 3.11 base for ``arch`` from Debian's packages at the pinned versions (no registry needed), cached
    by them."""
    versions = dict((pins or read_pins()).of("base", arch))
    dest = _base_dir(cache, versions, arch)
    if (dest / "index.json").exists():
        return Layout(dest)
    files = list(download_debs(versions, cache / "debs", arch).values())  # versions: as downloaded
    dest = _base_dir(cache, versions, arch)
    if (dest / "index.json").exists():
        return Layout(dest)
    entries: dict[str, tuple[tarfile.TarInfo, bytes | None]] = {}
    for deb in files:
        data = _run_bytes(["dpkg-deb", "--fsys-tarfile", str(deb)], f"unpack {deb.name}")
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for m in tar.getmembers():
                path = _merged_usr(m.name)
                if not path or path.startswith(_DROP_PREFIXES):
                    continue
                if m.islnk():  # a hard link: a copy of the file it names (unpacked before it)
                    target = entries.get(_merged_usr(m.linkname))
                    if target is None:
                        continue
                    m.type, data = tarfile.REGTYPE, target[1]
                else:
                    data = tar.extractfile(m).read() if m.isfile() else None
                m.name = path
                entries[path] = (m, data)
    extra: dict[str, tuple[str, object]] = {
        **{k: ("link", v) for k, v in _MERGED.items()},
        "usr/bin/python3": ("link", "python3.11"),
        "tmp": ("dir", 0o1777),
        "etc/passwd": ("file", b"root:x:0:0:root:/root:/bin/sh\n"
                               b"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
        "etc/group": ("file", b"root:x:0:\nnogroup:x:65534:\n"),
    }
    for path, (kind, arg) in extra.items():
        info = tarfile.TarInfo(path)
        if kind == "link":
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, str(arg), 0o777
            entries[path] = (info, None)
        elif kind == "dir":
            info.type, info.mode = tarfile.DIRTYPE, int(arg)  # type: ignore[call-overload]
            entries[path] = (info, None)
        else:
            info.mode = 0o644
            entries[path] = (info, arg)  # type: ignore[assignment]
    layer = layer_tar(entries.values())
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]
    config = {"architecture": arch, "os": "linux", "config": {"Env": env, "Cmd": ["python3"]},
              "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
              "history": [{"created": "1970-01-01T00:00:00Z",
                           "created_by": "nodeimage/build.py: Debian bookworm " + " ".join(
                               f"{n}={v}" for n, v in sorted(versions.items()))}]}
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_layout(tmp, [(_MT_LAYER, layer)], config, name=None, arch=arch)
    os.replace(tmp, dest)
    return Layout(dest)


def _find_deb(debs: Path, name: str, version: str, arch: str = "amd64") -> Path | None:
    # apt-get download names files NAME_VERSION_ARCH.deb with ':' in the version escaped as %3a.
    v = version.replace(":", "%3a")
    found = sorted(debs.glob(f"{name}_{v}_{arch}.deb")) or sorted(debs.glob(f"{name}_{v}_all.deb"))
    return found[0] if found else None


def _merged_usr(name: str) -> str:
    path = name.removeprefix("./").rstrip("/")
    top, _, rest = path.partition("/")
    if top in _MERGED:
        return f"{_MERGED[top]}/{rest}" if rest else ""
    return path


def resolve_base(base: str, cache: Path = CACHE, pins: Pins | None = None, arch: str = "amd64") -> Layout:
    """The base layout that holds ``arch``'s image (``Layout.image(arch)`` picks it from an index)."""
    if base == "debian-packages":
        return build_debian_base(cache, pins, arch)
    if base.startswith("oci:"):
        return Layout(Path(base[4:]))
    return fetch_registry_base(base.removeprefix("docker://"), cache, arch)
