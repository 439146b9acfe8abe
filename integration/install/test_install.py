"""``weft install``/``uninstall`` against real processes: containerd loading the drop-in, a real agent verified
before kubelet is switched, a real health endpoint standing in for kubelet, and ``kill -9`` at every step.

Each containerd line the tests run (Debian's 1.6, and 1.7 and 2.x built from Go modules into the harness's
cache, ``shim.localfabric.containerd.bin_dir``) runs the drop-in for real, and reads every shape of host root in
``tests/data/hostroots`` with its own ``containerd config dump``: the installer's model of how that line merges
imports is checked against the line itself. A line whose build is missing fails the test with the build's
message; nothing is skipped.

kubelet and systemd are the two things a test machine cannot offer for real: systemctl is a small program that
records its calls (``--systemctl``), and kubelet's ``/healthz`` is an HTTP server in the test that answers from
the host root's kubelet files, so "kubelet on the agent is unhealthy" is a real answer on a real port.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.install import containerd as ctrd_config
from shim.install.host import Host
from shim.install.run import INSTALL_STEPS, UNINSTALL_STEPS
from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.containerd import LINES, RELEASE_LINES, Containerd, bin_dir
from tests.install.conftest import SHAPES_1X, SHAPES_2X, copy_shape, snapshot
from tests.install.test_containerd import MERGED

REPO = Path(__file__).resolve().parents[2]


class Health:
    """kubelet's /healthz: 200 while ``check()`` holds."""

    def __init__(self) -> None:
        self.check: Callable[[], bool] = lambda: True
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200 if outer.check() else 500)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/healthz"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def health() -> Iterator[Health]:
    h = Health()
    yield h
    h.close()


