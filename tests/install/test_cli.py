"""``weft install --root`` / ``weft uninstall --root`` on host roots of the shapes real nodes have."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from shim.cli import main
from shim.install import bundle, containerd
from tests.install.conftest import SHAPES, SHAPES_1X, SHAPES_2X, copy_shape, snapshot, stamps

AGENT = "unix:///run/weft/cri.sock"
CRI = "io.containerd.grpc.v1.cri"
CRI_RUNTIME = "io.containerd.cri.v1.runtime"
DROPIN = "etc/containerd/weft/runtime.toml"

# Where each containerd 2.x shape's default runtime is defined: (file, plugin section, runtime name). The
# real containerd 2.4.2 agrees (integration/install/test_install.py reads its `config dump` of these roots).
DEFAULT_RUNTIME_2X = {
    "ctrd2-default": ("etc/containerd/config.toml", CRI_RUNTIME, "runc"),
    "ctrd2-kubeadm": ("etc/containerd/config.toml", CRI_RUNTIME, "runc"),
    "ctrd2-eks": ("etc/containerd/config.toml", CRI_RUNTIME, "nvidia"),
    "ctrd2-gpu-confd": ("etc/containerd/conf.d/99-nvidia.toml", CRI_RUNTIME, "nvidia"),
    "ctrd2-v2config": ("etc/containerd/config.toml", CRI, "runc"),
}


def _kubelet_endpoints(root: Path) -> list[str]:
    """Every runtime endpoint kubelet would read, flags last (they win)."""
    found = []
    cfg = root / "var/lib/kubelet/config.yaml"
    if cfg.exists():
        doc = yaml.safe_load(cfg.read_text())
        found += [doc[k] for k in ("containerRuntimeEndpoint", "imageServiceEndpoint") if k in doc]
    flags = root / "var/lib/kubelet/kubeadm-flags.env"
    if flags.exists():
        found += [w.split("=", 1)[1] for w in flags.read_text().replace('"', " ").split()
                  if w.startswith(("--container-runtime-endpoint=", "--image-service-endpoint="))]
    return found


def _effective_cri(root: Path) -> dict:
    """The CRI section containerd 1.x ends up with: each import's plugin section replaces the one before."""
    main_doc = tomllib.loads((root / "etc/containerd/config.toml").read_text())
    cri = main_doc.get("plugins", {}).get(CRI, {})
    for imp in main_doc.get("imports", []):
        for f in sorted(root.glob(imp.lstrip("/"))):
            cri = tomllib.loads(f.read_text()).get("plugins", {}).get(CRI, cri)
    return cri


def _weft_runtime_1x(root: Path, cri_before: dict) -> dict:
    """The 1.x drop-in: the host's effective CRI section, unchanged, plus the weft runtime."""
    cri = _effective_cri(root)
    weft = cri["containerd"]["runtimes"].pop("weft")
    assert cri == cri_before or (not cri_before.get("containerd", {}).get("runtimes") and cri["containerd"]["runtimes"]
                                 == {"runc": {"runtime_type": "io.containerd.runc.v2"}})
    runc = cri_before["containerd"]["runtimes"]["runc"]
    assert weft["options"] == runc.get("options", {}), "weft pods get the same runc options (cgroup driver)"
    return weft


def _weft_runtime_2x(root: Path, shape: str) -> dict:
    """The 2.x drop-in: only the weft runtime, a copy of the default one, in the main file's config version."""
    path, section, name = DEFAULT_RUNTIME_2X[shape]
    version = tomllib.loads((root / "etc/containerd/config.toml").read_text())["version"]
    dropin = tomllib.loads((root / DROPIN).read_text())
    weft = dropin["plugins"][section]["containerd"]["runtimes"]["weft"]
    assert dropin == {"version": version, "plugins": {section: {"containerd": {"runtimes": {"weft": weft}}}}}
    default = tomllib.loads((root / path).read_text())["plugins"][section]["containerd"]["runtimes"][name]
    if name == "runc":  # containerd 2.x decodes the files' runc onto its own
        default = _merged(containerd.RUNC_DEFAULTS_2X, default)
    assert weft == {**default, "runtime_type": "io.containerd.runc.v2", "base_runtime_spec": containerd.BASE_SPEC,
                    "pod_annotations": ["weft.io/*"], "container_annotations": ["weft.io/*"]}
    return weft


