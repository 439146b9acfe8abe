"""Build the weft node image as an OCI archive, without a container engine.

There is no docker, podman or buildah on the machines weft is developed and
tested on, so this builds the image that ``nodeimage/Containerfile`` describes
by reading that file and doing what an engine would:

- **base**: the Containerfile's ``ARG BASE`` (a ``python:3.11-slim-bookworm``
  pinned by digest), copied with ``skopeo`` into an OCI layout cached under
  ``/var/cache/weft/nodeimage/bases/`` so later builds are offline. Machines
  that cannot reach Docker Hub can build the same image on a base made from
  Debian bookworm's own packages (``--base debian-packages``: Python 3.11,
  dash and coreutils, downloaded with ``apt-get download``, which works
  wherever apt does). ``--base oci:DIR`` takes any OCI layout.
- **RUN**: the Containerfile's one RUN line, ``pip install --target
  /opt/weft/lib -r requirements.lock``, run on this host with pip's
  ``--platform`` options, so the wheels are the manylinux/cp311 ones the base's
  Python needs; wheels are cached under ``/var/cache/weft/nodeimage/wheels/``.
- **COPY, ENV, LABEL, USER, ENTRYPOINT, CMD**: applied as the Containerfile says
  (COPY honours ``nodeimage/containerignore``).

The added files become one uncompressed layer with fixed mtimes and owners,
sorted, so the same inputs give the same image digest. The output is an OCI
layout and ``weft-image.oci.tar`` (that layout as a tar, with the
``io.containerd.image.name`` annotation ``ctr images import`` uses)::

    python -m nodeimage.build --out DIR [--base debian-packages|oci:DIR|docker://REF] [--name REF]
    python -m nodeimage.build lock      # rewrite nodeimage/requirements.lock from the venv's versions
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTAINERFILE = REPO / "nodeimage" / "Containerfile"
IGNOREFILE = REPO / "nodeimage" / "containerignore"
LOCKFILE = REPO / "nodeimage" / "requirements.lock"
CACHE = Path(os.environ.get("WEFT_CACHE_DIR", "/var/cache/weft")) / "nodeimage"
DEFAULT_NAME = "localhost/weft/node:0.1.0"
ARCHIVE_NAME = "weft-image.oci.tar"

# Wheels the base's Python (CPython 3.11, glibc 2.36 on bookworm) can load.
PIP_PLATFORM = ["--implementation", "cp", "--python-version", "3.11", "--abi", "cp311", "--abi", "abi3",
                "--abi", "none", "--platform", "manylinux_2_36_x86_64", "--platform", "manylinux_2_34_x86_64",
                "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux2014_x86_64", "--platform", "any"]
# The one RUN line build.py knows how to do; the Containerfile must say exactly this.
PIP_RUN = ("pip install --no-cache-dir --no-deps --no-compile --only-binary=:all: --require-hashes "
           "--target /opt/weft/lib -r /opt/weft/requirements.lock && rm -rf /opt/weft/lib/bin")

_MT_INDEX = "application/vnd.oci.image.index.v1+json"
_MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_MT_CONFIG = "application/vnd.oci.image.config.v1+json"
_MT_LAYER = "application/vnd.oci.image.layer.v1.tar"
_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"


class BuildError(Exception):
    """The image cannot be built; the message says what to do."""


# --- the Containerfile ------------------------------------------------------------


@dataclass
class Plan:
    """What the Containerfile asks for, in the terms build.py acts on."""

    base: str = ""
    copies: list[tuple[str, str]] = field(default_factory=list)  # (source in the repo, destination)
    runs: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


def _logical_lines(text: str) -> Iterator[str]:
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        yield buf + line
        buf = ""
    if buf:
        yield buf


def _pairs(args: str, what: str) -> dict[str, str]:
    out = {}
    for word in shlex.split(args):
        key, sep, value = word.partition("=")
        if not sep:
            raise BuildError(f"Containerfile {what}: {word!r} is not KEY=VALUE")
        out[key] = value
    return out


def parse_containerfile(text: str, build_args: dict[str, str] | None = None) -> Plan:
    """The instructions build.py supports; anything else is refused by name."""
    plan, args = Plan(), dict(build_args or {})
    for line in _logical_lines(text):
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ARG":
            key, _, default = rest.partition("=")
            args.setdefault(key, default)
        elif op == "FROM":
            plan.base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), rest)
        elif op == "COPY":
            src, dest = shlex.split(rest)
            plan.copies.append((src, dest))
        elif op == "RUN":
            plan.runs.append(" ".join(rest.split()))
        elif op == "ENV":
            plan.env.update(_pairs(rest, "ENV"))
        elif op == "LABEL":
            plan.labels.update(_pairs(rest, "LABEL"))
        elif op == "USER":
            plan.user = rest
        elif op in ("ENTRYPOINT", "CMD"):
            value = json.loads(rest)
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise BuildError(f"Containerfile {op}: use the JSON (exec) form")
            setattr(plan, op.lower(), value)
        else:
            raise BuildError(f"Containerfile: nodeimage/build.py does not handle {op}; keep to the instructions "
                             "it reads (see its docstring), or extend it")
    if not plan.base:
        raise BuildError("Containerfile: no FROM")
    for run in plan.runs:
        if run != PIP_RUN:
            raise BuildError(f"Containerfile RUN {run!r}: build.py only runs {PIP_RUN!r}")
    return plan


def ignore_patterns(path: Path = IGNOREFILE) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    for pat in patterns:
        name = pat.removeprefix("**/")
        if pat.startswith("**/"):
            if any(fnmatch.fnmatchcase(p, name) for p in parts):
                return True
        elif fnmatch.fnmatchcase(rel, pat):
            return True
    return False


# --- content-addressed helpers ---------------------------------------------------


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class Layout:
    """An OCI image layout directory (``oci-layout``, ``index.json``, ``blobs/sha256/``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def blob_path(self, digest: str) -> Path:
        algo, _, hexd = digest.partition(":")
        return self.root / "blobs" / algo / hexd

    def read_blob(self, digest: str) -> bytes:
        data = self.blob_path(digest).read_bytes()
        if _digest(data) != digest:
            raise BuildError(f"OCI layout {self.root}: blob {digest} is corrupt; remove {self.root} and build again")
        return data

    def write_blob(self, data: bytes) -> dict:
        d = _digest(data)
        p = self.blob_path(d)
        p.parent.mkdir(parents=True, exist_ok=True)
        if not p.exists():
            tmp = p.with_name(p.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, p)
        return {"digest": d, "size": len(data)}

    def image(self) -> tuple[dict, dict]:
        """The linux/amd64 image manifest and its config."""
        index = json.loads((self.root / "index.json").read_text())
        desc = self._pick(index.get("manifests") or [])
        doc = json.loads(self.read_blob(desc["digest"]))
        while doc.get("mediaType") in (_MT_INDEX, _DOCKER_LIST) or "manifests" in doc:
            desc = self._pick(doc["manifests"])
            doc = json.loads(self.read_blob(desc["digest"]))
        return doc, json.loads(self.read_blob(doc["config"]["digest"]))

    def _pick(self, manifests: list[dict]) -> dict:
        for m in manifests:
            plat = m.get("platform")
            if plat is None or (plat.get("os"), plat.get("architecture")) == ("linux", "amd64"):
                return m
        raise BuildError(f"OCI layout {self.root} has no linux/amd64 image")


# --- the base ----------------------------------------------------------------------


def _run(argv: list[str], what: str, **kw) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, **kw)
    except FileNotFoundError as exc:
        raise BuildError(f"{what}: {argv[0]} is not installed (scripts/setup.sh installs it)") from exc
    if res.returncode != 0:
        raise BuildError(f"{what}: {' '.join(argv[:3])} ... failed: {(res.stderr or res.stdout).strip()[-2000:]}")
    return res