@pytest.fixture(scope="module")
def module_agent(containerd_session: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    with AgentProcess(containerd_session, tmp_path_factory.mktemp("install-agent")) as a:
        yield a


def _systemctl(tmp: Path) -> tuple[Path, Path]:
    log, prog = tmp / "systemctl.log", tmp / "systemctl"
    prog.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    prog.chmod(0o755)
    return prog, log


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _weft(cmd: str, root: Path, *args: str, failpoint: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WEFT_FAILPOINTS": failpoint}
    return subprocess.run([sys.executable, "-m", "shim", cmd, "--root", str(root), *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def _source(tmp: Path) -> Path:
    src = tmp / "weft-src"
    (src / "bin").mkdir(parents=True, exist_ok=True)
    (src / "bin" / "weft").write_text("#!/bin/sh\necho weft\n")
    return src


def _kubelet_on_agent(root: Path) -> bool:
    return "weft/cri.sock" in (root / "var/lib/kubelet/config.yaml").read_text()


def _containerd_binary(line: str) -> Path:
    """The line's containerd, from the harness's build cache (built now if it is not there: minutes)."""
    found = bin_dir(line)
    binary = found / "containerd" if found is not None else shutil.which("containerd")
    assert binary is not None, "Debian's containerd is not on PATH: run scripts/setup.sh"
    return Path(binary)


@pytest.fixture(params=LINES)
def line_containerd(request: pytest.FixtureRequest) -> Iterator[Containerd]:
    """A fresh harness containerd of each line (its config: version 2 on 1.x, 3 on 2.x)."""
    with Containerd(line=request.param) as c:
        yield c


def test_real_containerd_loads_the_dropin_and_uninstall_with_weft_pods_puts_kubelet_back_on_containerd(
        line_containerd: Containerd, tmp_path: Path, health: Health) -> None:
    ctrd = line_containerd
    root = tmp_path / "host"
    (root / "etc/containerd").mkdir(parents=True)
    shutil.copy(ctrd.workdir / "config.toml", root / "etc/containerd/config.toml")  # type: ignore[operator]
    (root / "var/lib/kubelet").mkdir(parents=True)
    (root / "var/lib/kubelet/config.yaml").write_text(
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"
        f"containerRuntimeEndpoint: unix://{ctrd.socket}\n")
    before = snapshot(root)
    systemctl, log = _systemctl(tmp_path)
    # The installer asks this containerd its version over CRI (the root has no binary to ask).
    flags = ["--systemctl", str(systemctl), "--kubelet-health-url", health.url, "--containerd-socket", str(ctrd.socket)]
    with AgentProcess(ctrd, tmp_path / "agent") as agent:
        res = _weft("install", root, *flags, "--agent-socket", str(agent.socket))
        assert res.returncode == 0, res.stderr
        assert f"the weft agent answers CRI on {agent.socket} (containerd" in res.stdout
        dropin = tomllib.loads((root / "etc/containerd/weft/runtime.toml").read_text())
        if ctrd.line == "2":  # 2.x merges table by table: the weft runtime alone, in the harness's version 3
            assert dropin["version"] == 3 and list(dropin["plugins"]) == [ctrd_config.CRI_RUNTIME]
        else:  # 1.x replaces sections: the host's whole CRI section comes along
            assert dropin["version"] == 2 and dropin["plugins"][ctrd_config.CRI]["sandbox_image"].endswith(":weft-test")
        assert _calls(log) == ["daemon-reload", "restart containerd.service", "enable weft-agent.service",
                               "restart weft-agent.service", "restart kubelet.service"]

        # This containerd reads its files from the real /, the installer wrote under the root: give it the
        # root's files with the root's prefix on the host paths they name, then restart it (the test's
        # "systemctl restart containerd").
        def rooted(text: str) -> str:
            for host_path in ("/etc/containerd/weft/", "/opt/weft/"):
                text = text.replace(f'"{host_path}', f'"{root}{host_path}')
            return text
        for rel in ("etc/containerd/weft/runtime.toml", "etc/containerd/weft/base-spec.json"):
            (root / rel).write_text(rooted((root / rel).read_text()))
        (ctrd.workdir / "config.toml").write_text(rooted((root / "etc/containerd/config.toml").read_text()))
        ctrd.restart()

        with agent.channel() as ch:
            rt = cri_grpc.RuntimeServiceStub(ch)
            cfg = json.loads(rt.Status(cri.StatusRequest(verbose=True)).info["config"])
            runtimes = cfg["containerd"]["runtimes"]
            assert runtimes["weft"]["baseRuntimeSpec"] == f"{root}/etc/containerd/weft/base-spec.json"
            assert runtimes["weft"]["PodAnnotations"] == runtimes["weft"]["ContainerAnnotations"] == ["weft.io/*"]
            assert runtimes["runc"]["options"]["Root"] == str(ctrd.runc_root), "the host's CRI section is kept"
            assert runtimes["weft"]["options"] == runtimes["runc"]["options"], "the same runc, the same cgroups"
            assert cfg["restrictOOMScoreAdj"] is True
            if ctrd.line != "2":  # 2.x's image service keeps the sandbox image: the pod below runs on it, offline
                assert cfg["sandboxImage"].endswith(":weft-test")

            # A pod on the weft handler runs with the copied weft's OCI hook (runc fails it if the hook fails).
            sb_cfg = pods.sandbox_config("weft-pod", ctrd.pod_log_dir, cgroup_parent=ctrd.cgroup_root)
            sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb_cfg, runtime_handler="weft")).pod_sandbox_id
            cid = rt.CreateContainer(cri.CreateContainerRequest(
                pod_sandbox_id=sb, config=pods.container_config("main", ["sleep", "3600"]),
                sandbox_config=sb_cfg)).container_id
            rt.StartContainer(cri.StartContainerRequest(container_id=cid))
            assert rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.state == \
                cri.CONTAINER_RUNNING

        log.unlink()
        res = _weft("uninstall", root, *flags, "--agent-socket", str(agent.socket))
        assert res.returncode == 0, res.stderr
        assert "1 pod(s) run on the 'weft' runtime handler: default/weft-pod. They keep running" in res.stdout
        calls = _calls(log)
        assert calls.index("restart kubelet.service") < calls.index(
            "disable --now weft-broker.service weft-agent.service"), "kubelet leaves the agent before it stops"
    assert snapshot(root) == before
    endpoint = yaml.safe_load((root / "var/lib/kubelet/config.yaml").read_text())["containerRuntimeEndpoint"]
    with grpc.insecure_channel(endpoint) as ch:  # kubelet's endpoint is containerd, alive
        assert cri_grpc.RuntimeServiceStub(ch).Version(cri.VersionRequest(), timeout=5).runtime_name == "containerd"


# -- each line's own merge of each shape of host -----------------------------------------------------------------
def _dump(binary: Path, root: Path, tmp: Path) -> dict:
    """The configuration ``binary`` makes of the root's files (``containerd config dump``), less ``imports``.

    The files name host paths; containerd reads the real /, so the imports are pointed under the root in a copy
    of the main file kept outside it.
    """
    main = root / "etc/containerd/config.toml"
    text, doc = main.read_text(), tomllib.loads(main.read_text())
    rooted = [f"{root}{p}" if p.startswith("/") else str(main.parent / p) for p in doc.get("imports", [])]
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "config.toml"
    config.write_text(re.sub(r"(?m)^imports[ \t]*=.*$", lambda _: f"imports = {json.dumps(rooted)}", text))
    assert tomllib.loads(config.read_text()) == ({**doc, "imports": rooted} if "imports" in doc else doc)
    res = subprocess.run([str(binary), "--config", str(config), "config", "dump"], capture_output=True, text=True,
                         timeout=120, cwd=tmp)
    assert res.returncode == 0, res.stderr
    out = tomllib.loads(res.stdout)
    out.pop("imports", None)
    return out


def _merged_root(tmp: Path) -> Path:
    """The unit tests' three-file version 3 host (tests/install/test_containerd.MERGED) on a kubeadm node."""
    root = copy_shape("ctrd2-kubeadm", tmp)
    for p in (root / "etc/containerd").iterdir():
        p.unlink()
    for path, text in MERGED.items():
        (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / path.lstrip("/")).write_text(text)
    return root


CASES = [*[(line, s) for line in ("1.6", "1.7") for s in SHAPES_1X], *[("2", s) for s in [*SHAPES_2X, "merged"]]]


@pytest.mark.parametrize(("line", "shape"), CASES, ids=[f"{line}-{shape}" for line, shape in CASES])
def test_each_lines_own_config_dump_has_the_weft_runtime_and_every_host_setting_as_before(
        line: str, shape: str, tmp_path: Path) -> None:
    binary = _containerd_binary(line)
    root = _merged_root(tmp_path / "host") if shape == "merged" else copy_shape(shape, tmp_path / "host")
    # The root's containerd is this line's: the installer asks it `--version`, as on a node where none runs.
    (root / "usr/bin/containerd").write_text(f'#!/bin/sh\nexec {binary} "$@"\n')
    before_files = snapshot(root)
    before = _dump(binary, root, tmp_path / "before")

    # The pause image the installer gives reservation pods is the one this containerd runs sandboxes from.
    ours = ctrd_config.plan(Host(root), ["/hook"], "/broker.sock", ctrd_config.Containerd(
        "test", *((2, 4) if line == "2" else (1, int(line[2:]))), "test")).sandbox_image
    theirs = (before["plugins"][ctrd_config.CRI_IMAGES]["pinned_images"]["sandbox"] if line == "2"
              else before["plugins"][ctrd_config.CRI]["sandbox_image"])
    assert ours in (None, theirs)
    # An agent started by hand reads the same where the running containerd's Status does not say it (2.x).
    running = ctrd_config.running_sandbox_image(Host(root), ctrd_config.Containerd.parse(subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60).stdout, "test"))
    assert running == theirs if line == "2" else running in (None, theirs)

    res = _weft("install", root, "--source", str(_source(tmp_path)))
    assert res.returncode == 0, res.stderr
    after = _dump(binary, root, tmp_path / "after")
    section = ctrd_config.CRI_RUNTIME if line == "2" else ctrd_config.CRI
    ctr = after["plugins"][section]["containerd"]
    weft = ctr["runtimes"].pop("weft")
    assert after == before, "the host's own settings (sandbox image, CNI, registry, runtimes and options) are kept"
    default = ctr["runtimes"][ctr["default_runtime_name"]]
    ours = {"base_runtime_spec": ctrd_config.BASE_SPEC, "runtime_type": ctrd_config.RUNC_V2,
            "pod_annotations": [*default["pod_annotations"], "weft.io/*"],
            "container_annotations": [*default["container_annotations"], "weft.io/*"]}
    assert weft == {**default, **ours}, "the default runtime with weft's spec and annotations (options: cgroups)"

    assert _weft("uninstall", root).returncode == 0
    assert snapshot(root) == before_files


def test_kubelet_unhealthy_on_the_agent_rolls_everything_back(
        module_agent: AgentProcess, tmp_path: Path, health: Health) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    health.check = lambda: not _kubelet_on_agent(root)
    before = snapshot(root)
    systemctl, log = _systemctl(tmp_path)
    res = _weft("install", root, "--systemctl", str(systemctl), "--kubelet-health-url", health.url,
                "--kubelet-timeout", "2", "--agent-socket", str(module_agent.socket),
                "--source", str(_source(tmp_path)))
    assert res.returncode == 2
    assert "weft install: kubelet-health failed: kubelet did not come back healthy" in res.stderr
    assert "rolled back" in res.stderr
    assert snapshot(root) == before
    calls = _calls(log)  # after the switch: back on containerd first, then the agent stops
    assert calls.count("restart kubelet.service") == 2
    assert calls[calls.index("restart kubelet.service") + 1:] == [
        "restart kubelet.service", "disable --now weft-broker.service weft-agent.service", "daemon-reload",
        "restart containerd.service"]


def test_an_agent_that_does_not_answer_cri_never_gets_kubelet(tmp_path: Path, health: Health) -> None:
    root = copy_shape("kubeadm-flags", tmp_path / "host")
    before = snapshot(root)
    systemctl, log = _systemctl(tmp_path)
    res = _weft("install", root, "--systemctl", str(systemctl), "--kubelet-health-url", health.url,
                "--agent-socket", str(tmp_path / "no-agent.sock"), "--agent-timeout", "1",
                "--source", str(_source(tmp_path)))
    assert res.returncode == 2
    assert f"agent-verify failed: the weft agent does not answer CRI on {tmp_path / 'no-agent.sock'}" in res.stderr
    assert snapshot(root) == before
    assert "restart kubelet.service" not in _calls(log)


@pytest.fixture(scope="module")
def mesh_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --tls-source directory, as `weft mesh-certs` writes it (static clusters)."""
    out = tmp_path_factory.mktemp("mesh-tls")
    subprocess.run([sys.executable, "-m", "shim", "mesh-certs", "--out", str(out), "--nodes", "cpu-7,gpu-1"],
                   check=True, capture_output=True, cwd=REPO)
    (out / "ca.key").unlink()  # never in the Secret
    return out


def _mesh(certs: Path) -> list[str]:
    return ["--node-name", "cpu-7", "--mesh-address", "127.0.0.1:0", "--tls-source", str(certs)]


def test_the_installed_mesh_config_and_keys_start_a_meshed_agent(
        containerd_session: Containerd, mesh_certs: Path, tmp_path: Path) -> None:
    root = copy_shape("kubeadm", tmp_path / "host")
    peers = tmp_path / "peers.toml"
    peers.write_text('[[peer]]\nname = "gpu-1"\naddress = "127.0.0.1:1"\nrole = "gpu"\n')
    res = _weft("install", root, "--source", str(_source(tmp_path)), *_mesh(mesh_certs), "--peers", str(peers))
    assert res.returncode == 0, res.stderr
    assert (root / "etc/weft/mesh/cpu-7.key").stat().st_mode & 0o777 == 0o600
    assert not (root / "etc/weft/mesh/gpu-1.key").exists()
    exec_start = (root / "etc/systemd/system/weft-agent.service").read_text().split("ExecStart=")[1].split()
    config = exec_start[exec_start.index("--config") + 1]
    # The unit's own command, on this machine: the host's paths under the test's root.
    with AgentProcess(containerd_session, tmp_path / "agent", extra_args=[
            "--config", f"{root}{config}", "--tls-dir", f"{root}/etc/weft/mesh",
            "--peers", f"{root}/etc/weft/peers.toml"]) as agent, agent.channel() as ch:
        doc = json.loads(ch.unary_unary("/weft.agent.v1.Admin/Status")(b"", timeout=10))
    assert doc["node"]["name"] == "cpu-7" and doc["node"]["role"] == "cpu"
    assert [p["node"] for p in doc["peers"]] == ["gpu-1"]
    assert "mesh.serving" in [e["event"] for e in agent.events()]


def _flags(tmp: Path, agent: AgentProcess, health: Health) -> list[str]:
    systemctl, _ = _systemctl(tmp)
    return ["--systemctl", str(systemctl), "--kubelet-health-url", health.url, "--agent-socket", str(agent.socket)]


INSTALL_POINTS = ["backups", "journal", *INSTALL_STEPS]


@pytest.mark.parametrize("step", INSTALL_POINTS)
def test_install_killed_after_each_step_is_repaired_by_install_or_by_uninstall(
        step: str, module_agent: AgentProcess, mesh_certs: Path, tmp_path: Path, health: Health) -> None:
    # A containerd 2.x host with conf.d drop-ins (the uninstall crashes below run on a 1.x one).
    root, before, flags, src = _killable_host("ctrd2-gpu-confd", tmp_path, module_agent, mesh_certs, health)
    other = _killed("install", step, root, [*flags, *src], tmp_path / "host-uninstalled")

    res = _weft("install", root, *flags, *src)
    assert res.returncode == 0, res.stderr
    assert _kubelet_on_agent(root)
    assert "nothing changed" in _weft("install", root, *flags, *src).stdout
    assert _weft("uninstall", root, *flags).returncode == 0
    assert snapshot(root) == before

    _uninstalled(other, flags, before)


def _killable_host(shape: str, tmp_path: Path, agent: AgentProcess, mesh_certs: Path,
                   health: Health) -> tuple[Path, object, list[str], list[str]]:
    """A host of ``shape``, its snapshot before, the flags for both verbs, and install's source flags."""
    root = copy_shape(shape, tmp_path / "host")
    return (root, snapshot(root), _flags(tmp_path, agent, health),
            ["--source", str(_source(tmp_path)), *_mesh(mesh_certs)])


def _killed(verb: str, step: str, root: Path, args: list[str], copy: Path) -> Path:
    """``weft <verb>`` killed by its failpoint after ``step``; ``copy``, the host as it left it, for the other
    repair."""
    res = _weft(verb, root, *args, failpoint=f"{verb}.{step}")
    assert res.returncode == -signal.SIGKILL, res.stderr
    shutil.copytree(root, copy, symlinks=True)
    return copy


def _uninstalled(root: Path, flags: list[str], before: object) -> None:
    """``weft uninstall`` succeeds and leaves the host as it was ``before`` weft."""
    res = _weft("uninstall", root, *flags)
    assert res.returncode == 0, res.stderr
    assert snapshot(root) == before


@pytest.mark.parametrize("step", UNINSTALL_STEPS)
def test_uninstall_killed_after_each_step_is_repaired_by_uninstall_or_by_install(
        step: str, module_agent: AgentProcess, mesh_certs: Path, tmp_path: Path, health: Health) -> None:
    root, before, flags, src = _killable_host("imports", tmp_path, module_agent, mesh_certs, health)
    assert _weft("install", root, *flags, *src).returncode == 0
    other = _killed("uninstall", step, root, flags, tmp_path / "host-reinstalled")

    _uninstalled(root, flags, before)

    res = _weft("install", other, *flags, *src)
    assert res.returncode == 0, res.stderr
    assert _kubelet_on_agent(other)
    assert _weft("uninstall", other, *flags).returncode == 0
    assert snapshot(other) == before


RELEASES = ("1.6", "1.7", *RELEASE_LINES, "2")


@pytest.mark.parametrize("line", [*RELEASE_LINES, "2"])
def test_each_2x_releases_own_sandbox_image_where_no_file_names_one(line: str, tmp_path: Path) -> None:
    """The pause image an agent gives reservation pods on a 2.x node whose files name none is the one that
    release runs sandboxes from (its Status no longer says it)."""
    binary = _containerd_binary(line)
    root = copy_shape("kubeadm", tmp_path / "host")
    (root / "etc/containerd/config.toml").write_text("version = 3\n")
    said = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60).stdout
    theirs = _dump(binary, root, tmp_path / "dump")["plugins"][ctrd_config.CRI_IMAGES]["pinned_images"]["sandbox"]
    assert ctrd_config.running_sandbox_image(Host(root), ctrd_config.Containerd.parse(said, "test")) == theirs


