"""Enrollment: tokens, the single-use handshake against a real Mosquitto, the registry, the CLIs' errors."""

from __future__ import annotations

import stat
from pathlib import Path
import time

import pytest

from broker_coordinator.access import devices as ops
from broker_coordinator.access.registry import ACTIVE, PENDING, REVOKED, Registry, RegistryError
from edge_agent.config import load_config as load_agent_config
from edge_agent.enroll import EnrollError, enroll
from edgefl_protocol import enrollment as proto
from edgefl_protocol import topics as proto_topics
from edgefl_protocol.transport import connect, make_client

from .operator_fixtures import FEDERATION, desk, desk_on, run_module, server  # noqa: F401 - fixtures


def sample_token(**changes) -> proto.EnrollmentToken:
    values = dict(device="pi-07", federation="field", host="broker.example", port=1883, password="p" * 24,
                  signing_key="ab" * 32, token_id="0123456789abcdef", expires=time.time() + 3600)
    values.update(changes)
    return proto.EnrollmentToken(**values)


# the token -----------------------------------------------------------------------------
def test_token_round_trips_and_carries_what_the_device_needs():
    token = sample_token(tls=True, ca_sha256="cd" * 32)
    decoded = proto.decode_token(proto.encode_token(token))
    assert decoded == token and decoded.username == "pi-07"


@pytest.mark.parametrize("damage", [
    lambda t: t[:-3],                                    # truncated
    lambda t: t.replace(".", "", 1),                     # a separator lost
    lambda t: t[:20] + ("A" if t[20] != "A" else "B") + t[21:],  # one character changed
    lambda t: "hello",
    lambda t: "",
])
def test_garbled_token_is_one_clear_error(damage):
    with pytest.raises(proto.TokenError, match="garbled"):
        proto.decode_token(damage(proto.encode_token(sample_token())))


def test_expired_token_is_refused_before_anything_is_sent(tmp_path):
    text = proto.encode_token(sample_token(expires=time.time() - 1, host="192.0.2.1"))  # unroutable: never contacted
    with pytest.raises(EnrollError, match="expired"):
        enroll(text, tmp_path / "agent.toml")
    assert not (tmp_path / "agent.toml").exists()


# the handshake against a real broker ------------------------------------------------------
def test_enroll_writes_a_private_config_that_connects(server, desk, tmp_path):
    text = server.add("pi-07")
    config = tmp_path / "etc" / "agent.toml"
    done = enroll(text, config, state_dir=str(tmp_path / "state"))
    assert done.device == "pi-07" and done.config == config
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    agent = load_agent_config(config)
    assert agent.device.id == "pi-07" and agent.device.federation == FEDERATION
    token = proto.decode_token(text)
    assert agent.device.signing_key == token.signing_key
    assert agent.broker.password != token.password  # the device made its own password
    registry = Registry(server.config.registry_path)
    device = registry.require("pi-07")
    assert device.state == ACTIVE and device.token_id is None
    assert registry.admission("pi-07") is None
    client = make_client("pi-07-check", "pi-07", agent.broker.password)
    connect(client, "127.0.0.1", server.port, timeout=5)
    client.disconnect()
    client.loop_stop()


def test_relative_paths_are_written_absolute(server, desk, tmp_path, monkeypatch):
    """The service runs from /, so a config that says "a07/data.npz" would name another file there."""
    monkeypatch.chdir(tmp_path)
    done = enroll(server.add("pi-07"), Path("a07/agent.toml"), state_dir="a07")
    assert done.config == tmp_path / "a07" / "agent.toml"
    agent = load_agent_config(done.config)
    assert Path(agent.device.state_dir) == tmp_path / "a07"


def test_token_cannot_be_used_twice(server, desk, tmp_path):
    text = server.add("pi-07")
    enroll(text, tmp_path / "first.toml", state_dir=str(tmp_path))
    with pytest.raises(EnrollError, match="already used"):
        enroll(text, tmp_path / "second.toml", state_dir=str(tmp_path), timeout=5)
    assert not (tmp_path / "second.toml").exists()


