"""weft's Helm chart (charts/weft) as a platform team installs it: linted, rendering the same objects as the
kustomize manifests, its values taking effect, and installed, backed out and uninstalled with the real Helm
against a real kube-apiserver. The cluster of real nodes installs with it too
(``integration/nodes/test_kube_day_one.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from harness import binaries
from harness.controlplane import ControlPlane
from integration.install.apiserver import api_server, weft_objects

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "weft"
IMAGE = "registry.example:5000/weft/node"


def _helm(*args: str, kubeconfig: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [binaries.helm(), *args, *(["--kubeconfig", str(kubeconfig)] if kubeconfig else [])]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(argv[1:])} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


def _objects(text: str) -> dict[tuple[str, str, str], dict]:
    docs = [d for d in yaml.safe_load_all(text) if d]
    out = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs}
    assert len(out) == len(docs), "two objects of one kind and name"
    return out


def _rendered(*values: str) -> dict[tuple[str, str, str], dict]:
    return _objects(_helm("template", "weft", str(CHART), *[a for v in values for a in ("--set", v)]).stdout)


def _kustomized(where: Path) -> dict[tuple[str, str, str], dict]:
    res = subprocess.run([binaries.binary("kubectl"), "kustomize", str(where)], capture_output=True, text=True,
                         timeout=120, check=True)
    return _objects(res.stdout)


def _pod_spec(objects: dict[tuple[str, str, str], dict], kind: str, name: str) -> dict:
    (obj,) = [o for (k, _, n), o in objects.items() if (k, n) == (kind, name)]
    return obj["spec"]["template"]["spec"]


def test_the_chart_lints_clean_with_its_defaults_and_with_values_set() -> None:
    for values in ([], ["backout=true"], ["nodes.gpuSelector=nvidia.com/gpu.present=true",
                                          "image.registry=" + IMAGE.rsplit("/", 2)[0], "namespace.name=gpu-platform"]):
        res = _helm("lint", "--strict", str(CHART), *[a for v in values for a in ("--set", v)])
        assert "0 chart(s) failed" in res.stdout and "[WARNING]" not in res.stdout, res.stdout


def test_the_chart_renders_exactly_the_kustomize_manifests_and_their_back_out() -> None:
    ours, theirs = _rendered(), _kustomized(REPO / "nodeimage" / "manifests")
    assert sorted(ours) == sorted(theirs)
    for key, obj in theirs.items():
        assert ours[key] == obj, key
    ours, theirs = _rendered("backout=true"), _kustomized(REPO / "nodeimage" / "backout")
    assert sorted(ours) == sorted(theirs)
    for key, obj in theirs.items():
        assert ours[key] == obj, key


def test_the_charts_values_reach_every_object_they_name() -> None:
    objects = _rendered("image.registry=registry.example:5000", "image.tag=0.2.0", "namespace.name=gpu-platform",
                        "nodes.gpuSelector=nvidia.com/gpu.present=true", "nodes.cpuSelector=pool=batch",
                        "nodes.nodeSelector.pool=weft", "nodes.updateStrategy.rollingUpdate.maxUnavailable=2",
                        "signer.replicas=3", "meshCA.secretName=our-ca")
    namespaced = {k for k in objects if k[1]}
    assert {ns for _, ns, _ in namespaced} == {"gpu-platform"}
    assert ("Namespace", "", "gpu-platform") in objects
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        for (k, _, name), obj in objects.items():
            if k == kind:
                assert {s.get("namespace", "gpu-platform") for s in obj["subjects"]} == {"gpu-platform"}, name
    node = _pod_spec(objects, "DaemonSet", "weft")
    signer = _pod_spec(objects, "Deployment", "weft-mesh-signer")
    images = {c["image"] for c in node["initContainers"] + node["containers"] + signer["containers"]}
    assert images == {"registry.example:5000/weft/node:0.2.0"}
    install = next(c for c in node["initContainers"] if c["name"] == "install")
    env = {e["name"]: e.get("value") for e in install["env"]}
    assert (env["WEFT_GPU_NODES"], env["WEFT_CPU_NODES"]) == ("nvidia.com/gpu.present=true", "pool=batch")
    assert node["nodeSelector"] == {"kubernetes.io/os": "linux", "pool": "weft"}
    (ds,) = [o for (k, _, _), o in objects.items() if k == "DaemonSet"]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 2
    (deploy,) = [o for (k, _, _), o in objects.items() if k == "Deployment"]
    assert deploy["spec"]["replicas"] == 3
    assert [v["secret"]["secretName"] for v in signer["volumes"] if "secret" in v] == ["our-ca"]
    # Without selectors the installer decides each node's role as the kustomize manifests let it.
    default_install = next(c for c in _pod_spec(_rendered(), "DaemonSet", "weft")["initContainers"]
                           if c["name"] == "install")
    assert not {"WEFT_GPU_NODES", "WEFT_CPU_NODES"} & {e["name"] for e in default_install["env"]}


DIGEST = "sha256:" + "3f" * 32


def test_image_digest_names_the_image_by_digest_as_a_kustomize_overlay_does(tmp_path: Path) -> None:
    """What was verified is what runs: with image.digest every container names the image by it, and a
    kustomize overlay's ``images: digest`` gives the same objects; a value that is no digest is refused."""
    node = _pod_spec(_rendered(f"image.digest={DIGEST}", "image.tag=0.2.0"), "DaemonSet", "weft")
    assert {c["image"] for c in node["initContainers"] + node["containers"]} == {f"localhost/weft/node@{DIGEST}"}
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        f"resources: [{os.path.relpath(REPO / 'nodeimage' / 'manifests', overlay)}]\n"  # kustomize: relative only
        f"images: [{{name: localhost/weft/node, digest: '{DIGEST}'}}]\n")
    ours, theirs = _rendered(f"image.digest={DIGEST}"), _kustomized(overlay)
    assert sorted(ours) == sorted(theirs)
    for key, obj in theirs.items():
        assert ours[key] == obj, key
    res = _helm("template", "weft", str(CHART), "--set", "image.digest=0.2.0", check=False)
    assert res.returncode != 0 and 'image.digest "0.2.0" is not a digest' in res.stderr, res.stderr


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    yield from api_server(tmp_path_factory.mktemp("helm-api"), runtime_class=False)