def _merged(a: dict, b: dict) -> dict:
    return {**a, **{k: _merged(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                    for k, v in b.items()}}


@pytest.mark.parametrize("shape", SHAPES)
def test_install_switches_kubelet_adds_the_weft_handler_and_uninstall_restores_every_byte(
        shape: str, tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_shape(shape, tmp_path / "host")
    before = snapshot(root)
    cri_before = _effective_cri(root)

    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    assert _kubelet_endpoints(root) and set(_kubelet_endpoints(root)) == {AGENT}
    weft = _weft_runtime_2x(root, shape) if shape in SHAPES_2X else _weft_runtime_1x(root, cri_before)
    assert weft["pod_annotations"] == weft["container_annotations"] == ["weft.io/*"]
    spec = json.loads((root / weft["base_runtime_spec"].lstrip("/")).read_text())
    assert "hostname" not in spec
    for stage in ("createRuntime", "poststop"):
        assert [h["args"] for h in spec["hooks"][stage]] == [["/opt/weft/bin/weft-oci-hook", stage]]
    unit = (root / "etc/systemd/system/weft-agent.service").read_text()
    assert "Before=kubelet.service" in unit and "Restart=always" in unit
    assert "ExecStart=/opt/weft/bin/weft agent --socket /run/weft/cri.sock" in unit
    assert (root / "opt/weft/bin/weft").exists()

    installed, installed_stamps = snapshot(root), stamps(root)
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    assert "nothing changed" in capsys.readouterr().out
    assert snapshot(root) == installed and stamps(root) == installed_stamps

    assert main(["uninstall", "--root", str(root)]) == 0
    assert snapshot(root) == before
    assert main(["uninstall", "--root", str(root)]) == 0
    assert "not installed" in capsys.readouterr().out
    assert snapshot(root) == before


@pytest.mark.parametrize("shape", SHAPES)
def test_containerds_config_gains_the_dropin_in_its_imports_and_nothing_else(
        shape: str, tmp_path: Path, source: Path) -> None:
    root = copy_shape(shape, tmp_path / "host")
    config = root / "etc/containerd/config.toml"
    before_text, before = config.read_text(), tomllib.loads(config.read_text())
    main(["install", "--root", str(root), "--source", str(source)])
    after = tomllib.loads(config.read_text())
    assert after == {**before, "imports": [*before.get("imports", []), "/etc/containerd/weft/runtime.toml"]}
    changed = [line for line in config.read_text().splitlines() if line not in before_text.splitlines()]
    assert len(changed) == 1 and changed[0].startswith("imports = ")
    if shape in SHAPES_1X:
        assert tomllib.loads((root / DROPIN).read_text())["version"] == 2


def test_kubelet_yaml_keeps_comments_order_and_everything_else(tmp_path: Path, source: Path) -> None:
    root = copy_shape("imports", tmp_path / "host")
    original = (root / "var/lib/kubelet/config.yaml").read_text().splitlines()
    main(["install", "--root", str(root), "--source", str(source)])
    after = (root / "var/lib/kubelet/config.yaml").read_text().splitlines()
    changed = [(a, b) for a, b in zip(original, after, strict=True) if a != b]
    assert changed == [
        ('containerRuntimeEndpoint: "unix:///run/containerd/containerd.sock"   # containerd\'s CRI',
         "containerRuntimeEndpoint: unix:///run/weft/cri.sock   # containerd's CRI"),
        ("imageServiceEndpoint: unix:///run/containerd/containerd.sock",
         "imageServiceEndpoint: unix:///run/weft/cri.sock"),
    ]


def test_kubeadm_flags_win_so_the_flag_is_switched(tmp_path: Path, source: Path) -> None:
    root = copy_shape("kubeadm-flags", tmp_path / "host")
    cfg = (root / "var/lib/kubelet/config.yaml").read_bytes()
    main(["install", "--root", str(root), "--source", str(source)])
    assert (root / "var/lib/kubelet/kubeadm-flags.env").read_text() == (
        'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///run/weft/cri.sock '
        '--pod-infra-container-image=registry.k8s.io/pause:3.6"\n')
    assert (root / "var/lib/kubelet/config.yaml").read_bytes() == cfg


def test_config_without_imports_gains_one_line_and_nothing_else(tmp_path: Path, source: Path) -> None:
    root = copy_shape("kubeadm-flags", tmp_path / "host")
    before = (root / "etc/containerd/config.toml").read_text()
    main(["install", "--root", str(root), "--source", str(source)])
    after = (root / "etc/containerd/config.toml").read_text()
    added = [line for line in after.splitlines() if line not in before.splitlines()]
    assert added == ['imports = ["/etc/containerd/weft/runtime.toml"]  # added by weft install']
    assert after.replace(added[0] + "\n", "") == before


def _bad(root: Path, path: str, text: str) -> None:
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


REFUSALS = {
    "containerd config is not TOML": ("kubeadm", "/etc/containerd/config.toml", "version = 2\n[plugins\n",
                                      "/etc/containerd/config.toml: not valid TOML"),
    "containerd config version 1": ("kubeadm", "/etc/containerd/config.toml", "root = \"/var/lib/containerd\"\n",
                                    "config version 1 is not understood"),
    "config version 3 on containerd 1.6": ("kubeadm", "/etc/containerd/config.toml", "version = 3\n",
                                           "config version 3 is not read by containerd 1.6.20~ds1"),
    "config version 4 on containerd 2.1": ("ctrd2-eks", "/etc/containerd/config.toml", "version = 4\n",
                                           "config version 4 is not read by containerd 2.1.5"),
    "config version 5": ("ctrd2-default", "/etc/containerd/config.toml", "version = 5\n",
                         "config version 5 is not understood"),
    "CRI runtime plugin disabled (2.x)": ("ctrd2-eks", "/etc/containerd/config.toml",
                                          'version = 3\ndisabled_plugins = ["io.containerd.cri.v1.runtime"]\n',
                                          "the CRI plugin is disabled"),
    "default runtime is not runc (2.x)": ("ctrd2-kubeadm", "/etc/containerd/config.toml",
                                          'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd]\n'
                                          'default_runtime_name = "kata"\n'
                                          '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.kata]\n'
                                          'runtime_type = "io.containerd.kata.v2"\n', "needs io.containerd.runc.v2"),
    "a drop-in has a weft runtime of its own (2.x)": (
        "ctrd2-gpu-confd", "/etc/containerd/conf.d/50-weft.toml",
        'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.weft]\n'
        'runtime_type = "io.containerd.runc.v2"\n', "'weft' already exists and is not weft's"),
    "a drop-in imports more (2.x)": ("ctrd2-gpu-confd", "/etc/containerd/conf.d/20-more.toml",
                                     'version = 3\nimports = ["/etc/containerd/more.toml"]\n',
                                     "/etc/containerd/conf.d/20-more.toml: an imported file with its own `imports`"),
    "containerd 1.5": ("kubeadm", "/usr/bin/containerd",
                       '#!/bin/sh\necho "containerd github.com/containerd/containerd v1.5.18 "\n',
                       "/usr/bin/containerd --version: containerd v1.5.18 is not a version weft is tested with "
                       "(1.6, 1.7, 2.x are"),
    "containerd 3.0": ("ctrd2-default", "/usr/bin/containerd",
                       '#!/bin/sh\necho "containerd github.com/containerd/containerd/v3 v3.0.0 "\n',
                       "containerd v3.0.0 is not a version weft is tested with"),
    "not a containerd": ("ctrd2-default", "/usr/bin/containerd", "#!/bin/sh\necho hello\n",
                         "/usr/bin/containerd --version: 'hello' is not a containerd version"),
    "CRI plugin disabled": ("kubeadm", "/etc/containerd/config.toml",
                            'version = 2\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n',
                            "the CRI plugin is disabled"),
    "default runtime is not runc": ("kubeadm", "/etc/containerd/config.toml",
                                    'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
                                    'runtime_type = "io.containerd.kata.v2"\n', "needs io.containerd.runc.v2"),
    "an imported file is not TOML": ("imports", "/etc/containerd/conf.d/20-broken.toml", "[[[",
                                     "/etc/containerd/conf.d/20-broken.toml: not valid TOML"),
    "kubelet config is not YAML": ("kubeadm", "/var/lib/kubelet/config.yaml", "kind: [\n",
                                   "/var/lib/kubelet/config.yaml: not valid YAML"),
    "kubelet config is another kind": ("kubeadm", "/var/lib/kubelet/config.yaml",
                                       "apiVersion: v1\nkind: ConfigMap\n",
                                       "not a KubeletConfiguration (kind: ConfigMap)"),
    "kubelet config in flow style": ("kubeadm", "/var/lib/kubelet/config.yaml",
                                     '{"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration", '
                                     '"containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock"}\n',
                                     "cannot switch containerRuntimeEndpoint by editing one line"),
    "kubelet on another runtime": ("kubeadm-flags", "/var/lib/kubelet/kubeadm-flags.env",
                                   'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///var/run/crio/crio.sock"\n',
                                   "is unix:///var/run/crio/crio.sock, not containerd's socket"),
    "flags file not NAME=value": ("kubeadm-flags", "/var/lib/kubelet/kubeadm-flags.env", "--foo bar\n",
                                  "/var/lib/kubelet/kubeadm-flags.env: line 1 is not NAME="),
}


@pytest.mark.parametrize(("shape", "path", "text", "words"), REFUSALS.values(), ids=REFUSALS.keys())
def test_unrecognised_host_is_refused_naming_the_file_and_nothing_changes(
        shape: str, path: str, text: str, words: str, tmp_path: Path, source: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_shape(shape, tmp_path / "host")
    _bad(root, path, text)
    before = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("weft install: ") and words in err and "nothing was changed" in err
    assert snapshot(root) == before


@pytest.mark.parametrize(("missing", "says"), [
    ("etc/containerd/config.toml", "/etc/containerd/config.toml: not found"),
    ("var/lib/kubelet", "not found"),
    ("usr/bin/containerd", "run/containerd/containerd.sock: cannot tell which containerd this node runs "
                           "(nothing answers CRI Version there and no /usr/bin/containerd"),
])
def test_a_host_without_containerd_or_kubelet_config_is_refused(
        missing: str, says: str, tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    target = root / missing
    target.unlink() if target.is_file() else __import__("shutil").rmtree(target)
    before = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source)]) == 2
    err = capsys.readouterr().err
    assert says in err and "nothing was changed" in err
    assert snapshot(root) == before


def test_weft_files_installed_by_hand_are_not_overwritten(
        tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    _bad(root, "/etc/systemd/system/weft-agent.service", "[Service]\nExecStart=/usr/local/bin/weft agent\n")
    before = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source)]) == 2
    assert "weft-agent.service: exists, but no weft install journal does" in capsys.readouterr().err
    assert snapshot(root) == before