def fetch_registry_base(ref: str, cache: Path = CACHE) -> Layout:
    """``ref`` (``docker.io/...@sha256:...``) as an OCI layout, from the cache or with skopeo."""
    if "@sha256:" not in ref:
        raise BuildError(f"base {ref!r} is not pinned by digest (NAME@sha256:...)")
    dest = cache / "bases" / ref.rsplit("@sha256:", 1)[1]
    if (dest / "index.json").exists():
        return Layout(dest)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        _run(["skopeo", "copy", "--override-os", "linux", "--override-arch", "amd64",
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


def debian_closure() -> list[tuple[str, str]]:
    """``(package, version)`` for the roots and their Depends/Pre-Depends, as apt resolves them here."""
    res = _run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
                "--no-breaks", "--no-replaces", "--no-enhances", *DEBIAN_ROOTS], "resolve Debian packages")
    names = sorted({ln.strip() for ln in res.stdout.splitlines()
                    if ln and not ln.startswith((" ", "<")) and ln.strip() not in DEBIAN_EXCLUDE})
    pol = _run(["apt-cache", "policy", *names], "resolve Debian package versions").stdout
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


def build_debian_base(cache: Path = CACHE) -> Layout:
    """A Python 3.11 base from Debian's packages (no registry needed), cached by package versions."""
    pkgs = debian_closure()
    key = hashlib.sha256("\n".join(f"{n}={v}" for n, v in pkgs).encode()).hexdigest()[:16]
    dest = cache / "bases" / f"debian-python3.11-{key}"
    if (dest / "index.json").exists():
        return Layout(dest)
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    want = [f"{n}={v}" for n, v in pkgs]
    _run(["apt-get", "download", *want], "download Debian packages (apt-get download)", cwd=debs)
    entries: dict[str, tuple[tarfile.TarInfo, bytes | None]] = {}
    for name, version in pkgs:
        deb = _find_deb(debs, name, version)
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
    layer = _tar(entries.values())
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]
    config = {"architecture": "amd64", "os": "linux", "config": {"Env": env, "Cmd": ["python3"]},
              "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
              "history": [{"created": "1970-01-01T00:00:00Z",
                           "created_by": "nodeimage/build.py: Debian bookworm " + " ".join(want)}]}
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    _write_layout(tmp, [(_MT_LAYER, layer)], config, name=None)
    os.replace(tmp, dest)
    return Layout(dest)


