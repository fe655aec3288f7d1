"""`broker-coordinator run`, `status` and `rollback` find the config as `devices` and
`broker-config` do: --config, else $EDGEFL_COORDINATOR_CONFIG, else /etc/edgefl/coordinator.toml."""

from broker_coordinator.cli.cli import main
from edgefl_protocol.settings import to_toml


def test_status_reads_the_config_named_by_the_environment(tmp_path, monkeypatch, capsys):
    config = tmp_path / "coordinator.toml"
    config.write_text(to_toml({"federation": {"name": "env", "model": "digits_mlp", "test_data": ""},
                               "broker": {"password": "x"}, "storage": {"state_dir": str(tmp_path / "state")}}))
    monkeypatch.setenv("EDGEFL_COORDINATOR_CONFIG", str(config))
    assert main(["status"]) == 0
    assert "federation 'env'" in capsys.readouterr().out


def test_without_a_config_the_error_names_the_default_path(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("EDGEFL_COORDINATOR_CONFIG", raising=False)
    monkeypatch.setattr("broker_coordinator.cli.operator_cli.DEFAULT_PATH", str(tmp_path / "absent.toml"))
    assert main(["status"]) == 2
    assert f"{tmp_path / 'absent.toml'} does not exist" in capsys.readouterr().err