def test_a_failed_step_undoes_the_steps_before_it(
        tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """containerd does not restart: the units, drop-in and /opt/weft written before are removed again."""
    root = copy_shape("kubeadm", tmp_path / "host")
    log = tmp_path / "systemctl.log"
    systemctl = tmp_path / "systemctl"
    systemctl.write_text(f'#!/bin/sh\necho "$*" >> {log}\n'
                         'if [ "$*" = "restart containerd.service" ]; then echo "Job failed" >&2; exit 1; fi\n')
    systemctl.chmod(0o755)
    before = snapshot(root)
    rc = main(["install", "--root", str(root), "--source", str(source), "--systemctl", str(systemctl)])
    err = capsys.readouterr().err
    assert rc == 2 and "containerd-restart failed" in err and "Job failed" in err and "rolled back" in err
    assert snapshot(root) == before
    assert log.read_text().splitlines() == [
        "daemon-reload", "restart containerd.service",  # the failed step
        "daemon-reload", "restart containerd.service",  # rollback: units gone, containerd on its own config
    ]


def test_the_copied_weft_runs_on_its_own(tmp_path: Path) -> None:
    """The default bundle: the running Python, its stdlib, weft and its dependencies under /opt/weft."""
    root = copy_shape("kubeadm", tmp_path / "host")
    assert main(["install", "--root", str(root)]) == 0
    weft = root / "opt/weft/bin/weft"
    out = subprocess.run([str(weft), "--version"], capture_output=True, text=True, check=True, env={"PATH": "/bin"})
    assert out.stdout.strip() == "weft 0.1.0"
    opt = str(root / "opt/weft")
    check = bundle.check_argv(opt)
    where = subprocess.run([*check[:-1], check[-1] + "; import yaml, shim; print(sys.prefix); print(shim.__file__)"
                            "; print(sqlite3.__file__); print(sys.path)"],
                           capture_output=True, text=True, check=True, env={}).stdout.split("\n")
    assert all(w.startswith(opt) for w in where[:3]), where
    assert all(p.startswith(opt) for p in eval(where[3])), where  # nothing of this machine's Python is searched
    # The libraries a minimal node lacks travel with the copy (the C library's own never do).
    carried = {p.name for p in (root / "opt/weft/lib").iterdir() if ".so" in p.name}
    assert {"libsqlite3.so.0", "libssl.so.3", "libffi.so.8"} <= carried, carried
    assert not carried & {"libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2"}
    # A process weft starts gets the host's library path back, not the copy's: what the entry leaves in its
    # environment before weft's command line runs.
    prelude = (root / "opt/weft/lib/weft-main.py").read_text().split("from shim.cli")[0]
    for host_env, left in (({"LD_LIBRARY_PATH": "/host/lib"}, "/host/lib"), ({}, "None")):
        launched = {"LD_LIBRARY_PATH": opt + "/lib"}  # as bin/weft starts it
        if host_env:
            launched["WEFT_HOST_LD_LIBRARY_PATH"] = host_env["LD_LIBRARY_PATH"]
        shown = subprocess.run(
            [str(weft.with_name("python3")), "-I", "-c",
             f"__file__ = {str(root / 'opt/weft/lib/weft-main.py')!r}\n" + prelude
             + "print(os.environ.get('LD_LIBRARY_PATH'))"],
            capture_output=True, text=True, env=launched)
        assert shown.stdout.strip() == left, shown.stderr
    hook = subprocess.run([str(weft.with_name("weft-oci-hook")), "createRuntime"], input='{"annotations": {}}',
                          capture_output=True, text=True, env={"PATH": "/bin"})
    assert hook.returncode == 0, hook.stderr
    assert sys.executable  # the test ran the copy, not this interpreter


# -- the mesh settings (the DaemonSet's WEFT_* environment, as flags) ----------------------------------------
@pytest.fixture
def mesh_tls(tmp_path: Path) -> Path:
    """A --tls-source directory, as `weft mesh-certs` writes it (its own CA: nothing is verified here)."""
    tls = tmp_path / "secret"
    tls.mkdir()
    for name, data in (("ca.crt", b"CA"), ("cpu-7.crt", b"CERT cpu-7"), ("cpu-7.key", b"KEY cpu-7"),
                       ("gpu-1.key", b"KEY gpu-1")):
        (tls / name).write_bytes(data)
    return tls


def _mesh_flags(tls: Path, *extra: str) -> list[str]:
    return ["--node-name", "cpu-7", "--mesh-address", "10.0.0.7:7443", "--tls-source", str(tls), *extra]


@pytest.mark.parametrize("shape", SHAPES)
def test_mesh_settings_give_the_agent_its_config_and_only_this_nodes_keys_and_uninstall_removes_them(
        shape: str, tmp_path: Path, source: Path, mesh_tls: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shim import config

    root = copy_shape(shape, tmp_path / "host")
    before = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls)]) == 0
    unit = (root / "etc/systemd/system/weft-agent.service").read_text()
    assert " --config /etc/weft/weft.toml" in unit.split("ExecStart=")[1].splitlines()[0]
    mesh_dir = root / "etc/weft/mesh"
    assert sorted(p.name for p in mesh_dir.iterdir()) == ["ca.crt", "cpu-7.crt", "cpu-7.key"]  # not gpu-1's key
    assert (mesh_dir / "cpu-7.key").read_bytes() == b"KEY cpu-7"
    assert (mesh_dir / "cpu-7.key").stat().st_mode & 0o777 == 0o600
    assert (mesh_dir / "ca.crt").stat().st_mode & 0o777 == 0o644
    cfg = config.load(root / "etc/weft/weft.toml")
    assert (cfg.mesh.node_name, cfg.mesh.role, cfg.mesh.address, cfg.mesh.peers, cfg.mesh.tls_dir) == (
        "cpu-7", "cpu", "10.0.0.7:7443", "kubernetes", "/etc/weft/mesh")

    installed = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls)]) == 0
    assert "nothing changed" in capsys.readouterr().out and snapshot(root) == installed
    # A key whose mode was loosened by hand is tightened again by a re-install.
    (mesh_dir / "cpu-7.key").chmod(0o644)
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls)]) == 0
    assert (mesh_dir / "cpu-7.key").stat().st_mode & 0o777 == 0o600

    assert main(["uninstall", "--root", str(root)]) == 0
    assert snapshot(root) == before


