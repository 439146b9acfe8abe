"""The node image, built without a container engine, imported into a real containerd and run through CRI.

``nodeimage/build.py`` writes ``weft-image.oci.tar``; ``ctr images import``
loads it as it would be on a node; then kubelet's calls run its entrypoint
(``weft --version``), the OCI hook's entrypoint, and check the image's user.

The base is the build's default, Debian's packages at the versions
``nodeimage/debian-packages.pins`` names (``--base debian-packages``: the
shipped image), unless ``WEFT_NODEIMAGE_BASE`` names another (for example
``containerfile``, the Containerfile's registry base, which needs Docker Hub
once and is cached under /var/cache/weft/nodeimage/bases after; not tested
here).

The arm64 image of the multi-architecture build runs here under qemu-user's
emulator (binfmt_misc, registered as Debian's qemu-user-static does on a
systemd host, and unregistered after where this registered it): its
entrypoint's ``weft --version``, its OCI hook, and its installer's copy onto a
node made of Debian's arm64 C library alone, checked as the installer checks a
real host. That is the only way the arm64 image has run: emulated, never on an
arm64 machine.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from hooks import native
from nodeimage import build
from nodeimage.build import base as image_base
from shim import __version__
from shim.install import bundle
from shim.localfabric import pods
from shim.localfabric.containerd import Containerd
from shim.localfabric.waiting import wait_for
from tests.install.conftest import HOSTROOTS, snapshot

pytestmark = pytest.mark.slow


def _build(tmp_path_factory, base: str, **kw) -> build.Built:
    try:
        return build.build(tmp_path_factory.mktemp("nodeimage"), base=base, **kw)
    except build.BuildError as exc:
        pytest.fail(f"building the node image on base {base!r} ({kw or 'amd64'}) failed (a first build needs "
                    f"network access: apt's mirror for Debian packages, the package index for wheels, the "
                    f"registry for a registry base; later builds use /var/cache/weft/nodeimage): {exc}")


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> build.Built:
    return _build(tmp_path_factory, os.environ.get("WEFT_NODEIMAGE_BASE", "debian-packages"))


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> build.Built:
    """The multi-architecture image, amd64 and arm64 (what a release ships)."""
    return _build(tmp_path_factory, "debian-packages", platforms="linux/amd64,linux/arm64")


@pytest.fixture
def imported(containerd: Containerd, archive: build.Built) -> Iterator[build.Built]:
    res = subprocess.run(["ctr", "-a", str(containerd.socket), "-n", "k8s.io", "images", "import",
                          str(archive.archive)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"ctr images import {archive.archive}: {res.stderr}"
    yield archive
    subprocess.run(["ctr", "-a", str(containerd.socket), "-n", "k8s.io", "images", "rm", archive.name],
                   capture_output=True, text=True, timeout=60)


def _run_to_exit(rt, containerd: Containerd, name: str, command: list[str], args: list[str], image: str):
    """Run one container of the image in its own pod until it exits: (exit code, log lines)."""
    cfg = pods.sandbox_config(name, containerd.pod_log_dir)
    sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg)).pod_sandbox_id
    ccfg = pods.container_config(name, command, image=image)
    del ccfg.args[:]
    ccfg.args.extend(args)
    ccfg.linux.resources.memory_limit_in_bytes = 512 << 20  # Python and grpc, not busybox
    ccfg.linux.security_context.ClearField("run_as_user")  # the image's USER decides
    create = cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg)
    cid = rt.CreateContainer(create).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    status = wait_for(lambda: (s := rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status).state
                      == cri.CONTAINER_EXITED and s, timeout=120, what=f"container {name} to exit")
    log = Path(cfg.log_directory) / ccfg.log_path
    lines = [ln.split(" ", 3)[3] for ln in log.read_text().splitlines()] if log.exists() else []
    return status.exit_code, lines


def test_image_imports_and_its_entrypoint_runs_weft(containerd: Containerd, imported: build.Built):
    with containerd.channel() as ch:
        rt, im = cri_grpc.RuntimeServiceStub(ch), cri_grpc.ImageServiceStub(ch)
        status = im.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=imported.name)), timeout=30)
        assert imported.name in status.image.repo_tags
        code, lines = _run_to_exit(rt, containerd, "weft-version", [], ["--version"], imported.name)
    assert (code, lines) == (0, [f"weft {__version__}"])


def test_image_runs_as_its_non_root_user(containerd: Containerd, imported: build.Built):
    with containerd.channel() as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        code, lines = _run_to_exit(rt, containerd, "weft-user", ["python3", "-c", "import os; print(os.getuid())"],
                                   [], imported.name)
    assert (code, lines) == (0, ["65532"])


def test_image_runs_the_oci_hook(containerd: Containerd, imported: build.Built):
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 1,
                        "annotations": {"weft.io/lease": "lease-1"}})
    # An unknown stage with a lease: the hook reads and parses the state, warns and exits 0 (never blocks).
    script = f"printf '%s' '{state}' | weft-oci-hook probe 2>&1; echo rc=$?"
    with containerd.channel() as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        code, lines = _run_to_exit(rt, containerd, "weft-hook", ["sh", "-c", script], [], imported.name)
    assert (code, lines) == (0, ["weft-oci-hook: unknown hook stage 'probe'; doing nothing", "rc=0"])


# -- the host copy the image's installer makes, on a node with nothing but the C library ------------------------
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"


BINFMT = Path("/proc/sys/fs/binfmt_misc")


@pytest.fixture(scope="module")
def arm64_runs_emulated() -> Iterator[None]:
    """arm64 programs run here, a chroot's included, through qemu-user: binfmt_misc mounted and qemu-aarch64
    registered from Debian's qemu-user-static (its ``F`` flag opens the emulator once, so it need not be in the
    chroot), as that package does on a systemd host; what this fixture mounts or registers it takes back."""
    if native.host_arch() == "arm64":
        yield
        return
    mounted = registered = False
    if not (BINFMT / "register").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], check=True)
        mounted = True
    entry = BINFMT / "qemu-aarch64"
    try:
        if not entry.exists():
            conf = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")
            assert conf.exists(), "no qemu-aarch64 entry to register (scripts/setup.sh installs qemu-user-static)"
            (BINFMT / "register").write_text(conf.read_text().strip())
            registered = True
        assert entry.read_text().startswith("enabled"), entry.read_text()
        yield
    finally:
        if registered:
            entry.write_text("-1")
        if mounted:
            subprocess.run(["umount", str(BINFMT)], check=False)


def _unpack(built: build.Built, dest: Path, arch: str = "amd64") -> Path:
    """The image's root filesystem, its layers applied in order (neither layer deletes anything)."""
    manifest, _ = build.Layout(built.layout).image(arch)
    for desc in manifest["layers"]:
        with tarfile.open(build.Layout(built.layout).blob_path(desc["digest"]), mode="r:*") as tar:
            tar.extractall(dest, filter="fully_trusted")
    return dest