def test_helm_installs_backs_out_and_uninstalls_leaving_nothing(api: ControlPlane) -> None:
    kubeconfig = api.kubeconfig("admin")
    out = _helm("install", "weft", str(CHART), "--set", "image.registry=registry.example:5000",
                "--set", "image.tag=0.1.0-test", kubeconfig=kubeconfig).stdout
    assert "STATUS: deployed" in out and "create secret generic weft-mesh-ca" in out, out
    ds = json.loads(api.kubectl("-n", "weft-system", "get", "daemonset", "weft", "-o", "json").stdout)
    spec = ds["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["mesh-identity-init", "install"]
    assert {c["image"] for c in spec["initContainers"] + spec["containers"]} == {f"{IMAGE}:0.1.0-test"}
    ns = json.loads(api.kubectl("get", "namespace", "weft-system", "-o", "json").stdout)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    # The back-out, as docs/operations.md gives it: the same release, its DaemonSet now the uninstaller.
    out = _helm("upgrade", "weft", str(CHART), "--reuse-values", "--set", "backout=true",
                kubeconfig=kubeconfig).stdout
    assert "rollout status daemonset/weft" in out, out
    ds = json.loads(api.kubectl("-n", "weft-system", "get", "daemonset", "weft", "-o", "json").stdout)
    spec = ds["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["uninstall"]
    assert {c["image"] for c in spec["initContainers"] + spec["containers"]} == {f"{IMAGE}:0.1.0-test"}
    _helm("uninstall", "weft", "--wait", "--timeout", "120s", kubeconfig=kubeconfig)
    end = time.monotonic() + 120
    while (left := weft_objects(api)) and time.monotonic() < end:
        time.sleep(1)
    assert not left, f"left of weft after helm uninstall: {left}"
    assert "weft" not in _helm("list", "-A", "-q", kubeconfig=kubeconfig).stdout.split()
