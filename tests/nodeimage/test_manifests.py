"""The Kubernetes manifests in nodeimage/manifests: valid, least-privilege, and what weft's code expects.

Schema validation uses kubernetes-validate (the OpenAPI schemas of each
Kubernetes release, bundled), in strict mode so a misspelt field fails. The
cross-checks read the names from weft's own code (mesh config defaults,
discovery's port name, the image build's name) so the manifests cannot drift
from what the agent looks for.
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from nodeimage import build
from shim.config import MeshConfig
from shim.mesh import discovery

MANIFESTS = Path(__file__).resolve().parents[2] / "nodeimage" / "manifests"
SIGNER = "signer.yaml"  # the mesh signer's Deployment and RBAC, checked on their own below
# Oldest still-common release, a recent one, the newest the library bundles.
K8S_VERSIONS = ("1.29.0", "1.33.0", kubernetes_validate.latest_version())


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _resource_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p.name != "kustomization.yaml")


ALL = [(p.name, i, d) for p in _resource_files() for i, d in enumerate(_docs(p))]


def _one(kind: str, file: str | None = None) -> dict:
    """The one object of ``kind`` (in ``file``; by default, outside the signer's manifest)."""
    found = [d for name, _, d in ALL if d["kind"] == kind and (name == file if file else name != SIGNER)]
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


def test_no_secret_is_applied_by_the_kustomization():
    kust = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    applied = [d for name in kust["resources"] for d in _docs(MANIFESTS / name)]
    assert not [d for d in applied if d["kind"] == "Secret"]


def test_rbac_grants_reads_and_writes_pods_only_in_weft_s_namespace():
    rules = {}
    for name, _, d in ALL:
        if d["kind"] in ("Role", "ClusterRole") and name != SIGNER:
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
        ("Role", "", "events", ()): {"create"},  # the installer's report of a host it refuses
        ("ClusterRole", "policy", "poddisruptionbudgets", ()): {"get", "list", "watch"},  # workloads' budgets
        ("Role", "policy", "poddisruptionbudgets", ()): {"create", "delete", "get", "list", "patch"},  # stage budgets
    }


def test_rbac_reaches_only_the_daemonsets_service_account_and_endpointslices_only_in_its_namespace():
    ds = _one("DaemonSet")
    sa = (ds["metadata"]["namespace"], ds["spec"]["template"]["spec"]["serviceAccountName"])
    assert sa == (_one("ServiceAccount")["metadata"]["namespace"], _one("ServiceAccount")["metadata"]["name"])
    roles = {(d["kind"], d["metadata"]["name"]): d for _, _, d in ALL if d["kind"] in ("Role", "ClusterRole")}
    for name, _, b in ALL:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding") or name == SIGNER:
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
    assert host_paths == {"host-root": "/", "api-credentials": "/etc/weft/api", "mesh-identity": "/etc/weft/mesh",
                          "kubelet-kubeconfig": "/etc/kubernetes/kubelet.conf", "kubelet-pki": "/var/lib/kubelet/pki"}
    _, init = spec["initContainers"]
    assert init["args"][:5] == ["install", "--root", "/host", "--systemctl", "nsenter -t 1 -m -- systemctl"]
    assert spec["hostPID"] is True  # nsenter -t 1 reaches the host's systemd
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]}["host-root"] == "/host"
    keeper, _ = spec["containers"]
    assert keeper["args"] == ["kube-credentials", "--dir", "/etc/weft/api"]
    assert {m["name"]: m["mountPath"] for m in keeper["volumeMounts"]} == {"api-credentials": "/etc/weft/api",
                                                                         "tmp": "/tmp"}
    sc = keeper["securityContext"]  # root for the root-owned host directory, and nothing more
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]} and not sc.get("privileged")
    assert spec["hostNetwork"] is True  # the pod's IP is the node's, where the host agent's mesh listens
    for c in (init, *spec["containers"]):
        assert c["image"] == build.DEFAULT_NAME


def test_the_installer_points_the_agent_at_the_kubeconfig_the_daemonset_keeps():
    from shim.install.plan import API_KUBECONFIG, Mesh

    keeper, _ = _one("DaemonSet")["spec"]["template"]["spec"]["containers"]
    kept_in = keeper["args"][keeper["args"].index("--dir") + 1]
    mesh = Mesh("n1", "cpu", "10.0.0.1:7443", "kubernetes", b"ca", b"crt", b"key")
    assert f'kubeconfig = "{kept_in}/kubeconfig"' in mesh.config().decode() and API_KUBECONFIG.startswith(kept_in)
    static = Mesh("n1", "cpu", "10.0.0.1:7443", "", b"ca", b"crt", b"key", peers_file=b"")
    assert "[kubernetes]" not in static.config().decode()