def test_tls_on_host_checks_the_files_the_node_keeps_and_never_writes_or_removes_them(
        tmp_path: Path, source: Path, mesh_tls: Path) -> None:
    """The DaemonSet's way: weft mesh-identity made the key in the host's /etc/weft/mesh before the installer."""
    from shim import config

    root = copy_shape(SHAPES[0], tmp_path / "host")
    flags = ["--node-name", "cpu-7", "--mesh-address", "10.0.0.7:7443", "--tls-on-host"]
    before = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source), *flags]) == 2  # nothing there yet
    assert snapshot(root) == before
    mesh_dir = root / "etc/weft/mesh"
    mesh_dir.mkdir(parents=True)
    for name in ("ca.crt", "cpu-7.crt", "cpu-7.key"):
        (mesh_dir / name).write_bytes((mesh_tls / name).read_bytes())
    (mesh_dir / "cpu-7.key").chmod(0o600)
    kept = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in mesh_dir.iterdir()}
    with_identity = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source), *flags]) == 0
    assert config.load(root / "etc/weft/weft.toml").mesh.tls_dir == "/etc/weft/mesh"
    assert main(["uninstall", "--root", str(root)]) == 0
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in mesh_dir.iterdir()} == kept
    assert snapshot(root) == with_identity  # weft.toml gone too, though /etc/weft was not weft's to remove


