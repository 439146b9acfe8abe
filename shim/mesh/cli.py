"""``weft mesh-signer`` and ``weft mesh-identity``: mesh certificates through the Kubernetes CSR API.

``weft mesh-signer`` signs (``shim.mesh.signer``, a Deployment with the CA);
``weft mesh-identity`` keeps one node's certificate (``shim.mesh.enroll``,
the DaemonSet, with the kubelet's credentials).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

KUBELET_KUBECONFIG = "/etc/kubernetes/kubelet.conf"


def _signer(args: argparse.Namespace) -> int:
    from shim import log
    from shim.mesh import signer

    if args.init_ca:
        return signer.init_ca(args.ca_dir)
    log.configure("info")
    return signer.main(args.ca_dir, args.max_lifetime, args.kubeconfig)


def _identity(args: argparse.Namespace) -> int:
    from shim import log
    from shim.errors import ConfigError
    from shim.mesh import enroll

    log.configure("info")
    if not args.node_name:
        raise ConfigError("mesh-identity: name the node (--node-name, or WEFT_NODE_NAME)")
    return enroll.main(args.dir, args.node_name, args.kubeconfig, lifetime_s=args.lifetime, share=args.renew_at,
                       once=args.once, timeout_s=args.timeout)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from shim.mesh import enroll, signer

    s = sub.add_parser("mesh-signer", help="sign nodes' mesh certificates requested through the CSR API "
                       "(signerName weft.io/mesh), checking that each node asks for itself")
    s.add_argument("--ca-dir", type=Path, default=Path("/etc/weft/ca"), help="ca.crt and ca.key of the mesh CA "
                   "(default /etc/weft/ca, the weft-mesh-ca Secret)")
    s.add_argument("--max-lifetime", type=int, default=signer.DEFAULT_MAX_LIFETIME_S,
                   help=f"the longest a certificate lasts, in seconds (default {signer.DEFAULT_MAX_LIFETIME_S}); "
                   "a node asking for less gets what it asked")
    s.add_argument("--kubeconfig", type=Path, help="ask the API as this kubeconfig's user (default: the pod's "
                   "service account)")
    s.add_argument("--init-ca", action="store_true", help="make a new mesh CA in --ca-dir (kept if one is there), "
                   "then exit")
    s.set_defaults(fn=_signer)

    i = sub.add_parser("mesh-identity", help="make this node's mesh key here and keep its certificate, asked of "
                       "the mesh signer with the kubelet's credentials (run by the DaemonSet)")
    i.add_argument("--dir", type=Path, default=Path("/etc/weft/mesh"), help="where the key (0600), the "
                   "certificate and ca.crt go: the agent's mesh.tls_dir (default /etc/weft/mesh)")
    i.add_argument("--node-name", default=os.environ.get("WEFT_NODE_NAME") or None,
                   help="this node's name (WEFT_NODE_NAME)")
    i.add_argument("--kubeconfig", type=Path, default=Path(os.environ.get("WEFT_KUBELET_KUBECONFIG")
                                                           or KUBELET_KUBECONFIG),
                   help=f"the kubelet's kubeconfig (default {KUBELET_KUBECONFIG}, or WEFT_KUBELET_KUBECONFIG)")
    i.add_argument("--lifetime", type=int, default=enroll.DEFAULT_LIFETIME_S,
                   help=f"seconds asked for each certificate (default {enroll.DEFAULT_LIFETIME_S}; the API "
                   "server's minimum is 600; the signer may give less)")
    i.add_argument("--renew-at", type=float, default=enroll.DEFAULT_SHARE,
                   help="renew when this share of a certificate's life has passed (default 0.67)")
    i.add_argument("--once", action="store_true", help="return once the node has a certificate not yet due for "
                   "renewal (the init container before weft install)")
    i.add_argument("--timeout", type=float, default=300.0, help="with --once: give up after this many seconds "
                   "of failures (default 300)")
    i.set_defaults(fn=_identity)
