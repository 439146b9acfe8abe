"""The Kubernetes manifests in nodeimage/manifests: valid, least-privilege, and what weft's code expects.

Schema validation uses kubernetes-validate (the OpenAPI schemas of each
Kubernetes release, bundled), in strict mode so a misspelt field fails. The
cross-checks read the names from weft's own code (mesh config defaults,
discovery's port name, the image build's name) so the manifests cannot drift
from what the agent looks for.
"""

from __future__ import annotations

import base64
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from nodeimage import build
from shim.config import MeshConfig
from shim.mesh import discovery
from shim.mesh.certs import load_node_tls, write_mesh_certs

MANIFESTS = Path(__file__).resolve().parents[2] / "nodeimage" / "manifests"
# Oldest still-common release, a recent one, the newest the library bundles.
K8S_VERSIONS = ("1.29.0", "1.33.0", kubernetes_validate.latest_version())


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _resource_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p.name != "kustomization.yaml")


ALL = [(p.name, i, d) for p in _resource_files() for i, d in enumerate(_docs(p))]


def _one(kind: str) -> dict:
    found = [d for _, _, d in ALL if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("name", "index", "doc"), ALL, ids=[f"{n}[{i}]-{d['kind']}" for n, i, d in ALL])
def test_every_manifest_is_valid_against_the_kubernetes_api_schema(name, index, doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_catches_a_misspelt_field():
    ds = yaml.safe_load((MANIFESTS / "daemonset.yaml").read_text())
    ds["spec"]["template"]["spec"]["hostNetwrk"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="hostNetwrk"):
        kubernetes_validate.validate(ds, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_exactly_the_manifests_present_and_each_loads():
    kust = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    listed = kust["resources"]
    present = [p.name for p in _resource_files() if not p.name.endswith(".example.yaml")]
    assert sorted(listed) == present
    assert len(listed) == len(set(listed))
    for name in listed:
        assert _docs(MANIFESTS / name), f"{name} holds no object"
    assert {i["name"] for i in kust.get("images", [])} == {build.DEFAULT_NAME.rsplit(":", 1)[0]}


def test_the_mesh_secret_is_never_applied_by_the_kustomization():
    kust = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    applied = [d for name in kust["resources"] for d in _docs(MANIFESTS / name)]
    assert not [d for d in applied if d["kind"] == "Secret"]


def test_rbac_grants_reads_and_writes_pods_only_in_weft_s_namespace():
    rules = {}
    for _, _, d in ALL:
        if d["kind"] in ("Role", "ClusterRole"):
            assert "aggregationRule" not in d
            for r in d["rules"]:
                assert "nonResourceURLs" not in r
                for group in r["apiGroups"]:
                    for res in r["resources"]:
                        key = (d["kind"], group, res, tuple(r.get("resourceNames", ())))
                        rules.setdefault(key, set()).update(r["verbs"])
    sa = _one("ServiceAccount")["metadata"]["name"]
    assert rules == {
        ("Role", "discovery.k8s.io", "endpointslices", ()): {"get", "list", "watch"},
        ("ClusterRole", "", "nodes", ()): {"get", "list", "watch"},
        ("ClusterRole", "", "pods", ()): {"get", "list", "watch"},  # read anywhere: pod specs, ownership
        ("Role", "", "pods", ()): {"create", "delete", "get", "list", "watch"},  # written in weft-system only
        ("Role", "", "serviceaccounts/token", (sa,)): {"create"},  # the keeper's, for the host agent
    }


def test_rbac_reaches_only_the_daemonsets_service_account_and_endpointslices_only_in_its_namespace():
    ds = _one("DaemonSet")
    sa = (ds["metadata"]["namespace"], ds["spec"]["template"]["spec"]["serviceAccountName"])
    assert sa == (_one("ServiceAccount")["metadata"]["namespace"], _one("ServiceAccount")["metadata"]["name"])
    roles = {(d["kind"], d["metadata"]["name"]): d for _, _, d in ALL if d["kind"] in ("Role", "ClusterRole")}
    for _, _, b in ALL:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        assert [(s["kind"], s["namespace"], s["name"]) for s in b["subjects"]] == [("ServiceAccount", *sa)]
        assert (b["roleRef"]["kind"], b["roleRef"]["name"]) in roles
        if b["kind"] == "RoleBinding":
            assert b["metadata"]["namespace"] == MeshConfig().namespace
    for _, _, role in ALL:
        if role["kind"] == "Role":
            assert role["metadata"]["namespace"] == MeshConfig().namespace


def test_headless_service_is_the_one_mesh_discovery_reads():
    svc, ds = _one("Service"), _one("DaemonSet")
    mesh = MeshConfig()
    assert (svc["metadata"]["namespace"], svc["metadata"]["name"]) == (mesh.namespace, mesh.service)
    assert svc["spec"]["clusterIP"] == "None"
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [
        (discovery.DEFAULT_PORT_NAME, discovery.DEFAULT_PORT)]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_runtime_class_weft_uses_handler_weft():
    rc = _one("RuntimeClass")
    assert (rc["metadata"]["name"], rc["handler"]) == ("weft", "weft")


def test_daemonset_runs_the_installer_with_the_host_root_and_keeps_only_the_agent_s_credentials_after():
    spec = _one("DaemonSet")["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == {"host-root": "/", "api-credentials": "/etc/weft/api"}
    (init,) = spec["initContainers"]
    assert init["args"][:5] == ["install", "--root", "/host", "--systemctl", "nsenter -t 1 -m -- systemctl"]
    assert spec["hostPID"] is True  # nsenter -t 1 reaches the host's systemd
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]}["host-root"] == "/host"
    (keeper,) = spec["containers"]
    assert keeper["args"] == ["kube-credentials", "--dir", "/etc/weft/api"]
    assert {m["name"]: m["mountPath"] for m in keeper["volumeMounts"]} == {"api-credentials": "/etc/weft/api"}
    sc = keeper["securityContext"]  # root for the root-owned host directory, and nothing more
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]} and not sc.get("privileged")
    assert spec["hostNetwork"] is True  # the pod's IP is the node's, where the host agent's mesh listens
    for c in (init, *spec["containers"]):
        assert c["image"] == build.DEFAULT_NAME