def test_uninstall_purge_also_removes_what_the_daemonset_kept_on_the_host(
        tmp_path: Path, source: Path, mesh_tls: Path) -> None:
    """The cluster's back-out: the node's mesh identity and the agent's API credentials go too."""
    root = copy_shape("kubeadm", tmp_path / "host")
    before = snapshot(root)
    for d, names in (("etc/weft/mesh", ("ca.crt", "cpu-7.crt", "cpu-7.key")), ("etc/weft/api", ("kubeconfig",))):
        (root / d).mkdir(parents=True)
        for name in names:
            (root / d / name).write_bytes((mesh_tls / name).read_bytes() if d.endswith("mesh") else b"k")
    flags = ["--node-name", "cpu-7", "--mesh-address", "10.0.0.7:7443", "--tls-on-host", "--source", str(source)]
    assert main(["install", "--root", str(root), *flags]) == 0
    assert main(["uninstall", "--root", str(root)]) == 0
    assert (root / "etc/weft/mesh/cpu-7.key").exists()  # without --purge, the identity stays
    assert main(["uninstall", "--root", str(root), "--purge"]) == 0  # nothing installed: still purges
    assert snapshot(root) == before
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    assert main(["uninstall", "--root", str(root), "--purge"]) == 0
    assert snapshot(root) == before