def test_daemonset_passes_its_mesh_environment_to_the_installer_as_flags_it_takes():
    from shim.cli import parser

    _, init = _one("DaemonSet")["spec"]["template"]["spec"]["initContainers"]
    env = {e["name"]: e.get("value", "<from the downward API>") for e in init["env"]}
    assert init["args"][-1] == "--tls-on-host"  # the files mesh-identity keeps on the host
    flags = dict(zip(init["args"][5:-1:2], init["args"][6:-1:2], strict=True))
    assert flags == {"--node-name": "$(WEFT_NODE_NAME)", "--mesh-address": "$(WEFT_MESH_ADDRESS)",
                     "--peers": "$(WEFT_PEERS)", "--role": "$(WEFT_ROLE)"}
    assert all(v[2:-1] in env for v in flags.values())  # kubelet expands only variables the container declares
    expanded = [env.get(a[2:-1], a) if a.startswith("$(") else a for a in init["args"]]
    expanded = [a.replace("$(WEFT_NODE_IP)", "10.0.0.7") for a in expanded]
    args = parser().parse_args([a if a != "<from the downward API>" else "cpu-7" for a in expanded])
    assert (args.mesh_address, args.peers, args.role, args.tls_on_host) == (
        "10.0.0.7:7443", "kubernetes", "auto", True)


def test_daemonset_lands_on_gpu_and_cpu_nodes():
    spec = _one("DaemonSet")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    tolerated = {(t["key"], t.get("effect")) for t in spec["tolerations"] if t["operator"] == "Exists"}
    assert ("nvidia.com/gpu", "NoSchedule") in tolerated
    assert ("weft.io/role", "NoSchedule") in tolerated


def test_each_node_makes_its_own_mesh_identity_and_no_node_mounts_a_key_secret():
    """No Secret in the DaemonSet: the node's key is made on the host by mesh-identity (before the installer,
    which takes the files from the same host directory, and then to renew), with the kubelet's credentials."""
    from shim.cli import parser

    spec = _one("DaemonSet")["spec"]["template"]["spec"]
    assert not [v for v in spec["volumes"] if "secret" in v or "projected" in v]
    first, install = spec["initContainers"]
    _, renew = spec["containers"]
    assert first["args"] == ["mesh-identity", "--dir", "/etc/weft/mesh", "--once"]
    assert renew["args"] == ["mesh-identity", "--dir", "/etc/weft/mesh"]
    for c in (first, renew):
        mounts = {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in c["volumeMounts"]}
        assert mounts == {"mesh-identity": ("/etc/weft/mesh", False),
                          "kubelet-kubeconfig": ("/etc/kubernetes/kubelet.conf", True),
                          "kubelet-pki": ("/var/lib/kubelet/pki", True), "tmp": ("/tmp", False)}
        env = {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
        assert env == {"WEFT_NODE_NAME": "spec.nodeName", "WEFT_KUBELET_KUBECONFIG": "/etc/kubernetes/kubelet.conf"}
        sc = c["securityContext"]
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["allowPrivilegeEscalation"] is False
        assert not sc.get("privileged") and sc["readOnlyRootFilesystem"] is True
        args = parser().parse_args(c["args"])
        assert str(args.dir) == "/etc/weft/mesh" and args.fn.__module__ == "shim.mesh.cli"
    assert "mesh-identity" not in {m["name"] for m in install["volumeMounts"]}  # it reads them under /host


def test_init_containers_and_containers_have_names_of_their_own():
    """The API server refuses a pod whose init container and container share a name."""
    for kind in ("DaemonSet", "Deployment"):
        spec = (_one(kind) if kind == "DaemonSet" else _one(kind, SIGNER))["spec"]["template"]["spec"]
        names = [c["name"] for c in spec.get("initContainers", []) + spec["containers"]]
        assert len(names) == len(set(names)), names


def test_every_weft_container_runs_weft_through_the_image_s_entrypoint_under_tini():
    """Each container that runs weft gives the image args only: the ENTRYPOINT runs weft under tini, which takes
    SIGTERM from the container's first instructions (docs/operations.md, "How weft's containers end"), and a
    ``command`` would replace it. The back-out's uninstall too; its idle container is ``sleep``, not weft."""
    assert build.parse_containerfile(build.CONTAINERFILE.read_text()).entrypoint[:2] == ["/opt/weft/bin/tini", "-s"]
    backout = yaml.safe_load((MANIFESTS.parent / "backout" / "daemonset-backout.yaml").read_text())
    backout_init = next(op["value"] for op in backout if op["path"].endswith("/initContainers"))
    for kind in ("DaemonSet", "Deployment"):
        spec = (_one(kind) if kind == "DaemonSet" else _one(kind, SIGNER))["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"], *(backout_init if kind == "DaemonSet" else [])]:
            assert "command" not in c and c["args"], f"{kind} {c['name']}: {c.get('command')}"


