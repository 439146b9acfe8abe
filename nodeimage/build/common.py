"""What every step of the build shares: paths, names, media types, the error, and small helpers."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
from pathlib import Path

from hooks import native

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "nodeimage" / "Containerfile"
IGNOREFILE = REPO / "nodeimage" / "containerignore"
LOCKFILE = REPO / "nodeimage" / "requirements.lock"
PINFILE = REPO / "nodeimage" / "debian-packages.pins"
CACHE = Path(os.environ.get("WEFT_CACHE_ROOT") or "/var/cache/weft") / "nodeimage"
DEFAULT_NAME = "localhost/weft/node:0.1.0"
# The base the build uses unless told otherwise: made from Debian bookworm's packages at the versions
# nodeimage/debian-packages.pins names (the base every test builds on). "containerfile" takes the
# Containerfile's ARG BASE instead (what a container engine would use; not fetched or tested here).
DEFAULT_BASE = "debian-packages"
CONTAINERFILE_BASE = "containerfile"
ARCHIVE_NAME = "weft-image.oci.tar"

# The image's architectures, by OCI's names; a build makes one or several (an index of them). amd64 is the
# default: the image every test builds, imports and runs.
ARCHES = ("amd64", "arm64")
DEFAULT_PLATFORMS = ("linux/amd64",)
_MANYLINUX = ("manylinux_2_36", "manylinux_2_34", "manylinux_2_28", "manylinux_2_17", "manylinux2014")


def pip_platform(arch: str = "amd64") -> list[str]:
    """pip's options for the wheels the base's Python (CPython 3.11, glibc 2.36 on bookworm) loads on ``arch``."""
    machine = native.ARCHES[arch][0]
    return ["--implementation", "cp", "--python-version", "3.11", "--abi", "cp311", "--abi", "abi3", "--abi", "none",
            *(a for tag in _MANYLINUX for a in ("--platform", f"{tag}_{machine}")), "--platform", "any"]


PIP_PLATFORM = pip_platform("amd64")


def parse_platforms(text: str) -> tuple[str, ...]:
    """``linux/amd64,linux/arm64`` -> the architectures, in that order; anything else refused by name."""
    arches = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        os_, _, arch = item.partition("/")
        if os_ != "linux" or arch not in ARCHES:
            raise BuildError(f"platform {item!r}: the image is built for {', '.join(f'linux/{a}' for a in ARCHES)}")
        if arch in arches:
            raise BuildError(f"platform {item!r} named twice")
        arches.append(arch)
    if not arches:
        raise BuildError("no platform named (for example --platform linux/amd64,linux/arm64)")
    return tuple(arches)


# The one RUN line build.py knows how to do; the Containerfile must say exactly this.
PIP_RUN = ("pip install --no-cache-dir --no-deps --no-compile --only-binary=:all: --require-hashes "
           "--target /opt/weft/lib -r /opt/weft/requirements.lock && rm -rf /opt/weft/lib/bin")

# The native OCI hook's stage: on the base (the image itself has no compiler), static, with hooks/native.py's
# flags; build.py compiles it on this host with those flags instead.
HOOK_STAGE = "hook"
HOOK_FROM = "hooks/weft_oci_hook.c"  # in the build context (the repository)
HOOK_SOURCE = "/src/weft_oci_hook.c"
HOOK_OUTPUT = "/out/weft-oci-hook"
HOOK_RUN = ("apt-get update -q && apt-get install -y -q --no-install-recommends gcc libc6-dev && mkdir -p /out && "
            f"cc {' '.join(native.CFLAGS)} -o {HOOK_OUTPUT} {HOOK_SOURCE}")

# tini, the containers' init (the ENTRYPOINT runs weft under it): Debian's package, its static binary, from an
# "init" stage; build.py takes the same file from the same package (apt-get download) instead of that RUN line.
INIT_STAGE = "init"
INIT_PACKAGE = "tini"
INIT_RUN = f"apt-get update -q && apt-get install -y -q --no-install-recommends {INIT_PACKAGE}"
INIT_OUTPUT = "/usr/bin/tini-static"

_MT_INDEX = "application/vnd.oci.image.index.v1+json"
_MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_MT_CONFIG = "application/vnd.oci.image.config.v1+json"
_MT_LAYER = "application/vnd.oci.image.layer.v1.tar"
_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"


class BuildError(Exception):
    """The image cannot be built; the message says what to do."""


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _run(argv: list[str], what: str, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, **kw)
    except FileNotFoundError as exc:
        raise BuildError(f"{what}: {argv[0]} is not installed (scripts/setup.sh installs it)") from exc
    if check and res.returncode != 0:
        raise BuildError(f"{what}: {' '.join(argv[:3])} ... failed: {(res.stderr or res.stdout).strip()[-2000:]}")
    return res


def _run_bytes(argv: list[str], what: str) -> bytes:
    res = subprocess.run(argv, capture_output=True)
    if res.returncode != 0:
        raise BuildError(f"{what}: {res.stderr.decode(errors='replace').strip()}")
    return res.stdout


def source_date_epoch(repo: Path) -> int:
    """The image's one date (its config's ``created``, its layer's file times): ``$SOURCE_DATE_EPOCH`` where set
    (the reproducible-builds convention), else the time of ``repo``'s last commit where ``repo`` is a git work
    tree's top, else 0. Never the time of the build: the same tree and pins give the same image."""
    env = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if env:
        if not env.isdigit():
            raise BuildError(f"SOURCE_DATE_EPOCH={env!r} is not a number of seconds since 1970")
        return int(env)
    git = ["git", "-c", f"safe.directory={repo}", "-C", str(repo)]
    try:
        top = subprocess.run([*git, "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=30)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != repo.resolve():
            return 0
        when = subprocess.run([*git, "log", "-1", "--format=%ct"], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return 0
    return int(when.stdout.strip()) if when.returncode == 0 and when.stdout.strip().isdigit() else 0


def rfc3339(epoch: int) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