def test_a_rolled_back_install_beside_the_nodes_mesh_identity_leaves_nothing_so_a_retry_starts_clean(
        tmp_path: Path, source: Path, mesh_tls: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """/etc/weft exists before the install (the DaemonSet's mesh-identity made /etc/weft/mesh): a rollback removes
    the files weft added there, or every later try would be refused as a hand-made install."""
    root = copy_shape("kubeadm", tmp_path / "host")
    mesh_dir = root / "etc/weft/mesh"
    mesh_dir.mkdir(parents=True)
    for name in ("ca.crt", "cpu-7.crt", "cpu-7.key"):
        (mesh_dir / name).write_bytes((mesh_tls / name).read_bytes())
    before = snapshot(root)
    flags = ["--node-name", "cpu-7", "--mesh-address", "10.0.0.7:7443", "--tls-on-host", "--source", str(source)]
    failing, working = tmp_path / "failing", tmp_path / "working"
    failing.write_text('#!/bin/sh\n[ "$*" = "restart containerd.service" ] && { echo "Job failed" >&2; exit 1; }\n'
                       "exit 0\n")
    working.write_text("#!/bin/sh\nexit 0\n")
    for prog in (failing, working):
        prog.chmod(0o755)
    assert main(["install", "--root", str(root), "--systemctl", str(failing), *flags]) == 2
    assert "rolled back" in capsys.readouterr().err
    assert snapshot(root) == before
    # The retry is not refused up front: it goes as far as its own systemctl lets it (no agent answers here).
    assert main(["install", "--root", str(root), "--systemctl", str(working), "--agent-timeout", "0.1",
                 "--agent-socket", str(tmp_path / "none.sock"), *flags]) == 2
    err = capsys.readouterr().err
    assert "agent-verify failed" in err and "exists, but no weft install journal does" not in err, err
    assert snapshot(root) == before


def test_mesh_flags_default_to_the_daemonsets_environment_and_a_static_peers_file_is_copied(
        tmp_path: Path, source: Path, mesh_tls: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shim import config

    peers = tmp_path / "peers.toml"
    peers.write_text('[[peer]]\nname = "gpu-1"\naddress = "10.0.0.1:7443"\nrole = "gpu"\n')
    for k, v in {"WEFT_NODE_NAME": "cpu-7", "WEFT_MESH_ADDRESS": "10.0.0.7:7443", "WEFT_PEERS": str(peers),
                 "WEFT_TLS_SOURCE": str(mesh_tls), "WEFT_ROLE": "both"}.items():
        monkeypatch.setenv(k, v)
    root = copy_shape(SHAPES[0], tmp_path / "host")
    before = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    cfg = config.load(root / "etc/weft/weft.toml")
    assert (cfg.mesh.node_name, cfg.mesh.role, cfg.mesh.peers) == ("cpu-7", "both", "/etc/weft/peers.toml")
    assert (root / "etc/weft/peers.toml").read_bytes() == peers.read_bytes()
    assert main(["uninstall", "--root", str(root)]) == 0
    assert snapshot(root) == before


# The pause image each shape's containerd names (tests/data/hostroots), or None where it names none.
SANDBOX = {"ctrd2-default": "registry.k8s.io/pause:3.10.2", "ctrd2-gpu-confd": "registry.k8s.io/pause:3.10.2",
           "ctrd2-kubeadm": "registry.k8s.io/pause:3.10.2",
           "ctrd2-eks": "602401143452.dkr.ecr.us-west-2.amazonaws.com/eks/pause:3.10",
           "ctrd2-v2config": "registry.k8s.io/pause:3.6", "kubeadm-flags": "registry.k8s.io/pause:3.6",
           "kubeadm": "registry.k8s.io/pause:3.6",
           # containerd 1.x: the drop-in's CRI section replaces the main file's, which names pause:3.8.
           "imports": "registry.k8s.io/pause:3.9"}


@pytest.mark.parametrize("shape", SHAPES)
def test_reservation_pods_run_the_pause_image_the_nodes_containerd_runs_sandboxes_from(
        shape: str, tmp_path: Path, source: Path, mesh_tls: Path) -> None:
    """A node pulls its own pause image from wherever its containerd says (a mirror, ECR): a reservation pod
    bound to it must need no other image."""
    from shim import config

    root = copy_shape(shape, tmp_path / "host")
    text = (root / "etc/containerd/config.toml").read_text()
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls)]) == 0
    image = config.load(root / "etc/weft/weft.toml").kubernetes.reservation_image
    if shape in SANDBOX:
        assert image == SANDBOX[shape]
    else:
        assert "sandbox" not in text
        assert image == config.KubernetesConfig().reservation_image  # containerd's default, weft's default


def _in_the_daemonset(monkeypatch: pytest.MonkeyPatch, labels: dict[str, str], problem: str | None = None) -> None:
    from shim.kube import nodes

    monkeypatch.setenv("WEFT_POD_NAME", "weft-abcde")
    monkeypatch.setattr(nodes, "labels", lambda name: ({} if problem else labels, problem) if name == "cpu-7"
                        else ({}, f"not this node: {name}"))


