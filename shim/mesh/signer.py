"""The mesh signer (``weft mesh-signer``): signs nodes' mesh certificates through the Kubernetes CSR API.

It runs as a Deployment of two replicas on different nodes, the only
workload that mounts the mesh CA's key (the ``weft-mesh-ca`` Secret), so a
node's renewal does not wait for a signer to come back. Replicas need no
leader: each update carries the resourceVersion it read, so when two decide
the same request at once the API takes one and answers the other 409
Conflict, which is logged as ``mesh.signer.raced`` and dropped (the winner's
update arrives as the next event, and is then nothing to do). It lists and watches the
CertificateSigningRequests whose ``spec.signerName`` is ``weft.io/mesh``,
and for each one neither issued nor refused yet reads what it says
(``shim.mesh.csr.facts``), asks the API whether the requesting node is still
a Node, and decides with ``shim.core.meshcsr.decide``:

- signed: an ``Approved`` condition (reason ``WeftMeshNodeVerified``), then
  ``status.certificate``: the node's certificate (for the request's public
  key, with the names a mesh certificate has and nothing else the request
  may have asked for) followed by the CA's, for the lifetime the node asked
  (``spec.expirationSeconds``), at most ``max_lifetime_s``;
- refused: a ``Denied`` condition with the rule's reason and a message that
  says why (``RequesterNotANode``, ``NodeMismatch``, ``NodeNotInCluster``,
  ...).

Every decision is logged (``mesh.signer.signed``, ``mesh.signer.denied``).
A CSR already approved but not signed (a signer that stopped in between) is
decided again and signed. Its RBAC lets it approve and sign for the
``weft.io/mesh`` signer only (``nodeimage/manifests/signer.yaml``).
"""

from __future__ import annotations

import base64
import datetime as dt
import threading
import time
from pathlib import Path

import lightkube
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.certificates_v1 import CertificateSigningRequestCondition
from lightkube.resources.certificates_v1 import (
    CertificateSigningRequest,
    CertificateSigningRequestApproval,
    CertificateSigningRequestStatus,
)
from lightkube.resources.core_v1 import Node

from shim import log, stopping
from shim.core.meshcsr import SIGNER_NAME, Decision, decide, lifetime_s, requester_node
from shim.errors import ConfigError
from shim.mesh import certs, csr

_log = log.get("weft.mesh")

DEFAULT_MAX_LIFETIME_S = 3600
MIN_MAX_LIFETIME_S = 10
RELIST_S = 60.0
RETRY_S = 2.0
# A certificate shorter-lived than this is backdated by a tenth of its life, not the usual minutes.
_SHORT = dt.timedelta(hours=1)


