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
    PIP_PLATFORM,
    REPO,
    BuildError,
    _run,
    _run_bytes,
)
from nodeimage.build.containerfile import Plan, _ignored, ignore_patterns
from nodeimage.build.layout import layer_tar


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


def hook_stage(plan: Plan, repo: Path, out: Path) -> dict[str, Path]:
    """The hook stage, on this host: its one file compiled as its RUN would (``hooks.native``); {path: file}."""
    stage = plan.stages[HOOK_STAGE]
    if stage.copies != [(HOOK_FROM, HOOK_SOURCE)]:
        raise BuildError(f"Containerfile hook stage: COPY {HOOK_FROM} {HOOK_SOURCE}, nothing else")
    try:
        return {HOOK_OUTPUT: native.compile_to(out / "weft-oci-hook", repo / HOOK_FROM)}
    except native.NativeHookUnavailable as exc:
        raise BuildError(f"the native OCI hook: {exc} (scripts/setup.sh installs gcc)") from exc


def init_stage(cache: Path = CACHE) -> dict[str, Path]:
    """The init stage, on this host: tini's static binary from the Debian package its RUN line installs (the
    version apt would install here), downloaded once into the cache; {path: file}."""
    policy = _run(["apt-cache", "policy", INIT_PACKAGE], f"resolve the {INIT_PACKAGE} package's version").stdout
    version = next((ln.split(":", 1)[1].strip() for ln in policy.splitlines() if ln.strip().startswith("Candidate:")),
                   "(none)")
    if version == "(none)":
        raise BuildError(f"Debian package {INIT_PACKAGE} not available from apt here (run apt-get update)")
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    pattern = f"{INIT_PACKAGE}_{version.replace(':', '%3a')}_*.deb"  # apt-get download escapes ':' as %3a
    if not sorted(debs.glob(pattern)):
        _run(["apt-get", "download", f"{INIT_PACKAGE}={version}"], f"download {INIT_PACKAGE} (apt-get download)",
             cwd=debs)
    deb = sorted(debs.glob(pattern))[0]
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


def weft_layer(plan: Plan, repo: Path = REPO, cache: Path = CACHE) -> bytes:
    patterns = ignore_patterns(repo / "nodeimage" / "containerignore")
    entries: list[tuple[tarfile.TarInfo, bytes | None]] = []
    with tempfile.TemporaryDirectory(prefix="weft-image-") as tmp:
        for src, dest in plan.copies:
            entries.extend(_tree(repo / src, dest, patterns))
        built = hook_stage(plan, repo, Path(tmp) / "hook") if HOOK_STAGE in plan.stages else {}
        if INIT_STAGE in plan.stages:
            built.update(init_stage(cache))
        for _stage, src, dest in plan.copies_from:
            if src not in built:
                raise BuildError(f"Containerfile COPY --from: the stage makes no {src}")
            entries.extend(_tree(built[src], dest, []))
        if plan.runs:
            lock = next(repo / src for src, dest in plan.copies if dest == "/opt/weft/requirements.lock")
            pip_install(Path(tmp) / "lib", lock, cache)
            entries.extend(_tree(Path(tmp) / "lib", "/opt/weft/lib", []))
        return layer_tar(entries)