def test_a_nodes_broker_label_gives_it_that_broker_and_the_gpu_role(
        tmp_path: Path, source: Path, mesh_tls: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from shim import config

    _in_the_daemonset(monkeypatch, {"weft.io/broker": "simulated", "weft.io/simulated-devices": "1x80Gi_1x40Gi"})
    root = copy_shape(SHAPES[0], tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls)]) == 0
    unit = (root / "etc/systemd/system/weft-broker.service").read_text()
    assert "--backend simulated --simulated-devices 1x80Gi,1x40Gi" in unit
    assert config.load(root / "etc/weft/weft.toml").mesh.role == "gpu"
    assert "broker simulated, as the node's label weft.io/broker says" in capsys.readouterr().out


def test_a_node_sharing_its_machine_advertises_the_capacity_its_label_gives_instead_of_measuring(
        tmp_path: Path, source: Path, mesh_tls: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shim import config

    _in_the_daemonset(monkeypatch, {"weft.io/fixed-capacity": "1_2Gi"})
    root = copy_shape(SHAPES[0], tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls)]) == 0
    assert config.load(root / "etc/weft/weft.toml").mesh.fixed_capacity == "1,2Gi"


def test_without_a_broker_label_or_an_nvidia_device_a_node_has_no_broker_and_a_label_it_cannot_read_is_said(
        tmp_path: Path, source: Path, mesh_tls: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from shim import config

    _in_the_daemonset(monkeypatch, {}, problem="connection refused")
    root = copy_shape(SHAPES[0], tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls)]) == 0
    assert not (root / "etc/systemd/system/weft-broker.service").exists()
    assert config.load(root / "etc/weft/weft.toml").mesh.role == "cpu"
    assert "node cpu-7's labels could not be read (connection refused); the host alone decides" in \
        capsys.readouterr().out


@pytest.mark.parametrize(("labels", "said"), [
    ({"weft.io/broker": "cuda"}, "node label weft.io/broker='cuda' is not one of nvml, simulated, none"),
    ({"weft.io/broker": "simulated", "weft.io/simulated-devices": "2x80GB"},
     "node label weft.io/simulated-devices: --simulated-devices: '2x80GB' is not COUNTxSIZE"),
    ({"weft.io/fixed-capacity": "two_2Gi"}, "node label weft.io/fixed-capacity='two_2Gi': mesh.fixed_capacity: "
                                            "'two,2Gi' is not CORES,MEMORY"),
])
def test_a_broker_label_weft_cannot_use_is_refused_before_anything_changes(
        labels: dict[str, str], said: str, tmp_path: Path, source: Path, mesh_tls: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _in_the_daemonset(monkeypatch, labels)
    root = copy_shape(SHAPES[0], tmp_path / "host")
    before = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls)]) == 2
    err = capsys.readouterr().err
    assert said in err and "nothing was changed" in err
    assert snapshot(root) == before


@pytest.mark.parametrize(("labels", "role", "said"), [
    ({"nvidia.com/gpu.present": "true"}, "gpu", "mesh role gpu, as the node's labels match --gpu-nodes "
                                                "'nvidia.com/gpu.present=true,!drained,zone!=lab'"),
    ({"pool": "batch"}, "cpu", "mesh role cpu, as the node's labels match --cpu-nodes 'pool=batch'"),
    ({"nvidia.com/gpu.present": "true", "pool": "batch"}, "both", "mesh role both, as the node's labels match "
                                                                  "--gpu-nodes 'nvidia.com/gpu.present=true,"
                                                                  "!drained,zone!=lab' and --cpu-nodes"),
    # Neither matches (a label the GPU selector must not see, one it must not hold): the host decides, and
    # without a broker here that is cpu.
    ({"nvidia.com/gpu.present": "true", "drained": ""}, "cpu", None),
    ({"nvidia.com/gpu.present": "true", "zone": "lab"}, "cpu", None),
    ({"pool": "gpu"}, "cpu", None),
])
def test_the_charts_node_selectors_give_a_node_its_mesh_role(
        labels: dict[str, str], role: str, said: str | None, tmp_path: Path, source: Path, mesh_tls: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from shim import config

    _in_the_daemonset(monkeypatch, labels)
    monkeypatch.setenv("WEFT_GPU_NODES", "nvidia.com/gpu.present=true,!drained,zone!=lab")
    monkeypatch.setenv("WEFT_CPU_NODES", "pool=batch")
    root = copy_shape(SHAPES[0], tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls)]) == 0
    assert config.load(root / "etc/weft/weft.toml").mesh.role == role
    out = capsys.readouterr().out
    assert (said in out) if said else "mesh role" not in out, out


@pytest.mark.parametrize(("selector", "said"), [
    ("pool in (a,b)", "set-based terms ('pool in (a' ) are not supported"),
    ("pool=a,,x", "'' is not a label key"),
    ("bad key=1", "'bad key' is not a label key"),
])
def test_a_node_selector_weft_cannot_read_is_refused_before_anything_changes(
        selector: str, said: str, tmp_path: Path, source: Path, mesh_tls: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _in_the_daemonset(monkeypatch, {"pool": "a"})
    root = copy_shape(SHAPES[0], tmp_path / "host")
    before = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source),
                 *_mesh_flags(mesh_tls, "--role", "cpu", "--cpu-nodes", selector)]) == 2
    err = capsys.readouterr().err
    assert f"--cpu-nodes {selector!r}: " in err and said.replace("' )", "')") in err and "nothing was changed" in err
    assert snapshot(root) == before


