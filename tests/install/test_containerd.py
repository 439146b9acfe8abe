"""The containerd drop-in planned from a host's files, for each containerd line (pure: no root, no processes).

The merges emulated here are checked against the real containerd's ``config dump`` in
integration/install/test_install.py, with the same files.
"""

from __future__ import annotations

import tomllib

import pytest

from shim.errors import UnrecognisedHost, UntestedContainerd
from shim.install import containerd
from shim.install.containerd import CRI, CRI_RUNTIME, Containerd

V1_6 = Containerd("1.6.20~ds1", 1, 6, "test")
V1_7 = Containerd("1.7.35", 1, 7, "test")
V2_2 = Containerd("v2.2.1", 2, 2, "test")
V2_4 = Containerd("v2.4.2", 2, 4, "test")


class Files:
    def __init__(self, files: dict[str, str]) -> None:
        self.files = files

    def read(self, path: str) -> bytes | None:
        return self.files[path].encode() if path in self.files else None

    def glob(self, pattern: str) -> list[str]:
        import fnmatch

        return [p for p in self.files if fnmatch.fnmatch(p, pattern)]


def _dropin(files: dict[str, str], ctrd: Containerd) -> dict:
    return tomllib.loads(containerd.plan(Files(files), ["/hook"], "/broker.sock", ctrd).dropin.decode())


# A version 3 root whose default runtime is put together by three files, as containerd 2.x merges them: the
# main file names runc and its cgroup driver, an old version 2 site file (migrated on its own) adds a runc
# option and an annotation, and a version 3 file changes one option again.
MERGED = {
    containerd.CONFIG: '''version = 3
imports = ["/etc/containerd/conf.d/*.toml"]
[plugins."io.containerd.cri.v1.images".pinned_images]
sandbox = "registry.example/pause:3.10"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
runtime_type = "io.containerd.runc.v2"
sandboxer = "podsandbox"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
SystemdCgroup = true
BinaryName = "/usr/sbin/runc"
''',
    "/etc/containerd/conf.d/10-old.toml": '''version = 2
[plugins."io.containerd.grpc.v1.cri"]
sandbox_image = "registry.example/pause:old"
[plugins."io.containerd.grpc.v1.cri".containerd]
snapshotter = "overlayfs"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
pod_annotations = ["example.com/*"]
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
NoNewKeyring = true
''',
    "/etc/containerd/conf.d/20-new.toml": '''version = 3
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
BinaryName = "/usr/local/sbin/runc"
''',
}
MERGED_WEFT = {"runtime_type": "io.containerd.runc.v2", "sandboxer": "podsandbox",
               "options": {**containerd.RUNC_DEFAULTS_2X["options"], "SystemdCgroup": True,
                           "BinaryName": "/usr/local/sbin/runc", "NoNewKeyring": True},
               "pod_annotations": ["example.com/*", "weft.io/*"], "container_annotations": ["weft.io/*"],
               "base_runtime_spec": containerd.BASE_SPEC}


def test_containerd_2x_merges_the_files_table_by_table_and_the_dropin_holds_only_the_weft_runtime() -> None:
    assert _dropin(MERGED, V2_4) == {"version": 3, "plugins": {CRI_RUNTIME: {"containerd": {"runtimes": {
        "weft": MERGED_WEFT}}}}}


def test_a_version_2_file_on_containerd_2x_gets_a_version_2_dropin_with_only_the_weft_runtime() -> None:
    files = {containerd.CONFIG: '''version = 2
[plugins."io.containerd.grpc.v1.cri"]
sandbox_image = "registry.example/pause:3.10"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
runtime_type = "io.containerd.runc.v2"
sandbox_mode = "podsandbox"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
SystemdCgroup = true
'''}
    # sandbox_mode is 2.x's sandboxer once migrated; the drop-in says it the way 2.x reads it back either way.
    assert _dropin(files, V2_4) == {"version": 2, "plugins": {CRI: {"containerd": {"runtimes": {"weft": {
        "runtime_type": "io.containerd.runc.v2", "sandboxer": "podsandbox",
        "options": {**containerd.RUNC_DEFAULTS_2X["options"], "SystemdCgroup": True},
        "pod_annotations": ["weft.io/*"], "container_annotations": ["weft.io/*"],
        "base_runtime_spec": containerd.BASE_SPEC}}}}}}


def test_the_same_version_2_file_on_containerd_1x_gets_the_whole_cri_section_as_before() -> None:
    files = {containerd.CONFIG: 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\nsandbox_image = "p:1"\n',
             "/etc/containerd/conf.d/10.toml": ""}
    for ctrd in (V1_6, V1_7):
        assert _dropin(files, ctrd) == {"version": 2, "plugins": {CRI: {"sandbox_image": "p:1", "containerd": {
            "runtimes": {"runc": {"runtime_type": "io.containerd.runc.v2"}, "weft": {
                "runtime_type": "io.containerd.runc.v2", "base_runtime_spec": containerd.BASE_SPEC,
                "pod_annotations": ["weft.io/*"], "container_annotations": ["weft.io/*"]}}}}}}


