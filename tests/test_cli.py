"""The command-line contract that outside checks rely on."""

import pytest

from shim.cli import main, parser


def test_agent_flags_of_the_contract() -> None:
    args = parser().parse_args(["agent", "--socket", "/run/w.sock", "--containerd-socket", "/run/c.sock",
                                "--state-dir", "/var/lib/w", "--metrics-address", "127.0.0.1:1",
                                "--config", "/etc/weft.toml"])
    assert (str(args.socket), str(args.containerd_socket), str(args.state_dir)) == (
        "/run/w.sock", "/run/c.sock", "/var/lib/w")
    assert args.metrics_address == "127.0.0.1:1" and str(args.config) == "/etc/weft.toml"


def test_bench_proxy_json_flag() -> None:
    args = parser().parse_args(["bench", "proxy", "--json"])
    assert args.what == "proxy" and args.json


def test_weft_errors_are_one_line_and_exit_2(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["agent", "--config", str(tmp_path / "missing.toml")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("weft agent: config file") and "missing.toml" in err


def test_mesh_certs_with_the_contract_flags(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mesh-certs", "--out", str(tmp_path), "--nodes", "gpu-1,cpu-1,cpu-2"]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {
        "ca.crt", "ca.key", *(f"{n}.{ext}" for n in ("gpu-1", "cpu-1", "cpu-2") for ext in ("crt", "key"))}


def test_mesh_certs_without_nodes_says_how(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mesh-certs", "--out", str(tmp_path)]) == 2
    assert "--nodes a,b,c" in capsys.readouterr().err
