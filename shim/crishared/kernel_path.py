"""The stitched pod network through the kernel: nftables rules in a pod's network namespace.

Both sides use it: written here for the origin's side (127.0.0.1 of the origin pod to the
shadow's pod IP); the host uses the same class the other way round, in the
shadow sandbox's namespace, to the origin pod's IP (``shim.shadowhost.tunnel``).

For each port of a shadow that the kernel path carries (``shim.core.datapath``
decides), one table, ``weft_stitch`` (family ip), in the origin sandbox's
namespace holds:

* ``out`` (nat, output, dstnat priority): ``ip daddr 127.0.0.1 tcp dport P
  dnat to <shadow pod IP>``: a connection to localhost:P in the origin pod
  goes straight to the shadow across the pod network;
* ``post`` (nat, postrouting, srcnat priority): ``ip saddr 127.0.0.0/8 oif !=
  lo masquerade``: it leaves with the origin pod's own IP as source, so the
  shadow answers the pod as it would any other pod;
* ``cut`` (filter, output): while the shadow's host does not answer the
  mesh (``peer.lost``), ``ip daddr <shadow pod IP> meta l4proto tcp reject
  with tcp reset``: a connection over a cut link ends with a reset within
  the Hello timeout, as the tunnel's 5 s ``TCP_USER_TIMEOUT`` ends it, not
  after TCP's retransmissions run out; removed when the host is back;
* ``guard`` (filter, prerouting, raw priority): ``iif != lo ip daddr
  127.0.0.0/8 drop`` and the same for ``ip saddr``. Forwarding from 127.0.0.1
  needs ``net.ipv4.conf.all.route_localnet = 1`` in the pod's namespace, which
  would otherwise let a packet from the pod network addressed to 127.0.0.1
  reach the pod's loopback-only listeners; the guard drops those before
  routing, so the pod's loopback stays its own.

The reply is translated back by conntrack, so the client in the origin pod
sees 127.0.0.1:P, and no byte passes through an agent. The table is the
whole of weft's state here: it is replaced whole on every change and deleted
with the pod's last remote container (``route_localnet`` back to 0), and
after an agent is killed the next one deletes any table of a pod with no
running remote container when it starts (``sweep``). Rules go through
netlink (pyroute2's nftables), from a thread inside the namespace.

IPv6 (``::1``) and the origin pod's own IP keep the user-space mirror, which
still listens on the port (on every address, or on loopback alone as the
shadow's server does); so does a port the kernel path does not carry.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

from shim import log
from shim.core.datapath import PathDecision, choose_path, needs_probe
from shim.crishared.netns import Netns

_log = log.get("weft.stitch")

TABLE = "weft_stitch"
ROUTE_LOCALNET = "/proc/sys/net/ipv4/conf/all/route_localnet"
PROBE_TIMEOUT_S = 0.5
# A port the probe could not reach is probed again after this long (the shadow may bind its pod IP later).
REPROBE_S = 10.0
_LO = 1  # the loopback interface's index, in every namespace
_NFPROTO_IPV4 = 2


# -- nftables expressions (netlink attributes, as pyroute2 takes them) ---------------------------------------
def _ex(name: str, attrs: dict[str, Any]) -> list[dict]:
    return [{"attrs": [("NFTA_EXPR_NAME", name),
                       ("NFTA_EXPR_DATA", {"attrs": [(f"NFTA_{name.upper()}_{k.upper()}", v)
                                                     for k, v in attrs.items()]})]}]


def _data(value: bytes) -> dict:
    return {"attrs": [("NFTA_DATA_VALUE", value)]}


def _payload(base: int, offset: int, length: int) -> list[dict]:
    return _ex("payload", {"dreg": 1, "base": base, "offset": offset, "len": length})


def _cmp(value: bytes, op: int = 0) -> list[dict]:
    return _ex("cmp", {"sreg": 1, "op": op, "data": _data(value)})


def _meta(key: int) -> list[dict]:
    return _ex("meta", {"dreg": 1, "key": key})


def _in_127(offset: int) -> list[list[dict]]:
    """``ip saddr`` (offset 12) or ``daddr`` (16) in 127.0.0.0/8."""
    return [_payload(1, offset, 4),
            _ex("bitwise", {"sreg": 1, "dreg": 1, "len": 4, "mask": _data(b"\xff\0\0\0"), "xor": _data(b"\0" * 4)}),
            _cmp(b"\x7f\0\0\0")]


def _not_lo(key: int) -> list[list[dict]]:
    """``meta iif`` (key 4) or ``oif`` (5) is not the loopback interface."""
    return [_meta(key), _cmp(struct.pack("=I", _LO), op=1)]


def _drop() -> list[dict]:
    return _ex("immediate", {"dreg": 0, "data": {"attrs": [("NFTA_DATA_VERDICT",
                                                               {"attrs": [("NFTA_VERDICT_CODE", 0)]})]}})


def _forward(port: int, ip: str) -> list[list[dict]]:
    return [_payload(1, 16, 4), _cmp(socket.inet_aton("127.0.0.1")), _meta(16), _cmp(b"\x06"),  # l4proto tcp
            _payload(2, 2, 2), _cmp(struct.pack(">H", port)),
            _ex("immediate", {"dreg": 1, "data": _data(socket.inet_aton(ip))}),
            _ex("nat", {"type": 1, "family": _NFPROTO_IPV4, "reg_addr_min": 1})]


def _nft():  # one netlink socket per change, made and closed in the namespace's thread
    from pyroute2.nftables.main import NFTables

    return NFTables(nfgen_family=_NFPROTO_IPV4)


def _delete_table(nft) -> bool:
    try:
        nft.table("del", name=TABLE)
    except Exception:  # noqa: BLE001 - ENOENT: no table, nothing to delete (pyroute2 raises NetlinkError)
        return False
    return True


def _set_route_localnet(on: bool) -> None:
    with open(ROUTE_LOCALNET, "w") as f:
        f.write("1" if on else "0")


def _reset_to(ip: str) -> list[list[dict]]:
    return [_payload(1, 16, 4), _cmp(socket.inet_aton(ip)), _meta(16), _cmp(b"\x06"),
            _ex("reject", {"type": 1, "icmp_code": 0})]


def install(forwards: dict[int, str], cut: frozenset[str] = frozenset()) -> None:
    """Replace weft's table in the calling thread's namespace with ``forwards`` (port -> pod IP), resetting TCP to
    the pod IPs in ``cut``; no forwards: delete it."""
    nft = _nft()
    try:
        _delete_table(nft)
        if not forwards:
            _set_route_localnet(False)
            return
        nft.table("add", name=TABLE)
        nft.chain("add", table=TABLE, name="guard", hook="prerouting", type="filter", priority=-300)
        nft.chain("add", table=TABLE, name="cut", hook="output", type="filter", priority=0)
        for ip in sorted(cut):
            nft.rule("add", table=TABLE, chain="cut", expressions=tuple(_reset_to(ip)))
        nft.chain("add", table=TABLE, name="out", hook="output", type="nat", priority=-100)
        nft.chain("add", table=TABLE, name="post", hook="postrouting", type="nat", priority=100)
        for offset in (16, 12):
            nft.rule("add", table=TABLE, chain="guard", expressions=(*_not_lo(4), *_in_127(offset), _drop()))
        nft.rule("add", table=TABLE, chain="post",
                 expressions=(*_in_127(12), *_not_lo(5), _ex("masq", {})))
        for port, ip in sorted(forwards.items()):
            nft.rule("add", table=TABLE, chain="out", expressions=tuple(_forward(port, ip)))
        _set_route_localnet(True)  # last: the guard is in place before 127/8 can be routed
    except BaseException:
        _delete_table(nft)
        raise
    finally:
        nft.close()


def remove() -> bool:
    """Delete weft's table in the calling thread's namespace; whether there was one."""
    nft = _nft()
    try:
        had = _delete_table(nft)
    finally:
        nft.close()
    if had:
        _set_route_localnet(False)
    return had


def forget_connections(ips: set[str]) -> None:
    """Drop conntrack's entries of connections to ``ips``: their next packet is no longer sent to a shadow that
    moved or went, and is answered with a reset instead."""
    from pyroute2 import Conntrack
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    ct = Conntrack()
    try:
        for ip in ips:
            for entry in list(ct.dump_entries(tuple_reply=NFCTAttrTuple(saddr=ip, proto=socket.IPPROTO_TCP))):
                try:
                    ct.entry("del", tuple_orig=entry.tuple_orig)
                except Exception:  # noqa: BLE001 - gone already
                    continue
    finally:
        ct.close()


class KernelForwards:
    """The kernel path of one origin pod: which mirrored ports it carries, and its rules in the pod's namespace."""

    def __init__(self, ns: Netns, sandbox_id: str, *, enabled: bool) -> None:
        self.ns, self.sandbox_id, self.enabled = ns, sandbox_id, enabled
        self.decisions: dict[int, tuple[str, str, PathDecision]] = {}  # port -> (pod IP, container, decision)
        self._probed: dict[tuple[int, str], tuple[bool, str, float]] = {}  # (port, ip) -> (ok, error, when)
        self._installed: dict[int, str] | None = None  # None: not known (a killed agent may have left rules)
        self._cut: frozenset[str] = frozenset()
        self._kernel_error = ""
        self._lock = threading.Lock()

    def _probe(self, port: int, ip: str) -> tuple[bool, str]:
        now = time.monotonic()
        seen = self._probed.get((port, ip))
        if seen is not None and (seen[0] or now - seen[2] < REPROBE_S):
            return seen[0], seen[1]
        try:
            self.ns.connect(ip, port, PROBE_TIMEOUT_S).close()
            ok, error = True, ""
        except OSError as exc:
            ok, error = False, exc.strerror or str(exc)
        self._probed[(port, ip)] = (ok, error, now)
        return ok, error

    def update(self, wanted: dict[int, tuple[str, str]], cut: frozenset[str] = frozenset()) -> None:
        """``wanted``: every mirrored port of the pod -> (its shadow's pod IP, container); ``cut``: pod IPs of
        shadows whose host does not answer now. Rules follow."""
        decisions: dict[int, tuple[str, str, PathDecision]] = {}
        for port, (ip, container) in wanted.items():
            if needs_probe(ip, enabled=self.enabled) and not self._kernel_error:
                ok, error = self._probe(port, ip)
                d = choose_path(port, ip, enabled=True, reachable=ok, probe_error=error)
            else:
                d = choose_path(port, ip, enabled=self.enabled, kernel_error=self._kernel_error)
            decisions[port] = (ip, container, d)
        forwards = {port: ip for port, (ip, _, d) in decisions.items() if d.kernel}
        cut = frozenset(ip for ip in cut if ip in forwards.values())
        with self._lock:
            before = dict(self.decisions)
        if forwards != self._installed or cut != self._cut:
            gone = {ip for port, ip in (self._installed or {}).items() if forwards.get(port) != ip}
            try:
                self.ns.run(install, forwards, cut)
            except Exception as exc:  # noqa: BLE001 - no nf_tables, no NAT, no permission: fall back, say why
                self._kernel_error = f"{type(exc).__name__}: {exc}"[:300]
                _log.warning("stitch.kernel_fallback", sandbox_id=self.sandbox_id, error=self._kernel_error)
                self._installed, self._cut = {}, frozenset()
                self.update(wanted)
                return
            if cut != self._cut:
                _log.warning("stitch.kernel_cut", sandbox_id=self.sandbox_id, cut=sorted(cut),
                             restored=sorted(self._cut - cut))
            self._installed, self._cut = forwards, cut
            if gone:
                try:
                    self.ns.run(forget_connections, gone)
                except Exception as exc:  # noqa: BLE001 - they end on their own; only quicker with this
                    _log.info("stitch.conntrack_failed", sandbox_id=self.sandbox_id, error=str(exc))
        with self._lock:  # said (weft explain) only once the rules that carry them are in place
            self.decisions = decisions
        for port, (ip, container, d) in decisions.items():
            old = before.get(port)
            if old is None or old[0] != ip or old[2].reason is not d.reason:
                _log.info("stitch.path", sandbox_id=self.sandbox_id, container=container, port=port, pod_ip=ip,
                          path=d.path, reason=d.reason.value, detail=d.detail)

    def paths(self) -> dict[int, tuple[str, PathDecision]]:
        """Port -> (container, decision), for ``weft explain``."""
        with self._lock:
            return {port: (container, d) for port, (_, container, d) in self.decisions.items()}

    def close(self) -> None:
        if self._installed != {}:
            try:
                self.ns.run(install, {})
            except Exception as exc:  # noqa: BLE001 - the agent's next start sweeps it
                _log.warning("stitch.kernel_cleanup_failed", sandbox_id=self.sandbox_id, error=str(exc))
            self._installed = {}
        with self._lock:
            self.decisions = {}


def sweep(ns: Netns, sandbox_id: str) -> None:
    """At start: remove weft's rules from a pod with no running remote container (left by a killed agent)."""
    try:
        if ns.run(remove):
            _log.info("stitch.kernel_swept", sandbox_id=sandbox_id)
    except Exception as exc:  # noqa: BLE001 - no nf_tables here: there were no rules either
        _log.debug("stitch.kernel_sweep_skipped", sandbox_id=sandbox_id, error=str(exc))
