"""The weft layer: the Containerfile's RUN (pip, for the base's Python) and COPY lines, as one reproducible tar."""

from __future__ import annotations

import io
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hooks import native
from nodeimage.build.base import download_debs
from nodeimage.build.common import (
    CACHE,
    HOOK_FROM,
    HOOK_OUTPUT,
    HOOK_SOURCE,
    HOOK_STAGE,
    INIT_OUTPUT,
    INIT_PACKAGE,
    INIT_STAGE,
    LOCKFILE,
    REPO,
    BuildError,
    _run,
    _run_bytes,
    pip_platform,
)
from nodeimage.build.containerfile import Plan, _ignored, ignore_patterns
from nodeimage.build.layout import layer_tar
from nodeimage.build.pins import Pins, check_host, read_pins


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
            info.mode = 0o755 if p.stat().st_mode & 0o111 else 0o644
            yield info, p.read_bytes()


def pip_install(target: Path, lockfile: Path = LOCKFILE, cache: Path = CACHE, arch: str = "amd64") -> None:
    """The Containerfile's RUN, on this host: the locked wheels for the base's Python on ``arch`` into
    ``target``."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    common = ["--no-deps", "--only-binary=:all:", "--require-hashes", *pip_platform(arch), "-r", str(lockfile)]
    # Download only what the cache lacks (pip checks each wheel's hash against the lock either way).
    _run([*pip, "download", "-d", str(wheels), *common], "download the locked wheels (pip download)")
    _run([*pip, "install", "--no-index", "--find-links", str(wheels), "--no-cache-dir", "--no-compile",
          "--target", str(target), *common], "install the locked wheels (pip install --target)")
    shutil.rmtree(target / "bin", ignore_errors=True)
    _drop_outside_records(target)


def _drop_outside_records(target: Path) -> None:
    """pip lists the scripts it wrote to ``bin/`` (``../../bin/NAME`` in a RECORD), with the hash of each, whose
    first line names this host's interpreter: that path would make the image differ from one checkout (or venv)
    to another. The RUN line removes those scripts, so their lines go too: a RECORD lists what is there."""
    for record in sorted(target.glob("*.dist-info/RECORD")):
        lines = record.read_text().splitlines(keepends=True)
        kept = [ln for ln in lines if not ln.startswith("../")]
        if kept != lines:
            record.write_text("".join(kept))


def hook_stage(plan: Plan, repo: Path, out: Path, pins: Pins | None = None, arch: str = "amd64") -> dict[str, Path]:
    """The hook stage, on this host: its one file compiled as its RUN would (``hooks.native``; for another
    architecture with Debian's cross compiler for it), with the toolchain the pins' ``[host]`` names (a static
    binary carries the host's C library); {path: file}."""
    stage = plan.stages[HOOK_STAGE]
    if stage.copies != [(HOOK_FROM, HOOK_SOURCE)]:
        raise BuildError(f"Containerfile hook stage: COPY {HOOK_FROM} {HOOK_SOURCE}, nothing else")
    check_host(pins or read_pins(), arch)
    try:
        return {HOOK_OUTPUT: native.compile_to(out / "weft-oci-hook", repo / HOOK_FROM, arch=arch)}
    except native.NativeHookUnavailable as exc:
        raise BuildError(f"the native OCI hook: {exc} (scripts/setup.sh installs gcc)") from exc


def init_stage(cache: Path = CACHE, pins: Pins | None = None, arch: str = "amd64") -> dict[str, Path]:
    """The init stage, on this host: tini's static binary from the Debian package its RUN line installs (``arch``'s),
    at the version the pins' ``[init]`` names, downloaded once into the cache; {path: file}."""
    version = (pins or read_pins()).of("init", arch)[INIT_PACKAGE]
    (deb,) = download_debs({INIT_PACKAGE: version}, cache / "debs", arch).values()
    out = cache / "init" / deb.stem / Path(INIT_OUTPUT).name
    if not out.exists():
        data = _run_bytes(["dpkg-deb", "--fsys-tarfile", str(deb)], f"unpack {deb.name}")
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            member = tar.extractfile(f".{INIT_OUTPUT}")
            if member is None:
                raise BuildError(f"{deb.name} holds no {INIT_OUTPUT}")
            binary = member.read()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_bytes(binary)
        tmp.chmod(0o755)
        os.replace(tmp, out)
    return {INIT_OUTPUT: out}


def weft_layer(plan: Plan, repo: Path = REPO, cache: Path = CACHE, pins: Pins | None = None,
               mtime: int = 0, arch: str = "amd64") -> bytes:
    """The one layer the build adds for ``arch``: what COPY, COPY --from and the pip RUN put in, every file's time
    ``mtime``."""
    pins = pins or read_pins()
    patterns = ignore_patterns(repo / "nodeimage" / "containerignore")
    entries: list[tuple[tarfile.TarInfo, bytes | None]] = []
    with tempfile.TemporaryDirectory(prefix="weft-image-") as tmp:
        for src, dest in plan.copies:
            entries.extend(_tree(repo / src, dest, patterns))
        built = hook_stage(plan, repo, Path(tmp) / "hook", pins, arch) if HOOK_STAGE in plan.stages else {}
        if INIT_STAGE in plan.stages:
            built.update(init_stage(cache, pins, arch))
        for _stage, src, dest in plan.copies_from:
            if src not in built:
                raise BuildError(f"Containerfile COPY --from: the stage makes no {src}")
            entries.extend(_tree(built[src], dest, []))
        if plan.runs:
            lock = next(repo / src for src, dest in plan.copies if dest == "/opt/weft/requirements.lock")
            pip_install(Path(tmp) / "lib", lock, cache, arch)
            entries.extend(_tree(Path(tmp) / "lib", "/opt/weft/lib", []))
        return layer_tar(entries, mtime)