def test_a_version_4_file_names_its_socket_in_the_grpc_server_plugin() -> None:
    files = {containerd.CONFIG: 'version = 4\n[plugins."io.containerd.server.v1.grpc"]\naddress = "/run/c/c.sock"\n'
                                '[grpc]\naddress = "/ignored/in/version/4.sock"\n'}
    assert containerd.socket(Files(files)) == "/run/c/c.sock"
    assert containerd.plan(Files(files), ["/hook"], "", V2_4).socket == "/run/c/c.sock"
    assert _dropin(files, V2_4)["version"] == 4
    assert containerd.socket(Files({containerd.CONFIG: "version = 4\n"})) == containerd.DEFAULT_SOCKET
    assert containerd.socket(Files({containerd.CONFIG: 'version = 3\n[grpc]\naddress = "/run/x.sock"\n'})) == \
        "/run/x.sock"


def test_a_version_3_file_without_runtimes_gets_containerds_own_default_runc() -> None:
    weft = _dropin({containerd.CONFIG: "version = 3\n"}, V2_2)["plugins"][CRI_RUNTIME]["containerd"]["runtimes"]
    assert weft == {"weft": {**containerd.RUNC_DEFAULTS_2X, "base_runtime_spec": containerd.BASE_SPEC,
                             "pod_annotations": ["weft.io/*"], "container_annotations": ["weft.io/*"]}}


@pytest.mark.parametrize(("text", "source", "version", "major", "minor"), [
    ("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3", "bin", "1.6.20~ds1", 1, 6),
    ("containerd github.com/containerd/containerd/v2 v2.4.2 v2.4.2", "bin", "v2.4.2", 2, 4),
    ("containerd containerd.io 1.7.27 05044ec0a9a7", "bin", "1.7.27", 1, 7),
    ("v2.4.2", "CRI", "v2.4.2", 2, 4),
    ("2.1.5+unknown", "CRI", "2.1.5+unknown", 2, 1),
])
def test_containerd_versions_are_read_from_what_containerd_says(
        text: str, source: str, version: str, major: int, minor: int) -> None:
    assert Containerd.parse(text, source) == Containerd(version, major, minor, source)


@pytest.mark.parametrize(("version", "tested"), [
    ("1.5.18", False), ("1.6.0", True), ("1.7.35", True), ("v2.0.0", True), ("v2.4.2", True), ("v3.0.0", False),
    ("0.9.1", False)])
def test_only_the_tested_lines_are_accepted(version: str, tested: bool) -> None:
    ctrd = Containerd.parse(version, "here")
    assert ctrd.tested is tested
    if not tested:
        with pytest.raises(UntestedContainerd, match=f"here: containerd {version} is not a version weft is tested"):
            containerd.plan(Files({containerd.CONFIG: "version = 2\n"}), ["/hook"], "", ctrd)


@pytest.mark.parametrize(("config_version", "oldest"), [(2, V1_6), (3, V2_2), (4, Containerd("v2.3.0", 2, 3, "t"))])
def test_each_config_version_needs_the_containerd_that_reads_it(config_version: int, oldest: Containerd) -> None:
    files = Files({containerd.CONFIG: f"version = {config_version}\n"})
    containerd.plan(files, ["/hook"], "", oldest)
    older = {3: V1_7, 4: V2_2}.get(config_version)
    if older is not None:
        with pytest.raises(UnrecognisedHost, match=f"config version {config_version} is not read by containerd"):
            containerd.plan(files, ["/hook"], "", older)


def test_the_running_sandbox_image_is_the_files_or_on_2x_the_release_s_own_default() -> None:
    """What an agent started by hand gives its reservation pods where containerd's Status names no image (2.x)."""
    v2_0, v2_3 = Containerd("v2.0.5", 2, 0, "test"), Containerd("v2.3.7", 2, 3, "test")
    # the old site file imported after the main one names it last
    assert containerd.running_sandbox_image(Files(MERGED), V2_4) == "registry.example/pause:old"
    plain = Files({containerd.CONFIG: "version = 3\n"})
    assert [containerd.running_sandbox_image(plain, c) for c in (v2_0, V2_2, v2_3, V2_4)] == [
        "registry.k8s.io/pause:3.10", "registry.k8s.io/pause:3.10.1", "registry.k8s.io/pause:3.10.2",
        "registry.k8s.io/pause:3.10.2"]
    old = Files({containerd.CONFIG: 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\nsandbox_image = "p:1"\n'})
    assert containerd.running_sandbox_image(old, V2_2) == "p:1"  # a version 2 file's, as 2.x migrates it
    assert containerd.running_sandbox_image(old, V1_6) == "p:1"
    assert containerd.running_sandbox_image(Files({containerd.CONFIG: "version = 2\n"}), V1_7) is None
    with pytest.raises(UnrecognisedHost, match=r"config\.toml"):
        containerd.running_sandbox_image(Files({containerd.CONFIG: "version = = 3\n"}), V2_4)