def test_the_arm64_images_entrypoint_runs_weft_and_its_hook_emulated(both: build.Built, arm64_runs_emulated: None,
                                                                     tmp_path: Path) -> None:
    """The arm64 image as a container runs it (its ENTRYPOINT under its USER and Env, in its root), emulated.
    qemu-user has no PR_SET_CHILD_SUBREAPER, which tini's ``-s`` asks for, so tini runs alone (``--version``)
    and the entrypoint's command after it, ``weft``, by itself: tini's part is the amd64 image's tests'."""
    image = _unpack(both, tmp_path / "image", "arm64")
    config = both.images[1].config["config"]
    env = dict(e.split("=", 1) for e in config["Env"])

    def run(*argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([CHROOT, f"--userspec={config['User']}", str(image), *argv], input=stdin,
                              capture_output=True, text=True, timeout=300, env=env, cwd="/")

    tini, weft = config["Entrypoint"][:3], config["Entrypoint"][3:]
    assert tini == ["/opt/weft/bin/tini", "-s", "--"], config["Entrypoint"]
    ran = run(tini[0], "--version")
    assert (ran.returncode, ran.stdout.strip()) == (0, "tini version 0.19.0"), ran.stderr
    ran = run(*weft, "--version")
    assert (ran.returncode, ran.stdout.strip()) == (0, f"weft {__version__}"), ran.stderr
    ran = run("python3", "-c", "import platform, grpc, cryptography.hazmat.bindings._rust, uvloop; "
                               "print(platform.machine())")
    assert (ran.returncode, ran.stdout.strip()) == (0, "aarch64"), ran.stderr
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 1,
                        "annotations": {"weft.io/lease": "lease-1"}})
    ran = run("/opt/weft/bin/weft-oci-hook", "probe", stdin=state)
    assert (ran.returncode, ran.stderr.strip()) == (0, "weft-oci-hook: unknown hook stage 'probe'; doing nothing")


MINIMAL_NODE = ("libc6", "dash", "coreutils")


