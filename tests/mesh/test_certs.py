"""The mesh CA and node certificates: names, usages, chain, file modes, CA reuse and reruns."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID

from shim.errors import ConfigError
from shim.mesh import certs


@pytest.fixture(scope="module")
def ca() -> tuple[bytes, bytes]:
    return certs.generate_ca()


def _cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def _sans(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A permissive umask, so a key that comes out 0600 does so because weft made it so."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_node_cert_names_its_node_by_dns_and_uri_plus_extra_addresses(ca: tuple[bytes, bytes]) -> None:
    _, pem = certs.issue_node_cert(*ca, "gpu-1", ["127.0.0.1", "10.0.0.7", "gpu-1.cluster.local", "::1"])
    sans = _sans(_cert(pem))
    assert sans.get_values_for_type(x509.DNSName) == ["gpu-1", "gpu-1.cluster.local"]
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == ["weft://node/gpu-1"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"),
                                                         ipaddress.ip_address("10.0.0.7"), ipaddress.ip_address("::1")]
    assert certs.cert_nodes(pem) == ["gpu-1"]


def test_node_cert_serves_and_dials_but_cannot_sign(ca: tuple[bytes, bytes]) -> None:
    _, pem = certs.issue_node_cert(*ca, "cpu-1")
    cert = _cert(pem)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign is False


def test_ca_is_a_ca_that_signs_only_leaves(ca: tuple[bytes, bytes]) -> None:
    constraints = _cert(ca[1]).extensions.get_extension_for_class(x509.BasicConstraints).value
    assert (constraints.ca, constraints.path_length) == (True, 0)


def test_node_cert_verifies_as_server_and_client_against_its_ca_only(ca: tuple[bytes, bytes]) -> None:
    _, pem = certs.issue_node_cert(*ca, "cpu-1", ["127.0.0.1"])
    leaf = _cert(pem)
    store = verification.Store([_cert(ca[1])])
    verification.PolicyBuilder().store(store).build_server_verifier(verification.DNSName("cpu-1")).verify(leaf, [])
    verification.PolicyBuilder().store(store).build_server_verifier(
        verification.IPAddress(ipaddress.ip_address("127.0.0.1"))).verify(leaf, [])
    client = verification.PolicyBuilder().store(store).build_client_verifier().verify(leaf, [])
    assert x509.UniformResourceIdentifier("weft://node/cpu-1") in (client.subjects or [])

    with pytest.raises(verification.VerificationError):
        verification.PolicyBuilder().store(store).build_server_verifier(verification.DNSName("cpu-2")).verify(leaf, [])
    other = verification.Store([_cert(certs.generate_ca()[1])])
    with pytest.raises(verification.VerificationError):
        verification.PolicyBuilder().store(other).build_client_verifier().verify(leaf, [])


def test_validity_defaults_to_a_year_for_nodes_and_ten_for_the_ca(ca: tuple[bytes, bytes]) -> None:
    _, pem = certs.issue_node_cert(*ca, "n1")
    assert 364 <= (_cert(pem).not_valid_after_utc - dt.datetime.now(dt.UTC)).days <= 365
    assert 3649 <= (_cert(ca[1]).not_valid_after_utc - dt.datetime.now(dt.UTC)).days <= 3650
    _, short = certs.issue_node_cert(*ca, "n1", valid_days=2)
    assert (_cert(short).not_valid_after_utc - dt.datetime.now(dt.UTC)).days == 1


def test_node_cert_never_outlives_its_ca() -> None:
    ca = certs.generate_ca(valid_days=30)
    _, pem = certs.issue_node_cert(*ca, "n1", valid_days=365)
    assert _cert(pem).not_valid_after_utc <= _cert(ca[1]).not_valid_after_utc


@pytest.mark.parametrize("name", ["GPU-1", "../etc/passwd", "a_b", "", "-a", "a b"],
                         ids=["upper-case", "path", "underscore", "empty", "leading-dash", "space"])
def test_a_name_that_is_not_a_node_name_is_refused_naming_it(ca: tuple[bytes, bytes], name: str) -> None:
    with pytest.raises(ConfigError, match="node name"):
        certs.issue_node_cert(*ca, name)


def test_mismatched_ca_key_is_refused(ca: tuple[bytes, bytes]) -> None:
    other_key, _ = certs.generate_ca()
    with pytest.raises(ConfigError, match="does not belong"):
        certs.issue_node_cert(other_key, ca[1], "n1")


def test_write_mesh_certs_writes_ca_and_node_pairs_keys_private(tmp_path: Path, open_umask: None) -> None:
    out = tmp_path / "mesh"
    paths = certs.write_mesh_certs(out, ["gpu-1", "cpu-1"], {"cpu-1": ["10.0.0.2"]})
    assert sorted(paths) == ["ca.crt", "ca.key", "cpu-1.crt", "cpu-1.key", "gpu-1.crt", "gpu-1.key"]
    assert sorted(p.name for p in out.iterdir()) == sorted(paths)
    for name, path in paths.items():
        assert _mode(path) == (0o600 if name.endswith(".key") else 0o644), name
    ca_cert = _cert(paths["ca.crt"].read_bytes())
    for node in ("gpu-1", "cpu-1"):
        leaf = _cert(paths[f"{node}.crt"].read_bytes())
        leaf.verify_directly_issued_by(ca_cert)
        key = serialization.load_pem_private_key(paths[f"{node}.key"].read_bytes(), None)
        assert key.public_key() == leaf.public_key()
    assert ipaddress.ip_address("10.0.0.2") in _sans(_cert(paths["cpu-1.crt"].read_bytes())).get_values_for_type(
        x509.IPAddress)


def test_rerun_changes_nothing(tmp_path: Path) -> None:
    first = {name: p.read_bytes() for name, p in certs.write_mesh_certs(tmp_path, ["a", "b"], {"a": ["1.2.3.4"]})
             .items()}
    second = {name: p.read_bytes() for name, p in certs.write_mesh_certs(tmp_path, ["a", "b"], {"a": ["1.2.3.4"]})
              .items()}
    assert first == second


def test_adding_a_node_keeps_the_ca_and_the_other_nodes(tmp_path: Path) -> None:
    before = {name: p.read_bytes() for name, p in certs.write_mesh_certs(tmp_path, ["a"]).items()}
    after = certs.write_mesh_certs(tmp_path, ["a", "b"])
    assert {name: after[name].read_bytes() for name in before} == before
    _cert(after["b.crt"].read_bytes()).verify_directly_issued_by(_cert(before["ca.crt"]))


def test_changed_addresses_reissue_that_node_only(tmp_path: Path) -> None:
    before = {name: p.read_bytes() for name, p in certs.write_mesh_certs(tmp_path, ["a", "b"]).items()}
    after = {name: p.read_bytes() for name, p in
             certs.write_mesh_certs(tmp_path, ["a", "b"], {"a": ["10.1.1.1"]}).items()}
    assert after["a.crt"] != before["a.crt"] and after["a.key"] != before["a.key"]
    assert {k: after[k] for k in ("ca.crt", "ca.key", "b.crt", "b.key")} == {
        k: before[k] for k in ("ca.crt", "ca.key", "b.crt", "b.key")}


def test_a_node_cert_close_to_expiry_is_renewed(tmp_path: Path) -> None:
    certs.write_mesh_certs(tmp_path, ["a"], valid_days=3)
    old = (tmp_path / "a.crt").read_bytes()
    # A rerun asking for a year finds one of three days: less than a third left, so it renews.
    certs.write_mesh_certs(tmp_path, ["a"])
    assert (tmp_path / "a.crt").read_bytes() != old
    assert (_cert((tmp_path / "a.crt").read_bytes()).not_valid_after_utc - dt.datetime.now(dt.UTC)).days >= 364


def test_a_loosened_key_mode_is_tightened_on_rerun(tmp_path: Path) -> None:
    paths = certs.write_mesh_certs(tmp_path, ["a"])
    paths["a.key"].chmod(0o644)
    paths["ca.key"].chmod(0o644)
    certs.write_mesh_certs(tmp_path, ["a"])
    assert (_mode(paths["a.key"]), _mode(paths["ca.key"])) == (0o600, 0o600)


def test_a_ca_certificate_without_its_key_is_not_replaced(tmp_path: Path) -> None:
    paths = certs.write_mesh_certs(tmp_path, ["a"])
    ca_pem = paths["ca.crt"].read_bytes()
    paths["ca.key"].unlink()
    with pytest.raises(ConfigError, match=r"ca\.key is missing"):
        certs.write_mesh_certs(tmp_path, ["a", "b"])
    assert paths["ca.crt"].read_bytes() == ca_pem


def test_addresses_for_an_unlisted_node_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not listed"):
        certs.write_mesh_certs(tmp_path, ["a"], {"b": ["10.0.0.1"]})


def test_main_says_what_it_wrote_and_what_it_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert certs.main(tmp_path, ["a"]) == 0
    first = capsys.readouterr().out
    assert f"wrote {tmp_path / 'ca.key'}" in first and f"wrote {tmp_path / 'a.crt'}" in first
    assert certs.main(tmp_path, ["a", "b"], {"b": ["10.0.0.2"]}) == 0
    second = capsys.readouterr().out
    assert f"kept  {tmp_path / 'ca.key'}" in second and f"kept  {tmp_path / 'a.crt'}" in second
    assert f"wrote {tmp_path / 'b.crt'}" in second


def test_main_without_nodes_says_how_to_name_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--node"):
        certs.main(tmp_path, [])


@pytest.mark.parametrize(("spec", "parsed"), [
    pytest.param("gpu-1", ("gpu-1", []), id="name-only"),
    pytest.param("gpu-1=10.0.0.1", ("gpu-1", ["10.0.0.1"]), id="one-address"),
    pytest.param("gpu-1=10.0.0.1, gpu-1.lan,", ("gpu-1", ["10.0.0.1", "gpu-1.lan"]), id="several-addresses"),
])
def test_node_flag_parses_name_and_addresses(spec: str, parsed: tuple[str, list[str]]) -> None:
    assert certs.parse_node_spec(spec) == parsed


def test_load_node_tls_reads_the_pair_and_refuses_another_nodes_cert(tmp_path: Path) -> None:
    certs.write_mesh_certs(tmp_path, ["a", "b"])
    tls = certs.load_node_tls(tmp_path, "a")
    assert tls.ca_pem == (tmp_path / "ca.crt").read_bytes() and certs.cert_nodes(tls.cert_pem) == ["a"]
    (tmp_path / "a.crt").write_bytes((tmp_path / "b.crt").read_bytes())
    with pytest.raises(ConfigError, match=r"names \['b'\], not node 'a'"):
        certs.load_node_tls(tmp_path, "a")
    with pytest.raises(ConfigError, match="cannot be read"):
        certs.load_node_tls(tmp_path, "c")