def test_the_installer_points_the_agent_at_the_kubeconfig_the_daemonset_keeps():
    from shim.install.plan import API_KUBECONFIG, Mesh

    (keeper,) = _one("DaemonSet")["spec"]["template"]["spec"]["containers"]
    kept_in = keeper["args"][keeper["args"].index("--dir") + 1]
    mesh = Mesh("n1", "cpu", "10.0.0.1:7443", "kubernetes", b"ca", b"crt", b"key")
    assert f'kubeconfig = "{kept_in}/kubeconfig"' in mesh.config().decode() and API_KUBECONFIG.startswith(kept_in)
    static = Mesh("n1", "cpu", "10.0.0.1:7443", "", b"ca", b"crt", b"key", peers_file=b"")
    assert "[kubernetes]" not in static.config().decode()


def test_daemonset_passes_its_mesh_environment_to_the_installer_as_flags_it_takes():
    from shim.cli import parser

    (init,) = _one("DaemonSet")["spec"]["template"]["spec"]["initContainers"]
    env = {e["name"]: e.get("value", "<from the downward API>") for e in init["env"]}
    flags = dict(zip(init["args"][5::2], init["args"][6::2], strict=True))
    assert flags == {"--node-name": "$(WEFT_NODE_NAME)", "--mesh-address": "$(WEFT_MESH_ADDRESS)",
                     "--peers": "$(WEFT_PEERS)", "--tls-source": "$(WEFT_TLS_SOURCE)", "--role": "$(WEFT_ROLE)"}
    assert all(v[2:-1] in env for v in flags.values())  # kubelet expands only variables the container declares
    assert env["WEFT_TLS_SOURCE"] == {m["name"]: m["mountPath"] for m in init["volumeMounts"]}["mesh-tls"]
    expanded = [env.get(a[2:-1], a) if a.startswith("$(") else a for a in init["args"]]
    expanded = [a.replace("$(WEFT_NODE_IP)", "10.0.0.7") for a in expanded]
    args = parser().parse_args([a if a != "<from the downward API>" else "cpu-7" for a in expanded])
    assert (args.mesh_address, args.peers, args.role, str(args.tls_source)) == (
        "10.0.0.7:7443", "kubernetes", "auto", "/etc/weft/mesh")


def test_daemonset_lands_on_gpu_and_cpu_nodes():
    spec = _one("DaemonSet")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    tolerated = {(t["key"], t.get("effect")) for t in spec["tolerations"] if t["operator"] == "Exists"}
    assert ("nvidia.com/gpu", "NoSchedule") in tolerated
    assert ("weft.io/role", "NoSchedule") in tolerated


def test_mesh_tls_secret_keys_are_the_files_tls_dir_reads(tmp_path):
    """A Secret laid out as the example says, mounted as kubelet mounts it, is a --tls-dir the agent loads."""
    example = _one("Secret")
    ds = _one("DaemonSet")["spec"]["template"]["spec"]
    (vol,) = [v for v in ds["volumes"] if "secret" in v]
    assert vol["secret"]["secretName"] == example["metadata"]["name"]
    assert set(example["data"]) == {"ca.crt", "gpu-1.crt", "gpu-1.key"}

    issued = write_mesh_certs(tmp_path / "issued", ["gpu-1", "cpu-1"])
    secret = {**example, "data": {name: base64.b64encode(path.read_bytes()).decode()
                                  for name, path in issued.items() if name != "ca.key"}}
    kubernetes_validate.validate(secret, K8S_VERSIONS[-1], strict=True)
    mounted = tmp_path / "mounted"  # a secret volume: one file per key
    mounted.mkdir()
    for key, value in secret["data"].items():
        (mounted / key).write_bytes(base64.b64decode(value))
    for node in ("gpu-1", "cpu-1"):
        tls = load_node_tls(mounted, node)
        assert tls.ca_pem == (tmp_path / "issued" / "ca.crt").read_bytes()
    assert not (mounted / "ca.key").exists()
