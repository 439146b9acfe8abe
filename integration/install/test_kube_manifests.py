"""The shipped manifests as a user applies them, against a real kube-apiserver (and the namespace controller).

Parsing them and checking them against the API's schemas (``tests/nodeimage/test_manifests.py``) did not
catch what the API server itself refuses (an init container named like a container); these apply them
with the real kubectl: through an overlay that only names the image, as ``docs/operations.md`` shows, with
the mesh CA Secret made the documented way after them, and deleted again leaving nothing of weft. And the
installer's report of a host it refuses: an Event on its pod that ``kubectl describe pod`` shows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.controlplane import ControlPlane
from integration.install.apiserver import api_server, weft_objects
from tests.install.conftest import HOSTROOTS, snapshot

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "nodeimage" / "manifests"
IMAGE = "registry.example:5000/weft/node"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    yield from api_server(tmp_path_factory.mktemp("api"))


def _overlay(where: Path, tag: str) -> Path:
    """The user's overlay: the shipped manifests, and their registry's image."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(MANIFESTS, where)}\n"
        f"images:\n  - name: localhost/weft/node\n    newName: {IMAGE}\n    newTag: {tag}\n")
    return where


def _generations(api: ControlPlane) -> dict[str, int]:
    items = json.loads(api.kubectl("get", "daemonsets,deployments,poddisruptionbudgets,services", "-n",
                                   "weft-system", "-o", "json").stdout)["items"]
    return {f"{i['kind']}/{i['metadata']['name']}": (i["metadata"].get("generation", 0),
                                                     i["metadata"]["resourceVersion"] if i["kind"] == "Service" else 0)
            for i in items}


def test_the_manifests_apply_through_an_overlay_take_the_ca_secret_after_and_delete_leaves_nothing(
        api: ControlPlane, tmp_path: Path) -> None:
    overlay = _overlay(tmp_path / "overlay", "0.1.0-test")
    res = api.kubectl("apply", "-k", str(overlay), check=False)
    assert res.returncode == 0, f"the API server refused the shipped manifests:\n{res.stderr}"
    pod = json.loads(api.kubectl("get", "daemonset", "weft", "-n", "weft-system", "-o", "json").stdout)
    spec = pod["spec"]["template"]["spec"]
    images = {c["image"] for c in spec["initContainers"] + spec["containers"]}
    assert images == {f"{IMAGE}:0.1.0-test"}
    signer = json.loads(api.kubectl("get", "deployment", "weft-mesh-signer", "-n", "weft-system",
                                    "-o", "json").stdout)
    assert {c["image"] for c in signer["spec"]["template"]["spec"]["containers"]} == {f"{IMAGE}:0.1.0-test"}
    assert api.kubectl("get", "runtimeclass", "weft", "-o", "jsonpath={.handler}").stdout == "weft"

    # The mesh CA Secret, as docs/operations.md makes it: into the namespace the manifests made.
    ca = tmp_path / "mesh-ca"
    made = subprocess.run([sys.executable, "-m", "shim", "mesh-signer", "--init-ca", "--ca-dir", str(ca)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    api.kubectl("-n", "weft-system", "create", "secret", "generic", "weft-mesh-ca",
                f"--from-file=ca.crt={ca / 'ca.crt'}", f"--from-file=ca.key={ca / 'ca.key'}")

    # A second apply changes nothing (kubectl says "configured" of the PodDisruptionBudget every time, since it
    # sends its selector as a replacement; the API server keeps its generation); a new tag changes the images.
    before = _generations(api)
    api.kubectl("apply", "-k", str(overlay))
    assert _generations(api) == before
    api.kubectl("apply", "-k", str(_overlay(tmp_path / "overlay2", "0.1.1-test")))
    after = _generations(api)
    assert {k for k in before if after[k] != before[k]} == {"DaemonSet/weft", "Deployment/weft-mesh-signer"}

    api.kubectl("delete", "-k", str(overlay), "--wait=false")
    deadline = time.monotonic() + 120
    while (left := weft_objects(api, pods=True)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"left after kubectl delete -k: {left}"
    secret = api.kubectl("get", "secret", "weft-mesh-ca", "-n", "weft-system", "--ignore-not-found", "-o", "name")
    assert not secret.stdout.strip()


def test_a_host_the_installer_refuses_is_an_event_on_its_pod_and_nothing_on_the_host_changes(
        api: ControlPlane, tmp_path: Path) -> None:
    """As the DaemonSet's install container runs it: its pod from the downward API, weft's service account."""
    api.kubectl("apply", "-k", str(_overlay(tmp_path / "overlay", "0.1.0-test")))
    try:
        api.kubectl("apply", "-f", "-", stdin=json.dumps({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "weft-node1", "namespace": "weft-system"},
            "spec": {"serviceAccountName": "weft", "automountServiceAccountToken": False, "nodeName": "node-1",
                     "containers": [{"name": "c", "image": "busybox"}]}}))
        uid = api.kubectl("get", "pod", "weft-node1", "-n", "weft-system", "-o", "jsonpath={.metadata.uid}").stdout
        token = api.kubectl("create", "token", "weft", "-n", "weft-system", "--duration", "10m").stdout.strip()
        kubeconfig = tmp_path / "weft-sa.kubeconfig"
        doc = json.loads(api.kubeconfig("admin").read_text())
        doc["users"] = [{"name": "weft", "user": {"token": token}}]
        doc["contexts"][0]["context"]["user"] = "weft"
        kubeconfig.write_text(json.dumps(doc))

        root = tmp_path / "host"
        shutil.copytree(HOSTROOTS / "kubeadm", root, symlinks=True)
        config = root / "etc/containerd/config.toml"
        config.write_text(config.read_text().replace("version = 2", "version = 7", 1))
        before = snapshot(root)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "WEFT_POD_NAME": "weft-node1",
               "WEFT_POD_NAMESPACE": "weft-system", "WEFT_POD_UID": uid, "WEFT_NODE_NAME": "node-1"}
        res = subprocess.run([sys.executable, "-m", "shim", "install", "--root", str(root)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "config version 7 is not understood" in res.stderr
        assert "could not report" not in res.stdout, res.stdout
        assert snapshot(root) == before

        described = api.kubectl("describe", "pod", "weft-node1", "-n", "weft-system").stdout
        assert "WeftInstallRefused" in described and "config version 7 is not understood" in described, described
        events = json.loads(api.kubectl("get", "events", "-n", "weft-system", "-o", "json",
                                        "--field-selector", "involvedObject.name=weft-node1").stdout)["items"]
        (event,) = [e for e in events if e["reason"] == "WeftInstallRefused"]
        assert (event["type"], event["source"]["component"], event["involvedObject"]["uid"]) == (
            "Warning", "weft-install", uid)
    finally:
        api.kubectl("delete", "pod", "weft-node1", "-n", "weft-system", "--ignore-not-found", "--grace-period=0",
                    "--force", check=False)