def _minimal_node(dest: Path, arch: str = "amd64") -> Path:
    """A node's root with a kubeadm layout and only Debian's libc6, dash and coreutils (``arch``'s): no
    libsqlite3, libssl, libffi or Python, as a minimal node OS has."""
    shutil.copytree(HOSTROOTS / "kubeadm", dest, symlinks=True)
    for top in ("bin", "lib", "lib64", "sbin"):  # merged /usr, as Debian 12's
        (dest / "usr" / top).mkdir(parents=True, exist_ok=True)
        (dest / top).symlink_to(f"usr/{top}")
    if arch != native.host_arch():  # Debian's packages for it, at the image's pinned versions, unpacked
        pinned = build.read_pins().of("base", arch)
        for deb in image_base.download_debs({p: pinned[p] for p in MINIMAL_NODE}, build.CACHE / "debs",
                                            arch).values():
            data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                for m in tar.getmembers():
                    m.name = image_base._merged_usr(m.name)
                    if m.name and not m.isdir():
                        tar.extract(m, dest, filter="fully_trusted")
        return dest
    for pkg in MINIMAL_NODE:
        listed = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True, check=True).stdout.split("\n")
        for path in filter(None, listed):
            src = Path(path)
            if src.is_symlink() or src.is_file():
                target = dest / path.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists() and not target.is_symlink():
                    shutil.copy2(src, target, follow_symlinks=False)
    return dest


@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_the_images_installer_copies_a_weft_that_runs_on_a_node_with_only_the_c_library(
        request: pytest.FixtureRequest, archive: build.Built, arch: str, tmp_path: Path) -> None:
    """The DaemonSet's install container, as its image runs it: the copy in /opt/weft carries weft, its
    dependencies and every library they need beyond the C library, and runs on the host by itself. arm64: the
    multi-architecture image's arm64 one, on an arm64 node's root, emulated (see the module's doc)."""
    if arch != native.host_arch():
        request.getfixturevalue("arm64_runs_emulated")
        archive = request.getfixturevalue("both")
    image = _unpack(archive, tmp_path / "image", arch)
    node = _minimal_node(tmp_path / "node", arch)
    machine = subprocess.run(["file", "-bL", str(node / "usr/bin/dash"), str(image / "usr/bin/python3.11")],
                             capture_output=True, text=True).stdout
    lines = machine.splitlines()
    assert len(lines) == 2 and all({"amd64": "x86-64", "arm64": "aarch64"}[arch] in ln for ln in lines), machine
    assert not list(node.glob("usr/lib/*/libsqlite3.so*")) and not (node / "usr/bin/python3").exists()
    before = snapshot(node)
    image_env = dict(e.split("=", 1) for e in archive.config["config"]["Env"])  # as a container of it has
    (image / "host").mkdir(exist_ok=True)
    (image / "proc").mkdir(exist_ok=True)
    subprocess.run(["mount", "--bind", str(node), str(image / "host")], check=True)
    subprocess.run(["mount", "-t", "proc", "proc", str(image / "proc")], check=True)  # as a container has
    try:
        def in_image(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([CHROOT, str(image), "/opt/weft/bin/weft", *args, "--root", "/host"],
                                  capture_output=True, text=True, timeout=300, env=image_env)

        res = in_image("install")
        assert res.returncode == 0, res.stdout + res.stderr
        ran = subprocess.run([CHROOT, str(node), "/opt/weft/bin/weft", "--version"], capture_output=True,
                             text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert (ran.returncode, ran.stdout.strip()) == (0, f"weft {__version__}"), ran.stderr
        check = subprocess.run([CHROOT, str(node), *bundle.check_argv("/opt/weft")], capture_output=True,
                               text=True, timeout=120, env={})
        assert check.returncode == 0, check.stderr  # what the installer runs on a real host before any service
        hook = subprocess.run([CHROOT, str(node), "/opt/weft/bin/weft-oci-hook", "probe"], input="{}",
                              capture_output=True, text=True, timeout=60, env={})
        assert hook.returncode == 0, hook.stderr
        # Without a library the copy carries, the same check names it (the installer refuses with it).
        (node / "opt/weft/lib/libsqlite3.so.0").unlink()
        check = subprocess.run([CHROOT, str(node), *bundle.check_argv("/opt/weft")], capture_output=True,
                               text=True, timeout=120, env={})
        assert check.returncode != 0 and "libsqlite3.so.0" in check.stderr, check.stderr

        res = in_image("uninstall")
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        for point in ("proc", "host"):
            subprocess.run(["umount", str(image / point)], check=False)
    assert snapshot(node) == before
