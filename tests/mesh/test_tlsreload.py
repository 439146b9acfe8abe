"""The agent's mesh TLS reloads a renewed certificate (shim.mesh.tlsreload), and refuses a mismatched set."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest
from cryptography import x509

from shim.mesh import certs, csr
from shim.mesh.enroll import write_file
from shim.mesh.tlsreload import NodeTls
from shim.mesh.tunnel.ends import contexts


def _issue(ca: tuple[bytes, bytes], out: Path, node: str, key: bytes) -> bytes:
    cert = certs.sign_node_cert(*ca, node, csr.load_key(key).public_key(),
                                not_after=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
    write_file(out / f"{node}.crt", cert, 0o644)
    return cert


@pytest.fixture
def tls_dir(tmp_path: Path) -> tuple[Path, tuple[bytes, bytes], bytes]:
    ca_key, ca_cert = certs.generate_ca()
    key = csr.new_key()
    write_file(tmp_path / "ca.crt", ca_cert, 0o644)
    write_file(tmp_path / "n1.key", key, 0o600)
    _issue((ca_key, ca_cert), tmp_path, "n1", key)
    return tmp_path, (ca_key, ca_cert), key


def _bump(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_a_renewed_certificate_is_handed_out_after_the_files_change(tls_dir) -> None:
    out, ca, key = tls_dir
    tls = NodeTls(out, "n1", check_s=0)
    first = tls.current().cert_pem
    assert tls.current().cert_pem == first and tls.generation == 0  # nothing changed: nothing reloaded
    second = _issue(ca, out, "n1", key)
    _bump(out / "n1.crt")
    key_pem, cert_pem, ca_pem = tls  # as a peer client unpacks it
    assert cert_pem == second != first and tls.generation == 1 and ca_pem == ca[1] and key_pem == key


def test_a_certificate_for_another_key_is_not_taken_and_the_old_one_stays(tls_dir) -> None:
    out, ca, _ = tls_dir
    tls = NodeTls(out, "n1", check_s=0)
    first = tls.current().cert_pem
    _issue(ca, out, "n1", csr.new_key())  # the key file still holds the old key
    _bump(out / "n1.crt")
    assert tls.current().cert_pem == first and tls.generation == 0


def test_the_server_credentials_and_tunnel_contexts_follow_the_files(tls_dir) -> None:
    out, ca, key = tls_dir
    tls = NodeTls(out, "n1", check_s=0)
    tls.server_credentials()  # builds from the current set
    _, client_ctx = contexts(out, "n1")
    before = client_ctx.context()
    assert client_ctx.context() is before
    _issue(ca, out, "n1", key)
    _bump(out / "n1.crt")
    client_ctx.source.check_s = 0
    client_ctx.source._checked = 0.0
    assert client_ctx.context() is not before


def test_split_issued_gives_the_node_s_certificate_and_the_ca(tls_dir) -> None:
    out, ca, _ = tls_dir
    node = (out / "n1.crt").read_bytes()
    got = csr.split_issued(node + ca[1])
    assert got == (node, ca[1])
    assert x509.load_pem_x509_certificate(got[0]).subject.rfc4514_string() == "CN=n1"
    with pytest.raises(ValueError, match="PEM blocks"):
        csr.split_issued(node)
