"""A node's certificate keeper (shim.mesh.enroll), with the CSR API replaced by an in-memory signer."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from lightkube.resources.certificates_v1 import CertificateSigningRequest

from shim.core.meshcsr import Reason
from shim.mesh import certs, csr
from shim.mesh.enroll import CertificateDenied, Enroller
from shim.mesh.signer import Signer


class Api:
    """Creates CSRs and has a Signer (as node ``user``) decide them at once."""

    def __init__(self, user: str, present: set[str]) -> None:
        self.user, self.present = user, present
        ca_key, self.ca = certs.generate_ca()
        outer = self

        class _Signer(Signer):
            def _node_exists(self, node: str) -> bool:
                return node in outer.present

        self.signer = _Signer(self, ca_key, self.ca)
        self.objects: dict[str, CertificateSigningRequest] = {}

    def create(self, obj):
        doc = obj.to_dict()
        doc["metadata"]["name"] = f"csr-{len(self.objects)}"
        doc["spec"].update(username=self.user, groups=["system:nodes"])
        made = CertificateSigningRequest.from_dict(doc)
        self.objects[made.metadata.name] = made
        self.signer.handle(made)
        return made

    def replace(self, obj):
        self.objects[obj.metadata.name] = CertificateSigningRequest.from_dict(obj.to_dict())
        return obj

    def get(self, _kind, name):
        return self.objects[name]


def _enroller(api: Api, out: Path, node: str = "cpu-1") -> Enroller:
    return Enroller(api, out, node, retry_s=0.01, wait_s=1.0, poll_s=0.01)  # type: ignore[arg-type]


def test_the_key_is_made_here_once_0600_and_a_fresh_certificate_is_kept(tmp_path: Path) -> None:
    api = Api("system:node:cpu-1", {"cpu-1"})
    out = tmp_path / "mesh"
    _enroller(api, out).run(threading.Event(), once=True)
    key = (out / "cpu-1.key").read_bytes()
    assert (out / "cpu-1.key").stat().st_mode & 0o777 == 0o600 and out.stat().st_mode & 0o777 == 0o700
    assert (out / "ca.crt").read_bytes() == api.ca
    tls = certs.load_node_tls(out, "cpu-1")
    assert csr.load_key(tls.key_pem).public_key() == csr.load_key(key).public_key()
    asked = len(api.objects)
    _enroller(api, out).run(threading.Event(), once=True)  # not due yet: nothing asked, the key kept
    assert len(api.objects) == asked and (out / "cpu-1.key").read_bytes() == key


def test_an_unreadable_key_is_replaced_by_a_new_one_made_here(tmp_path: Path) -> None:
    api = Api("system:node:cpu-1", {"cpu-1"})
    out = tmp_path / "mesh"
    out.mkdir()
    (out / "cpu-1.key").write_bytes(b"garbage")
    _enroller(api, out).run(threading.Event(), once=True)
    csr.load_key((out / "cpu-1.key").read_bytes())


@pytest.mark.parametrize(("user", "present", "reason"), [
    ("system:node:gpu-1", {"cpu-1", "gpu-1"}, Reason.OTHER_NODE),  # another node's kubelet asking for cpu-1
    ("system:node:cpu-1", set(), Reason.NOT_IN_CLUSTER),  # removed
])
def test_a_refusal_is_raised_with_its_reason_and_nothing_is_written(tmp_path: Path, user: str, present: set[str],
                                                                    reason: Reason) -> None:
    out = tmp_path / "mesh"
    with pytest.raises(CertificateDenied) as refused:
        _enroller(Api(user, present), out).run(threading.Event(), once=True)
    assert refused.value.reason == str(reason)
    assert sorted(p.name for p in out.iterdir()) == ["cpu-1.key"]
