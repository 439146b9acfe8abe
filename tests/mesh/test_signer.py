"""The mesh signer's handling of one CSR (shim.mesh.signer), with the API replaced by a recorder."""

from __future__ import annotations

import base64

import lightkube
from cryptography import x509
from lightkube.models.meta_v1 import Status
from lightkube.resources.certificates_v1 import CertificateSigningRequest
from structlog.testing import capture_logs

from shim.core.meshcsr import SIGNER_NAME, Reason
from shim.mesh import certs, csr
from shim.mesh.signer import Signer


class Recorder:
    def __init__(self) -> None:
        self.replaced: list = []

    def replace(self, obj):
        self.replaced.append(obj)
        return obj


class Nodes(Signer):
    present = {"cpu-1"}

    def _node_exists(self, node: str) -> bool:
        return node in self.present


def _csr(node: str = "cpu-1", user: str = "system:node:cpu-1", signer: str = SIGNER_NAME, status: dict | None = None,
         key: bytes | None = None) -> CertificateSigningRequest:
    request = csr.request_pem(key or csr.new_key(), node)
    return CertificateSigningRequest.from_dict({
        "metadata": {"name": "weft-mesh-x"},
        "spec": {"request": base64.b64encode(request).decode(), "signerName": signer, "username": user,
                 "groups": ["system:nodes", "system:authenticated"], "expirationSeconds": 600,
                 "usages": ["digital signature", "server auth", "client auth"]},
        "status": status or {}})


def _signer() -> tuple[Nodes, Recorder, bytes]:
    ca_key, ca_cert = certs.generate_ca()
    api = Recorder()
    return Nodes(api, ca_key, ca_cert, max_lifetime_s=3600), api, ca_cert


def test_a_node_s_own_request_is_approved_then_signed_for_its_key_with_the_ca_after() -> None:
    signer, api, ca = _signer()
    key = csr.new_key()
    decision = signer.handle(_csr(key=key))
    assert decision is not None and decision.approved
    approval, status = api.replaced
    assert [(c.type, c.reason) for c in approval.status.conditions] == [("Approved", str(Reason.APPROVED))]
    cert_pem, ca_pem = csr.split_issued(base64.b64decode(status.status.certificate))
    assert ca_pem == ca
    cert = x509.load_pem_x509_certificate(cert_pem)
    assert cert.public_key() == csr.load_key(key).public_key()
    assert certs.cert_nodes(cert_pem) == ["cpu-1"]
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert 600 <= life.total_seconds() <= 600 + certs.BACKDATE.total_seconds()  # what the node asked for


def test_refusals_get_a_denied_condition_with_the_reason_and_no_certificate() -> None:
    signer, api, _ = _signer()
    assert signer.handle(_csr(node="gpu-1")).reason == Reason.OTHER_NODE
    signer.present = set()
    assert signer.handle(_csr()).reason == Reason.NOT_IN_CLUSTER
    for obj in api.replaced:
        (cond,) = obj.status.conditions
        assert cond.type == "Denied" and cond.message and not obj.status.certificate


def test_other_signers_and_finished_requests_are_left_alone_and_an_approved_unsigned_one_is_signed() -> None:
    signer, api, _ = _signer()
    assert signer.handle(_csr(signer="kubernetes.io/kube-apiserver-client")) is None
    assert signer.handle(_csr(status={"certificate": "eA=="})) is None
    assert signer.handle(_csr(status={"conditions": [{"type": "Denied", "status": "True"}]})) is None
    assert api.replaced == []
    approved = {"conditions": [{"type": "Approved", "status": "True", "reason": str(Reason.APPROVED)}]}
    assert signer.handle(_csr(status=approved)).approved
    (status,) = api.replaced  # signed, not approved a second time
    assert status.status.certificate


class Refusing(Recorder):
    """An API that refuses every update with ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__()
        self.code, self.reason = code, reason

    def replace(self, obj):
        raise lightkube.ApiError(status=Status(code=self.code, reason=self.reason, message=f"{self.reason} (test)"))


def test_a_conflict_is_the_other_signer_first_and_is_dropped_while_other_refusals_are_failures() -> None:
    ca_key, ca_cert = certs.generate_ca()
    for code, reason, event, level in ((409, "Conflict", "mesh.signer.raced", "info"),
                                       (403, "Forbidden", "mesh.signer.failed", "warning")):
        signer = Nodes(Refusing(code, reason), ca_key, ca_cert, max_lifetime_s=3600)
        with capture_logs() as logs:
            signer._handle_logged(_csr())
        assert [(e["event"], e["log_level"], e["csr"]) for e in logs] == [(event, level, "weft-mesh-x")]