def _find_deb(debs: Path, name: str, version: str) -> Path:
    # apt-get download names files NAME_VERSION_ARCH.deb with ':' in the version escaped as %3a.
    v = version.replace(":", "%3a")
    found = sorted(debs.glob(f"{name}_{v}_*.deb"))
    if not found:
        raise BuildError(f"apt-get download left no {name}_{v}_*.deb in {debs}")
    return found[0]


def _run_bytes(argv: list[str], what: str) -> bytes:
    res = subprocess.run(argv, capture_output=True)
    if res.returncode != 0:
        raise BuildError(f"{what}: {res.stderr.decode(errors='replace').strip()}")
    return res.stdout


def _merged_usr(name: str) -> str:
    path = name.removeprefix("./").rstrip("/")
    top, _, rest = path.partition("/")
    if top in _MERGED:
        return f"{_MERGED[top]}/{rest}" if rest else ""
    return path


def resolve_base(base: str, cache: Path = CACHE) -> Layout:
    if base == "debian-packages":
        return build_debian_base(cache)
    if base.startswith("oci:"):
        return Layout(Path(base[4:]))
    return fetch_registry_base(base.removeprefix("docker://"), cache)


# --- the weft layer ---------------------------------------------------------------


def _tar(entries: Iterable[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    """A layer tar: sorted, parents first, owner root, mtime 0."""
    by_name = {info.name: (info, data) for info, data in entries}
    for name in list(by_name):
        parts = name.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent not in by_name:
                d = tarfile.TarInfo(parent)
                d.type, d.mode = tarfile.DIRTYPE, 0o755
                by_name[parent] = (d, None)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(by_name):
            info, data = by_name[name]
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
            info.pax_headers = {}
            if info.isfile():
                info.size = len(data or b"")
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buf.getvalue()


def _tree(src: Path, dest: str, patterns: list[str]) -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
    """``COPY src dest``: the files under ``src`` at ``dest``, modes kept as 0755/0644 (owner root)."""
    paths = [src] if src.is_file() else sorted(src.rglob("*"))
    for p in paths:
        rel = p.name if src.is_file() else p.relative_to(src).as_posix()
        if not src.is_file() and _ignored(rel, patterns):
            continue
        info = tarfile.TarInfo(f"{dest.strip('/')}/{rel}" if not src.is_file() or dest.endswith("/")
                               else dest.strip("/"))
        if p.is_symlink():
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, os.readlink(p), 0o777
            yield info, None
        elif p.is_dir():
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            yield info, None
        else:
            info.mode = 0o755 if os.access(p, os.X_OK) else 0o644
            yield info, p.read_bytes()


def pip_install(target: Path, lockfile: Path = LOCKFILE, cache: Path = CACHE) -> None:
    """The Containerfile's RUN, on this host: the locked wheels for the base's Python into ``target``."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    common = ["--no-deps", "--only-binary=:all:", "--require-hashes", *PIP_PLATFORM, "-r", str(lockfile)]
    # Download only what the cache lacks (pip checks each wheel's hash against the lock either way).
    _run([*pip, "download", "-d", str(wheels), *common], "download the locked wheels (pip download)")
    _run([*pip, "install", "--no-index", "--find-links", str(wheels), "--no-cache-dir", "--no-compile",
          "--target", str(target), *common], "install the locked wheels (pip install --target)")
    shutil.rmtree(target / "bin", ignore_errors=True)


def weft_layer(plan: Plan, repo: Path = REPO, cache: Path = CACHE) -> bytes:
    patterns = ignore_patterns(repo / "nodeimage" / "containerignore")
    entries: list[tuple[tarfile.TarInfo, bytes | None]] = []
    with tempfile.TemporaryDirectory(prefix="weft-image-") as tmp:
        for src, dest in plan.copies:
            entries.extend(_tree(repo / src, dest, patterns))
        if plan.runs:
            lock = next(repo / src for src, dest in plan.copies if dest == "/opt/weft/requirements.lock")
            pip_install(Path(tmp) / "lib", lock, cache)
            entries.extend(_tree(Path(tmp) / "lib", "/opt/weft/lib", []))
        return _tar(entries)


# --- config, manifest, archive -------------------------------------------------------


def image_config(base_config: dict, plan: Plan, layer: bytes) -> dict:
    """The base's config with the Containerfile's ENV/LABEL/USER/ENTRYPOINT/CMD and one more layer."""
    cfg = json.loads(json.dumps(base_config))
    c = cfg.setdefault("config", {})
    env = dict(e.split("=", 1) for e in c.get("Env") or [])
    env.update(plan.env)
    c["Env"] = [f"{k}={v}" for k, v in env.items()]
    if plan.labels:
        c["Labels"] = {**(c.get("Labels") or {}), **plan.labels}
    if plan.user:
        c["User"] = plan.user
    if plan.entrypoint:
        c["Entrypoint"] = plan.entrypoint
        c["Cmd"] = plan.cmd or None  # an ENTRYPOINT resets the base's CMD, as in a real build
    elif plan.cmd:
        c["Cmd"] = plan.cmd
    cfg["rootfs"] = {"type": "layers", "diff_ids": [*cfg["rootfs"]["diff_ids"], _digest(layer)]}
    cfg["created"] = "1970-01-01T00:00:00Z"
    cfg["history"] = [*(cfg.get("history") or []),
                      {"created": "1970-01-01T00:00:00Z", "created_by": "nodeimage/build.py (nodeimage/Containerfile)"}]
    return cfg


def _write_layout(root: Path, layers: list[tuple[str, bytes]], config: dict, name: str | None,
                  base: Layout | None = None, base_layers: list[dict] | None = None) -> dict:
    out = Layout(root)
    root.mkdir(parents=True, exist_ok=True)
    descs = []
    for desc in base_layers or []:
        assert base is not None
        out.write_blob(base.read_blob(desc["digest"]))
        descs.append({"mediaType": _oci_media_type(desc["mediaType"]), "digest": desc["digest"], "size": desc["size"]})
    for mt, data in layers:
        descs.append({"mediaType": mt, **out.write_blob(data)})
    cfg_desc = {"mediaType": _MT_CONFIG, **out.write_blob(_json(config))}
    manifest = {"schemaVersion": 2, "mediaType": _MT_MANIFEST, "config": cfg_desc, "layers": descs}
    man_desc = {"mediaType": _MT_MANIFEST, **out.write_blob(_json(manifest)),
                "platform": {"architecture": "amd64", "os": "linux"}}
    if name:
        man_desc["annotations"] = {"io.containerd.image.name": name,
                                   "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "mediaType": _MT_INDEX,
                                                 "manifests": [man_desc]}, sort_keys=True))
    return manifest


def _oci_media_type(mt: str) -> str:
    return {"application/vnd.docker.image.rootfs.diff.tar.gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
            "application/vnd.docker.image.rootfs.diff.tar": _MT_LAYER}.get(mt, mt)


def _archive(layout: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(layout.rglob("*")):
            info = tar.gettarinfo(str(p), p.relative_to(layout).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
            with (open(p, "rb") if p.is_file() else io.BytesIO()) as f:
                tar.addfile(info, f if p.is_file() else None)
    os.replace(tmp, dest)


@dataclass(frozen=True)
class Built:
    archive: Path
    layout: Path
    name: str
    manifest_digest: str
    config: dict
    layer: bytes


def build(out: Path, *, base: str | None = None, name: str = DEFAULT_NAME, repo: Path = REPO,
          cache: Path = CACHE) -> Built:
    """Build the image into ``out`` (``out/layout/`` and ``out/weft-image.oci.tar``)."""
    plan = parse_containerfile((repo / "nodeimage" / "Containerfile").read_text(),
                               {"BASE": base} if base else None)
    base_layout = resolve_base(plan.base, cache)
    base_manifest, base_config = base_layout.image()
    layer = weft_layer(plan, repo, cache)
    config = image_config(base_config, plan, layer)
    layout = out / "layout"
    shutil.rmtree(layout, ignore_errors=True)
    manifest = _write_layout(layout, [(_MT_LAYER, layer)], config, name, base_layout, base_manifest["layers"])
    archive = out / ARCHIVE_NAME
    _archive(layout, archive)
    return Built(archive, layout, name, _digest(_json(manifest)), config, layer)


# --- the lock file ---------------------------------------------------------------------


def runtime_closure(dist: str = "weft") -> dict[str, str]:
    """weft's runtime dependencies, recursively, at the versions installed here (name -> version)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    seen: dict[str, str] = {}

    def walk(name: str) -> None:
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            return
        d = md.distribution(name)
        seen[key] = d.version
        for r in d.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                walk(req.name)

    walk(dist)
    seen.pop(dist)
    return dict(sorted(seen.items()))


def write_lock(lockfile: Path = LOCKFILE, cache: Path = CACHE) -> Path:
    """Pin weft's runtime closure at this venv's versions, with the sha256 of each manylinux/cp311 wheel."""
    pins = runtime_closure()
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "download", "-d", str(wheels),
          "--no-deps", "--only-binary=:all:", *PIP_PLATFORM, *(f"{n}=={v}" for n, v in pins.items())],
         "download wheels to lock")
    lines = ["# weft's runtime dependencies for the node image (CPython 3.11, manylinux x86_64), pinned with",
             "# hashes. Generated by `python -m nodeimage.build lock` from the dev venv's versions; do not edit.", ""]
    for n, v in pins.items():
        norm = re.sub(r"[-_.]+", "_", n).lower()
        files = [w for w in sorted(wheels.glob("*.whl"))
                 if re.sub(r"[-_.]+", "_", w.name.split("-")[0]).lower() == norm and w.name.split("-")[1] == v]
        if not files:
            raise BuildError(f"no wheel for {n}=={v} for the image's platform")
        hashes = " ".join(f"--hash=sha256:{hashlib.sha256(w.read_bytes()).hexdigest()}" for w in files)
        lines.append(f"{n}=={v} {hashes}")
    lockfile.write_text("\n".join(lines) + "\n")
    return lockfile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nodeimage.build", description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", choices=("image", "lock"), default="image")
    p.add_argument("--out", type=Path, default=REPO / "nodeimage" / "out", help="output directory")
    p.add_argument("--base", help="debian-packages, oci:DIR or a registry ref by digest (default: the Containerfile's)")
    p.add_argument("--name", default=DEFAULT_NAME, help="image name recorded for ctr import")
    args = p.parse_args(argv)
    try:
        if args.command == "lock":
            print(f"wrote {write_lock()}")
            return 0
        built = build(args.out, base=args.base, name=args.name)
    except BuildError as exc:
        print(f"nodeimage.build: {exc}", file=sys.stderr)
        return 2
    print(f"{built.archive}\n{built.name} {built.manifest_digest}\n"
          f"import: ctr -n k8s.io images import {built.archive}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