@pytest.mark.parametrize("line", RELEASES)
def test_each_releases_own_default_config_installs_and_uninstalls_byte_for_byte(
        line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The newest patch of every line upstream ships, on the file its own ``containerd config default`` writes
    (the config version a new node of that release has) and asked its ``--version`` as on a node where none
    runs: the installer takes it, containerd reads the drop-in, and uninstall gives the file back."""
    binary = _containerd_binary(line)
    default = subprocess.run([str(binary), "config", "default"], capture_output=True, text=True, timeout=60)
    assert default.returncode == 0, default.stderr
    version = tomllib.loads(default.stdout).get("version", 1)
    root = copy_shape("kubeadm", tmp_path / "host")
    (root / "etc/containerd/config.toml").write_text(default.stdout)
    (root / "usr/bin/containerd").write_text(f'#!/bin/sh\nexec {binary} "$@"\n')
    said = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60).stdout.split()
    before_files = snapshot(root)
    before = _dump(binary, root, tmp_path / "before")

    res = _weft("install", root, "--source", str(_source(tmp_path)))
    assert res.returncode == 0, res.stderr
    after = _dump(binary, root, tmp_path / "after")
    section = ctrd_config.CRI if version == 2 else ctrd_config.CRI_RUNTIME
    runtimes = after["plugins"][section]["containerd"]["runtimes"]
    assert runtimes.pop("weft")["base_runtime_spec"] == ctrd_config.BASE_SPEC
    assert after == before
    assert _weft("uninstall", root).returncode == 0
    assert snapshot(root) == before_files
    with capsys.disabled():
        print(f"\n[weft install] containerd {said[2] if len(said) > 2 else said}: config default writes version "
              f"{version}; installed and uninstalled byte for byte")