def test_token_is_refused_after_it_expires_even_if_the_device_clock_is_wrong(server, desk, tmp_path, monkeypatch):
    text = server.add("pi-07")
    registry = Registry(server.config.registry_path)
    with registry.connect() as db:  # the server's clock says it expired
        db.execute("UPDATE devices SET token_expires = ? WHERE name = 'pi-07'", (time.time() - 1,))
    with pytest.raises(EnrollError, match="expired"):
        enroll(text, tmp_path / "agent.toml", timeout=5)
    assert registry.require("pi-07").state == PENDING
    ops.apply(server.config, registry)  # any later change drops the expired one-time password
    assert "pi-07" not in (server.root / "mosquitto/edgefl/passwd").read_text()


def test_two_enrolls_with_one_token_one_wins_and_the_other_writes_nothing(server, desk, tmp_path):
    """Before: both processes took the first answer on the shared `enrolled` topic, so both wrote a
    config and the loser's password did not work. Now each takes the answer to its own nonce."""
    import threading
    text = server.add("pi-07")
    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            results[name] = enroll(text, tmp_path / f"{name}.toml", state_dir=str(tmp_path / name), timeout=20)
        except EnrollError as exc:
            results[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    winners = [name for name, result in results.items() if not isinstance(result, EnrollError)]
    assert len(winners) == 1, results
    loser = "b" if winners == ["a"] else "a"
    assert "already used" in str(results[loser]) and not (tmp_path / f"{loser}.toml").exists()
    agent = load_agent_config(tmp_path / f"{winners[0]}.toml")
    client = make_client("pi-07", "pi-07", agent.broker.password)
    connect(client, "127.0.0.1", server.port, timeout=5)
    client.disconnect()
    client.loop_stop()


def test_answers_echo_the_requests_nonce(server, desk):
    """Two requests with one token on one session: the first redeems it, the second is told `used`,
    each answer carrying its own request's nonce; a retry of the winning request is answered ok again."""
    from .conftest import Recorder
    token = proto.decode_token(server.add("pi-07"))
    session = Recorder(make_client("pi-07", "pi-07", token.password))
    connect(session.client, "127.0.0.1", server.port, timeout=5)
    try:
        session.subscribe(proto_topics.enrolled(FEDERATION, "pi-07"))
        winner = proto.EnrollRequest("pi-07", token.token_id, "w" * 24, "nonce-1")
        loser = proto.EnrollRequest("pi-07", token.token_id, "l" * 24, "nonce-2")
        answers = [desk.handle(proto_topics.enroll(FEDERATION, "pi-07"), proto.encode("enroll", r))
                   for r in (winner, loser, winner)]
        assert [(a.ok, a.reason, a.nonce) for a in answers] == [(True, "", "nonce-1"), (False, "used", "nonce-2"),
                                                                (True, "", "nonce-1")]
    finally:
        session.close()


def test_expired_one_time_password_is_removed_from_the_broker_when_it_expires(server, tmp_path):
    """Before: an expired token's one-time password kept working at the broker until the desk's next
    sweep (about 40 s after the expiry of a token added while it slept). Now the desk keeps a timer to
    the earliest expiry, re-armed when the registry changes: a 1-second token added after the desk
    started is removed at its expiry (with the desk's production settings)."""
    from broker_coordinator.access.enrollment import EnrollmentDesk
    from edgefl_protocol.transport import BrokerUnavailable
    lines: list[str] = []
    client = ops.coordinator_client(server.config, "desk")
    connect(client, "127.0.0.1", server.port, timeout=10)
    registry = ops.open_registry(server.config)
    desk = EnrollmentDesk(server.config, registry, echo=lines.append)
    desk.attach(client)
    try:
        token = proto.decode_token(server.add("pi-07"))
        server.add("pi-08")  # valid for a day: stays
        one_time = make_client("pi-07", "pi-07", token.password)
        connect(one_time, "127.0.0.1", server.port, timeout=5)  # valid until it expires
        one_time.disconnect()
        one_time.loop_stop()
        # the expiry is set after that connection, not before it: a connection racing a 2.5-second
        # expiry failed whenever the machine was slow enough to take longer than that
        with registry.connect() as db:
            db.execute("UPDATE devices SET token_expires = ? WHERE name = 'pi-07'", (time.time() + 1.0,))
        give_up = time.monotonic() + 20  # the old sweep took up to a minute; the timer fires at the expiry
        while not lines and time.monotonic() < give_up:
            time.sleep(0.1)
        assert len(lines) == 1 and "token of pi-07 expired" in lines[0], lines
        passwd = (server.root / "mosquitto/edgefl/passwd").read_text()
        assert "pi-07:" not in passwd and "pi-08:" in passwd
        give_up = time.monotonic() + 5
        while True:  # the broker reloads asynchronously after SIGHUP
            try:
                late = make_client("pi-07", "pi-07", token.password)
                connect(late, "127.0.0.1", server.port, timeout=5)
            except BrokerUnavailable as exc:
                assert "Not authorized" in str(exc) or "Bad user name" in str(exc), exc
                break
            late.disconnect()
            late.loop_stop()
            assert time.monotonic() < give_up, "the expired one-time password still works"
            time.sleep(0.2)
        # said once: a later expiry (a registry change the desk looks at within `rescan`, and a token already
        # past its expiry) makes the desk look at every expired token again, pi-07's included; once it has
        # said pi-09's, a second line for pi-07 would have come in that same look or an earlier one
        server.add("pi-09")
        with registry.connect() as db:
            db.execute("UPDATE devices SET token_expires = ? WHERE name = 'pi-09'", (time.time() - 1.0,))
        give_up = time.monotonic() + 20
        while not any("token of pi-09 expired" in line for line in lines) and time.monotonic() < give_up:
            time.sleep(0.1)
        assert [line.split(";")[0] for line in lines] == [
            "the enrollment token of pi-07 expired", "the enrollment token of pi-09 expired"], lines
    finally:
        desk.stop()
        client.disconnect()
        client.loop_stop()


def test_rotate_replaces_the_token_and_the_old_one_stops_working(server, desk, tmp_path):
    old = server.add("pi-07")
    new, _, _ = ops.rotate_device(server.config, "pi-07")
    with pytest.raises(EnrollError, match="refused this token"):
        enroll(old, tmp_path / "old.toml", timeout=5)
    enroll(new, tmp_path / "new.toml", state_dir=str(tmp_path))
    assert proto.decode_token(new).signing_key != proto.decode_token(old).signing_key


def test_no_desk_running_leaves_the_token_unused(server, tmp_path):
    text = server.add("pi-07")
    with pytest.raises(EnrollError, match="no answer from the coordinator"):
        enroll(text, tmp_path / "agent.toml", timeout=1)
    assert Registry(server.config.registry_path).require("pi-07").token_valid()


# registry ---------------------------------------------------------------------------------
def test_registry_states_and_admission(tmp_path):
    registry = Registry(tmp_path / "r.db")
    assert stat.S_IMODE((tmp_path / "r.db").stat().st_mode) == 0o600
    assert registry.admission("anyone") is None  # an empty registry: a fleet provisioned by hand
    registry.add("a", "f", "$7$hash", "00" * 32, "tok", time.time() + 60)
    assert registry.admission("a")[0] == "unknown_device"  # pending: not enrolled yet
    assert registry.admission("nobody")[0] == "unknown_device"
    with pytest.raises(RegistryError, match="used"):
        registry.activate("a", "other-token", "$7$new")
    registry.activate("a", "tok", "$7$new")
    assert registry.admission("a") is None and registry.broker_users("f") == {"a": "$7$new"}
    assert registry.signing_keys("f") == {"a": bytes(32)}
    registry.revoke("a")
    assert registry.require("a").state == REVOKED and registry.admission("a")[0] == "revoked"
    assert registry.broker_users("f") == {} and registry.signing_keys("f") == {}
    with pytest.raises(RegistryError, match="stay revoked"):
        registry.reissue("a", "$7$x", "00", "t2", time.time() + 60)
    with pytest.raises(RegistryError, match="already exists"):
        registry.add("a", "f", "$7$hash", "00" * 32, "tok", time.time() + 60)


def test_admission_costs_no_connect_and_sees_a_revocation_from_another_process(tmp_path, monkeypatch):
    """Admission is asked on every update: it keeps one connection and re-reads the devices only when
    the database changed, so `devices revoke` (another process, another connection) still counts at
    the next update."""
    import sqlite3

    from broker_coordinator.access import registry as registry_module
    from broker_coordinator.storage.store import Store

    registry = Registry(tmp_path / "coordinator.db")
    for name in ("a", "b"):
        registry.add(name, "f", "$7$hash", "00" * 32, f"tok-{name}", time.time() + 60)
        registry.activate(name, f"tok-{name}", "$7$new")
    connects = []
    real_connect = sqlite3.connect
    monkeypatch.setattr(registry_module.sqlite3, "connect", lambda *a, **k: connects.append(a) or real_connect(*a, **k))
    assert all(registry.admission(d) is None for _ in range(200) for d in ("a", "b"))
    assert len(connects) == 1  # the kept reader; the old code connected on every call (400)
    store = Store(tmp_path)  # the round store shares the file and commits beside it
    store.record_presence("a", True, {})
    store.close()
    assert registry.admission("a") is None
    monkeypatch.setattr(registry_module.sqlite3, "connect", real_connect)
    Registry(tmp_path / "coordinator.db").revoke("b")  # what the CLI does, on its own connection
    assert registry.admission("b")[0] == "revoked" and registry.admission("a") is None
    registry.close()
    assert registry.admission("b")[0] == "revoked"  # reopened after close


# the CLIs' bad input: one line, non-zero, no traceback ---------------------------------------
@pytest.fixture
def coordinator_cli(capsys):
    """`broker-coordinator ARGS` in this process (the end-to-end tests run it as a process)."""
    from types import SimpleNamespace

    from broker_coordinator.cli.cli import main

    def run(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)
    return run


def _one_line_error(result, expected: str) -> None:
    assert result.returncode != 0, result.stdout
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_unknown_device_name(server, coordinator_cli):
    config = ("--config", str(server.config_path))
    _one_line_error(coordinator_cli("devices", "revoke", "nobody", *config), "no device named 'nobody'")
    _one_line_error(coordinator_cli("devices", "rotate", "nobody", *config), "no device named 'nobody'")


def test_invalid_device_name(server, coordinator_cli):
    _one_line_error(coordinator_cli("devices", "add", "a/b", "--config", str(server.config_path)), "invalid device name")


def start_serve_enrollment(server, log: Path):  # noqa: ANN201 - a Popen
    """`broker-coordinator serve-enrollment` as a process, once it says it is up."""
    import os
    import subprocess
    import sys

    from .operator_fixtures import PROJECT_ROOT
    with open(log, "wb") as out:
        desk = subprocess.Popen([sys.executable, "-m", "broker_coordinator", "serve-enrollment", "--config",
                                 str(server.config_path)], stdout=out, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT,
                                env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    give_up = time.monotonic() + 20
    while b"enrollment desk" not in log.read_bytes():
        if time.monotonic() > give_up or desk.poll() is not None:
            desk.kill()
            pytest.fail(f"serve-enrollment did not come up: {log.read_text()}")
        time.sleep(0.1)
    return desk


def test_garbled_and_used_tokens_on_the_command_line(server, tmp_path):
    """Through `broker-coordinator serve-enrollment` and `edge-agent enroll`, as separate processes."""
    import signal
    _one_line_error(run_module("edge_agent", "enroll", "edgefl1.garbage.x", "--config", str(tmp_path / "a.toml")),
                    "garbled")
    log = tmp_path / "desk.log"
    desk = start_serve_enrollment(server, log)
    try:
        text = server.add("pi-07")
        first = run_module("edge_agent", "enroll", text, "--config", str(tmp_path / "first.toml"),
                           "--state-dir", str(tmp_path))
        assert first.returncode == 0 and first.stdout.startswith("enrolled pi-07"), first.stderr
        _one_line_error(run_module("edge_agent", "enroll", text, "--config", str(tmp_path / "b.toml"),
                                   "--timeout", "5"), "already used")
    finally:
        desk.send_signal(signal.SIGTERM)
        assert desk.wait(timeout=15) == 0
    assert "pi-07 enrolled" in log.read_text()


def test_serve_enrollment_runs_beside_the_coordinator(server, tmp_path):
    """The broker keeps one connection per user: `serve-enrollment` has a user of its own, so
    starting it does not knock the coordinator off, and it still enrolls devices."""
    import threading
    coordinator = ops.coordinator_client(server.config, "run")
    dropped = threading.Event()
    coordinator.on_disconnect = lambda *args: dropped.set()
    connect(coordinator, "127.0.0.1", server.port, timeout=10)
    log = tmp_path / "desk.log"
    desk = start_serve_enrollment(server, log)
    try:
        enroll(server.add("pi-07"), tmp_path / "agent.toml", state_dir=str(tmp_path), timeout=15)
        assert not dropped.is_set() and coordinator.is_connected()
    finally:
        desk.terminate()
        desk.wait(timeout=15)
        coordinator.disconnect()
        coordinator.loop_stop()


def test_unwritable_config_path_does_not_spend_the_token(server, tmp_path):
    text = server.add("pi-07")
    blocker = tmp_path / "file"
    blocker.write_text("")
    _one_line_error(run_module("edge_agent", "enroll", text, "--config", str(blocker / "agent.toml")),
                    "cannot write")
    assert Registry(server.config.registry_path).require("pi-07").token_valid()


def test_missing_coordinator_config_is_explained(tmp_path, coordinator_cli):
    result = coordinator_cli("devices", "list", "--config", str(tmp_path / "none.toml"))
    _one_line_error(result, "does not exist")


def test_bad_config_key_is_named(tmp_path, coordinator_cli):
    path = tmp_path / "c.toml"
    path.write_text('[federation]\ntest_data = "t.npz"\n[broker]\npassword = "x"\nport = 70000\n')
    _one_line_error(coordinator_cli("devices", "list", "--config", str(path)), "[broker]: port")
    path.write_text('[federation]\ntest_data = "t.npz"\n[broker]\npassword = "x"\nprot = 1\n')
    _one_line_error(coordinator_cli("devices", "list", "--config", str(path)), "prot")


def test_config_env_override_and_rounds_section(server, monkeypatch):
    from broker_coordinator.settings.config import load_config
    monkeypatch.setenv("EDGEFL_COORDINATOR_BROKER_PORT", "1999")
    monkeypatch.setenv("EDGEFL_COORDINATOR_ROUNDS_LR", "0.5")
    config = load_config(server.config_path)
    assert config.broker.port == 1999 and config.broker.devices_port == 1999
    assert config.rounds.algorithm == "fedavg" and config.rounds.round_timeout == 30.0 and config.rounds.lr == 0.5
    assert config.registry_path == Path(config.storage.state_dir) / "coordinator.db"


def test_tls_needs_a_separate_device_port(tmp_path, coordinator_cli):
    path = tmp_path / "c.toml"
    path.write_text('[federation]\ntest_data = "t.npz"\n[broker]\npassword = "x"\ntls_cert = "c"\ntls_key = "k"\n')
    _one_line_error(coordinator_cli("devices", "list", "--config", str(path)), "device_port")


# TLS ---------------------------------------------------------------------------------------------
def openssl(*args: str) -> None:
    """Run openssl (skip the test where the machine has none: CI installs it)."""
    import shutil
    import subprocess
    program = shutil.which("openssl")
    if program is None:
        pytest.skip("openssl is not installed (CI installs it: apt-get install openssl)")
    subprocess.run([program, *args], check=True, capture_output=True, timeout=60)


EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def self_signed(directory, name: str = "broker"):
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    openssl("req", "-x509", *EC_KEY, "-days", "2", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert))
    return cert, key


def connects_over_tls(agent, port: int) -> None:  # noqa: ANN001 - an AgentConfig
    """The device's credentials, verified against the CA file its config names."""
    secure = make_client(f"{agent.device.id}-tls", agent.broker.username, agent.broker.password,
                         tls_ca=agent.broker.tls_ca)
    connect(secure, "127.0.0.1", port, timeout=5)
    secure.disconnect()
    secure.loop_stop()


def test_enroll_over_tls_pins_the_ca_by_the_tokens_fingerprint(tmp_path):
    from .operator_fixtures import start_server, stop_server
    cert, key = self_signed(tmp_path / "pki")
    from broker_coordinator.access.broker import free_port
    server = start_server(tmp_path / "server", f'tls_cert = "{cert}"\ntls_key = "{key}"', device_port=free_port())
    try:
        with desk_on(server):
            text = server.add("pi-07")
            token = proto.decode_token(text)
            assert token.tls and token.ca_sha256 == ops.ca_fingerprint(str(cert))

            other, _ = self_signed(tmp_path / "pki", "other")
            with pytest.raises(EnrollError, match="does not match the token's CA fingerprint"):
                enroll(text, tmp_path / "bad.toml", ca_file=other)

            done = enroll(text, tmp_path / "etc" / "agent.toml", state_dir=str(tmp_path))
            assert done.tls
            agent = load_agent_config(tmp_path / "etc" / "agent.toml")
            assert Path(agent.broker.tls_ca).read_text() == cert.read_text()
            connects_over_tls(agent, server.config.broker.devices_port)
    finally:
        stop_server(server)


def test_revoke_says_so_when_the_broker_cannot_be_reloaded(server, coordinator_cli):
    server.add("pi-07")
    (server.root / "run" / "mosquitto.pid").unlink()  # as if mosquitto were not running
    result = coordinator_cli("devices", "revoke", "pi-07", "--config", str(server.config_path))
    _one_line_error(result, "pi-07 is revoked in the registry")
    assert "systemctl reload mosquitto" in result.stderr
    assert Registry(server.config.registry_path).require("pi-07").state == REVOKED


def private_ca(directory: Path) -> tuple[Path, Path]:
    """A CA as docs/CERTIFICATES.md makes one (its commands, shortened validity)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "edgefl-ca.crt", directory / "edgefl-ca.key"
    openssl("req", "-x509", *EC_KEY, "-days", "30", "-subj", "/CN=EdgeFL CA", "-keyout", str(ca_key), "-out", str(ca))
    return ca, ca_key


def server_certificate(directory: Path, ca: Path, ca_key: Path) -> tuple[Path, Path]:
    """A broker certificate signed by the CA (a new key each time: a renewal)."""
    cert, key, request = directory / "broker.crt", directory / "broker.key", directory / "broker.csr"
    openssl("req", "-new", *EC_KEY, "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(request))
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-days", "7", "-extfile", str(directory / "san.ext"), "-out", str(cert))
    return cert, key


def test_a_renewed_broker_certificate_from_the_same_ca_keeps_enrolled_devices_connecting(tmp_path):
    """Devices pin the CA (its fingerprint in the token, its file in agent.toml), not the broker's
    certificate: a new certificate and key from the same CA, and a reload of Mosquitto, need no
    device to enroll again."""
    import signal
    import ssl

    from broker_coordinator.access.broker import free_port

    from .operator_fixtures import start_server, stop_server
    pki = tmp_path / "pki"
    ca, ca_key = private_ca(pki)
    cert, key = server_certificate(pki, ca, ca_key)
    device_port = free_port()
    server = start_server(tmp_path / "server", f'tls_cert = "{cert}"\ntls_key = "{key}"\ntls_ca = "{ca}"',
                          device_port=device_port)
    try:
        with desk_on(server):
            text = server.add("pi-07")
            assert proto.decode_token(text).ca_sha256 == ops.ca_fingerprint(str(ca))
            enroll(text, tmp_path / "etc" / "agent.toml", state_dir=str(tmp_path), ca_file=ca)  # --ca-file
        agent = load_agent_config(tmp_path / "etc" / "agent.toml")
        assert Path(agent.broker.tls_ca).read_text() == ca.read_text()  # the CA, not the broker's certificate

        def presented() -> str:
            return ssl.get_server_certificate(("127.0.0.1", device_port))

        before = presented()
        server_certificate(pki, ca, ca_key)  # renewed in place: a new key, the same CA
        server.process.send_signal(signal.SIGHUP)  # `systemctl reload mosquitto`
        give_up = time.monotonic() + 30
        while presented() == before:
            assert time.monotonic() < give_up, "Mosquitto still presents the old certificate after a reload"
            time.sleep(0.2)
        connects_over_tls(agent, device_port)  # verified against the pinned CA: no new enrollment
    finally:
        stop_server(server)