class Signer:
    def __init__(self, client: lightkube.Client, ca_key_pem: bytes, ca_cert_pem: bytes, *,
                 max_lifetime_s: int = DEFAULT_MAX_LIFETIME_S) -> None:
        if max_lifetime_s < MIN_MAX_LIFETIME_S:
            raise ConfigError(f"mesh-signer: --max-lifetime {max_lifetime_s} is under {MIN_MAX_LIFETIME_S} s")
        certs.load_ca(ca_key_pem, ca_cert_pem)  # ConfigError when they are not a pair
        self.client = client
        self.ca_key_pem, self.ca_cert_pem = ca_key_pem, ca_cert_pem
        self.max_lifetime_s = max_lifetime_s

    # -- one request -----------------------------------------------------------------------------------------
    def handle(self, obj: CertificateSigningRequest) -> Decision | None:
        """Decide one CSR and act on it; None when it is not ours or already issued or refused."""
        spec = obj.spec
        if spec.signerName != SIGNER_NAME:
            return None
        status = obj.status
        if status is not None and status.certificate:
            return None
        kinds = {c.type for c in (status.conditions or [])} if status is not None else set()
        if kinds & {"Denied", "Failed"}:
            return None
        request = base64.b64decode(spec.request)
        facts = csr.facts(request, spec.username or "", spec.groups or [], spec.usages or [])
        node = requester_node(facts.username, facts.groups)
        decision = decide(facts, bool(node) and self._node_exists(node))
        name = obj.metadata.name
        if not decision.approved:
            self._condition(obj, "Denied", decision)
            _log.warning("mesh.signer.denied", csr=name, requester=facts.username, reason=str(decision.reason),
                         message=decision.message)
            return decision
        if "Approved" not in kinds:
            obj = self._condition(obj, "Approved", decision)
        seconds = lifetime_s(spec.expirationSeconds, self.max_lifetime_s)
        life = dt.timedelta(seconds=seconds)
        cert = certs.sign_node_cert(self.ca_key_pem, self.ca_cert_pem, node, csr.public_key_of(request),
                                    not_after=dt.datetime.now(dt.UTC) + life,
                                    backdate=min(certs.BACKDATE, life / 10) if life < _SHORT else certs.BACKDATE)
        obj.status.certificate = base64.b64encode(cert + self.ca_cert_pem).decode()
        self.client.replace(CertificateSigningRequestStatus.from_dict(obj.to_dict()))
        _log.info("mesh.signer.signed", csr=name, node=node, lifetime_s=seconds)
        return decision

    def _node_exists(self, node: str) -> bool:
        try:
            self.client.get(Node, node)
        except lightkube.ApiError as exc:
            if exc.status.code == 404:
                return False
            raise
        return True

    def _condition(self, obj: CertificateSigningRequest, kind: str, decision: Decision) -> CertificateSigningRequest:
        now = dt.datetime.now(dt.UTC)
        doc = obj.to_dict()
        conditions = [c for c in (doc.get("status") or {}).get("conditions") or [] if c.get("type") != kind]
        cond = CertificateSigningRequestCondition(type=kind, status="True", reason=str(decision.reason),
                                                  message=decision.message, lastUpdateTime=now,
                                                  lastTransitionTime=now)
        doc.setdefault("status", {})
        doc["status"] = {**(doc["status"] or {}), "conditions": [*conditions, cond.to_dict()]}
        got = self.client.replace(CertificateSigningRequestApproval.from_dict(doc))
        return CertificateSigningRequest.from_dict(got.to_dict())

    # -- the loop ----------------------------------------------------------------------------------------------
    def sweep(self) -> str:
        """Decide every pending CSR of ours; returns the list's resourceVersion (to watch from)."""
        listing = self.client.list(CertificateSigningRequest, fields={"spec.signerName": SIGNER_NAME})
        for obj in listing:
            self._handle_logged(obj)
        return listing.resourceVersion

    def _handle_logged(self, obj: CertificateSigningRequest) -> None:
        try:
            self.handle(obj)
        except lightkube.ApiError as exc:
            if exc.status.code == 409:  # another replica (or update) came first: its change is the next event
                _log.info("mesh.signer.raced", csr=obj.metadata.name)
                return
            _log.warning("mesh.signer.failed", csr=obj.metadata.name, error=exc.status.message)

    def run(self, stop: threading.Event) -> None:
        """List, then watch from the list, until ``stop``; relist every ``RELIST_S`` and after any error."""
        while not stop.is_set():
            try:
                version = self.sweep()
                until = time.monotonic() + RELIST_S
                for _kind, obj in self.client.watch(CertificateSigningRequest, resource_version=version,
                                                    fields={"spec.signerName": SIGNER_NAME},
                                                    server_timeout=int(RELIST_S)):
                    if stop.is_set() or time.monotonic() > until:
                        break
                    self._handle_logged(obj)
            except Exception as exc:  # noqa: BLE001 - the API away, a watch cut: list again shortly
                _log.warning("mesh.signer.failed", csr=None, error=str(exc) or type(exc).__name__)
                stop.wait(RETRY_S)


def init_ca(ca_dir: Path) -> int:
    """``weft mesh-signer --init-ca``: a new mesh CA in ``ca_dir`` (kept if one is there), for the CA Secret."""

    ca_dir = Path(ca_dir)
    key_path, cert_path = ca_dir / "ca.key", ca_dir / "ca.crt"
    if key_path.exists() and cert_path.exists():
        certs.load_ca(key_path.read_bytes(), cert_path.read_bytes())
        print(f"kept  {cert_path} and {key_path}")
        return 0
    if key_path.exists() or cert_path.exists():
        raise ConfigError(f"mesh-signer: only one of {key_path} and {cert_path} is there; remove it or restore "
                          "its pair")
    ca_dir.mkdir(parents=True, exist_ok=True)
    key, cert = certs.generate_ca()
    certs.write_file(key_path, key, 0o600)
    certs.write_file(cert_path, cert, 0o644)
    print(f"wrote {cert_path} and {key_path}; put both in the weft-mesh-ca Secret (mesh-ca-secret.example.yaml)")
    return 0


def main(ca_dir: Path, max_lifetime_s: int, kubeconfig: Path | None = None) -> int:
    """``weft mesh-signer``: sign until SIGTERM, as the signer's service account (or ``kubeconfig``)."""
    try:
        key, cert = (Path(ca_dir) / "ca.key").read_bytes(), (Path(ca_dir) / "ca.crt").read_bytes()
    except OSError as exc:
        raise ConfigError(f"mesh-signer: the CA cannot be read from --ca-dir {ca_dir}: {exc}") from exc
    client = lightkube.Client(config=KubeConfig.from_file(kubeconfig)) if kubeconfig else lightkube.Client()
    signer = Signer(client, key, cert, max_lifetime_s=max_lifetime_s)
    _log.info("mesh.signer.started", signer=SIGNER_NAME, max_lifetime_s=max_lifetime_s)
    # The loop waits in a watch, on a thread of its own; the main thread takes the signal (shim.stopping).
    return stopping.serve(signer.run, name="weft-mesh-signer") or 0