def test_every_read_only_root_has_a_writable_tmp_of_its_own():
    """The Kubernetes client writes a kubeconfig's embedded certificates (kubeadm's kubelet.conf embeds the CA)
    to temporary files: a read-only root needs /tmp, in memory and small."""
    for kind in ("DaemonSet", "Deployment"):
        spec = (_one(kind) if kind == "DaemonSet" else _one(kind, SIGNER))["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["securityContext"].get("readOnlyRootFilesystem"):
                tmp = [m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
                assert tmp, f"{kind} {c['name']}: read-only root without /tmp"
                assert volumes[tmp[0]]["emptyDir"]["medium"] == "Memory", c["name"]


def test_the_installer_knows_its_pod_to_report_a_refused_host_and_describe_shows_its_last_words():
    _, install = _one("DaemonSet")["spec"]["template"]["spec"]["initContainers"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in install["env"]}
    assert (env["WEFT_POD_NAME"], env["WEFT_POD_NAMESPACE"], env["WEFT_POD_UID"]) == (
        "metadata.name", "metadata.namespace", "metadata.uid")
    assert install["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_only_the_signer_mounts_the_mesh_ca_and_its_secret_is_what_init_ca_writes(tmp_path):
    from shim.cli import parser
    from shim.mesh import signer

    example = _one("Secret", "mesh-ca-secret.example.yaml")
    mounting = [(name, d["kind"]) for name, _, d in ALL if d["kind"] in ("DaemonSet", "Deployment")
                for v in d["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert mounting == [(SIGNER, "Deployment")]
    deploy = _one("Deployment", SIGNER)
    pod = deploy["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if "emptyDir" not in v]
    assert vol["secret"]["secretName"] == example["metadata"]["name"]
    (c,) = pod["containers"]
    args = parser().parse_args(c["args"])
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}[vol["name"]] == str(args.ca_dir)
    # Two signers, spread over nodes, one at a time taken by a rollout or a drain: a renewal always finds one.
    assert deploy["spec"]["replicas"] == 2 and deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 1
    (spread,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    budget = _one("PodDisruptionBudget", SIGNER)
    assert budget["spec"] == {"minAvailable": 1, "selector": deploy["spec"]["selector"]}
    assert pod["serviceAccountName"] == _one("ServiceAccount", SIGNER)[
        "metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["image"] == build.DEFAULT_NAME

    assert signer.init_ca(tmp_path / "made") == 0
    assert set(example["data"]) == {p.name for p in (tmp_path / "made").iterdir()}
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    for key in example["data"]:
        (mounted / key).write_bytes((tmp_path / "made" / key).read_bytes())
    signer.Signer(None, (mounted / "ca.key").read_bytes(), (mounted / "ca.crt").read_bytes())  # a usable CA pair


def test_signer_rbac_approves_and_signs_for_weft_io_mesh_only_and_nodes_only_ask():
    rules: dict[str, set] = {}
    for name, _, d in ALL:
        if name == SIGNER and d["kind"] == "ClusterRole":
            for r in d["rules"]:
                for group in r["apiGroups"]:
                    for res in r["resources"]:
                        key = (d["metadata"]["name"], group, res, tuple(r.get("resourceNames", ())))
                        rules.setdefault(key, set()).update(r["verbs"])
    g = "certificates.k8s.io"
    assert rules == {
        ("weft-mesh-signer", g, "certificatesigningrequests", ()): {"get", "list", "watch"},
        ("weft-mesh-signer", g, "certificatesigningrequests/approval", ()): {"update"},
        ("weft-mesh-signer", g, "certificatesigningrequests/status", ()): {"update"},
        ("weft-mesh-signer", g, "signers", ("weft.io/mesh",)): {"approve", "sign"},
        ("weft-mesh-signer", "", "nodes", ()): {"get"},
        ("weft-mesh-node", g, "certificatesigningrequests", ()): {"create", "get", "list", "watch"},
    }
    sa = _one("ServiceAccount", SIGNER)["metadata"]
    bound = {b["roleRef"]["name"]: [(s["kind"], s.get("namespace"), s["name"]) for s in b["subjects"]]
             for name, _, b in ALL if name == SIGNER and b["kind"] == "ClusterRoleBinding"}
    assert bound == {"weft-mesh-signer": [("ServiceAccount", sa["namespace"], sa["name"])],
                     "weft-mesh-node": [("Group", None, "system:nodes")]}