def test_a_daemonset_in_another_namespace_points_the_agent_at_its_own(
        tmp_path: Path, source: Path, mesh_tls: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shim import config

    root = copy_shape(SHAPES[0], tmp_path / "host")
    monkeypatch.setenv("WEFT_POD_NAMESPACE", "gpu-platform")
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls)]) == 0
    cfg = config.load(root / "etc/weft/weft.toml")
    assert (cfg.mesh.namespace, cfg.kubernetes.namespace) == ("gpu-platform", "gpu-platform")
    monkeypatch.setenv("WEFT_POD_NAMESPACE", "weft-system")  # the default: nothing written
    root = copy_shape(SHAPES[0], tmp_path / "host2")
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls)]) == 0
    assert "namespace" not in (root / "etc/weft/weft.toml").read_text()


def test_without_a_mesh_address_no_mesh_files_are_written(tmp_path: Path, source: Path) -> None:
    root = copy_shape(SHAPES[0], tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    assert not (root / "etc/weft").exists()
    assert "--config" not in (root / "etc/systemd/system/weft-agent.service").read_text()


@pytest.mark.parametrize(("flags", "says"), [
    pytest.param(["--node-name", "cpu-8"], "cpu-8.crt", id="no-certificate-for-this-node"),
    pytest.param(["--node-name", "../etc"], "not a Kubernetes node name", id="node-name-is-not-a-path"),
    pytest.param(["--mesh-address", "10.0.0.7"], "expected HOST:PORT", id="address-without-port"),
    pytest.param(["--peers", "/nonexistent/peers.toml"], "static peers file", id="missing-peers-file"),
])
def test_bad_mesh_settings_are_refused_before_anything_changes(
        flags: list[str], says: str, tmp_path: Path, source: Path, mesh_tls: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_shape(SHAPES[0], tmp_path / "host")
    before = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source), *_mesh_flags(mesh_tls), *flags]) == 2
    assert says in capsys.readouterr().err
    assert snapshot(root) == before


# -- CDI spec directories: where the agent reads a DRA claim's GPUs ------------------------------------------------
def _set_cdi_spec_dirs(root: Path, value: str) -> None:
    """Set the CRI runtime section's ``cdi_spec_dirs`` in the main config, replacing the host's line if it has one."""
    path = root / "etc/containerd/config.toml"
    lines = path.read_text().splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines) if line.strip().startswith("cdi_spec_dirs")), None)
    if at is not None:
        lines[at] = f"{lines[at][:len(lines[at]) - len(lines[at].lstrip())]}cdi_spec_dirs = {value}\n"
    else:
        header = next(i for i, line in enumerate(lines) if line.strip() in (
            '[plugins."io.containerd.grpc.v1.cri"]', "[plugins.'io.containerd.cri.v1.runtime']"))
        lines.insert(header + 1, f"cdi_spec_dirs = {value}\n")
    path.write_text("".join(lines))


def _agent_argv(root: Path) -> str:
    return (root / "etc/systemd/system/weft-agent.service").read_text().split("ExecStart=")[1].splitlines()[0]


@pytest.mark.parametrize("shape", ["kubeadm", "ctrd2-kubeadm", "ctrd2-v2config"],
                         ids=["1.x-version-2", "2.x-version-4", "2.x-migrating-version-2"])
def test_containerds_own_cdi_spec_dirs_are_passed_to_the_agent(shape: str, tmp_path: Path, source: Path) -> None:
    root = copy_shape(shape, tmp_path / "host")
    _set_cdi_spec_dirs(root, '["/opt/cdi", "/run/cdi"]')
    before = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    assert _agent_argv(root).endswith(" --cdi-spec-dirs /opt/cdi:/run/cdi")
    assert main(["uninstall", "--root", str(root)]) == 0
    assert snapshot(root) == before


@pytest.mark.parametrize("shape", ["ctrd2-default", "kubeadm"], ids=["default-written-out", "default-left-implicit"])
def test_containerds_default_cdi_spec_dirs_need_no_flag(shape: str, tmp_path: Path, source: Path) -> None:
    root = copy_shape(shape, tmp_path / "host")
    assert main(["install", "--root", str(root), "--source", str(source)]) == 0
    assert "--cdi-spec-dirs" not in _agent_argv(root)


def test_cdi_spec_dirs_the_agent_could_not_be_given_are_refused_before_anything_changes(
        tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = copy_shape("ctrd2-kubeadm", tmp_path / "host")
    _set_cdi_spec_dirs(root, '["relative/cdi"]')
    before = snapshot(root)
    assert main(["install", "--root", str(root), "--source", str(source)]) != 0
    assert "cdi_spec_dirs" in capsys.readouterr().err
    assert snapshot(root) == before
