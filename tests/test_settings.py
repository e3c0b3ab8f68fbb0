"""Settings come from flags, then KVBATON_* variables, then defaults."""

import pytest

from kvbaton.cli.main import build_parser, runtime_settings
from kvbaton.runtime import RuntimeSettings

pytestmark = pytest.mark.unit


def test_defaults_need_no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("KVBATON_"):
            monkeypatch.delenv(name)
    settings = RuntimeSettings()
    assert settings.discovery.startswith("file://")
    assert settings.request_plane == "tcp"
    assert settings.host == "127.0.0.1"
    assert settings.lease_ttl == 10.0


def test_flags_win_over_variables_which_win_over_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVBATON_LEASE_TTL", "3")
    monkeypatch.setenv("KVBATON_DISCOVERY", "mem://from-env")
    args = build_parser().parse_args(["worker", "--discovery", "mem://from-flag"])
    settings = runtime_settings(args)
    assert settings.discovery == "mem://from-flag"
    assert settings.lease_ttl == 3.0
    assert settings.port == 0


def test_bad_values_are_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBATON_LEASE_TTL", "-1")
    with pytest.raises(ValueError, match="lease_ttl"):
        RuntimeSettings()
    monkeypatch.delenv("KVBATON_LEASE_TTL")
    with pytest.raises(ValueError, match="unknown request plane"):
        RuntimeSettings(request_plane="carrier-pigeon")


def test_the_distributed_backends_are_chosen_by_flags_or_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVBATON_REQUEST_PLANE", "nats")
    monkeypatch.setenv("KVBATON_NATS_URL", "nats://127.0.0.1:4333")
    args = build_parser().parse_args(
        ["worker", "--discovery", "etcd://127.0.0.1:2379,127.0.0.1:2380", "--event-plane", "nats"]
    )
    settings = runtime_settings(args)
    assert settings.discovery == "etcd://127.0.0.1:2379,127.0.0.1:2380"
    assert settings.request_plane == "nats"
    assert settings.event_plane_url == "nats://127.0.0.1:4333"  # `nats`: the one NATS server
    args = build_parser().parse_args(
        ["frontend", "--request-plane", "http", "--event-plane", "nats://127.0.0.1:4444"]
    )
    settings = runtime_settings(args)
    assert settings.request_plane == "http"
    assert settings.event_plane_url == "nats://127.0.0.1:4444"
    assert RuntimeSettings(event_plane="direct").event_plane_url is None
    with pytest.raises(ValueError, match="unknown event plane"):
        RuntimeSettings(event_plane="kafka://somewhere")
    with pytest.raises(ValueError, match="not a NATS URL"):
        RuntimeSettings(nats_url="http://127.0.0.1:4222")


# What each command needs besides the flags under test.
REQUIRED = {  # the commands of one process (serve's each bind their own port)
    "frontend": [],
    "worker": [],
    "planner": ["--frontend", "http://x", "--profile", "p", "--ttft-ms", "1", "--itl-ms", "1"],
    "profile": ["--role", "prefill", "--output", "o.json"],
}


def test_one_flag_name_per_port_across_commands(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KVBATON_PORT", raising=False)
    parser = build_parser()
    for command, required in REQUIRED.items():
        args = parser.parse_args([command, *required, "--request-plane-port", "5555"])
        assert args.request_plane_port == 5555 and not hasattr(args, "port"), command
        assert runtime_settings(args).port == 5555
    for command in ("serve", "frontend"):
        assert parser.parse_args([command]).http_port == 8000
        assert parser.parse_args([command, "--http-port", "9001"]).http_port == 9001
    args = parser.parse_args(["serve", "--port", "9002"])  # serve's old name for it, kept
    assert args.http_port == 9002 and not hasattr(args, "port")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    serve_help = capsys.readouterr().out
    assert "--http-port" in serve_help and "--port" not in serve_help


def test_serve_takes_no_single_port_for_its_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbaton.cli.serve import serve

    with pytest.raises(SystemExit):  # not a serve flag: each child binds its own port
        build_parser().parse_args(["serve", "--request-plane-port", "9000"])
    args = build_parser().parse_args(["serve", "--engine", "mocker"])
    for name in ("KVBATON_PORT", "KVBATON_SYSTEM_PORT"):
        monkeypatch.setenv(name, "9000")
        with pytest.raises(ValueError, match=f"{name} names one port"):
            serve(args, runtime_settings(args))
        monkeypatch.delenv(name)


def test_serve_refuses_worker_system_ports_past_the_last_port() -> None:
    from kvbaton.cli.serve import _commands, serve

    flags = ["serve", "--engine", "mocker", "--mode", "disagg", "--decode-workers", "2"]
    for first in ("0", "65534"):  # its 3 workers: 65534 to 65536
        args = build_parser().parse_args([*flags, "--worker-system-ports", first])
        with pytest.raises(ValueError, match="--worker-system-ports: ports"):
            serve(args, runtime_settings(args))
    args = build_parser().parse_args([*flags, "--worker-system-ports", "65533"])
    workers = [(name, cmd) for name, role, cmd in _commands(args, 8000) if role != "frontend"]
    ports = [(name, cmd[cmd.index("--system-port") + 1]) for name, cmd in workers]
    assert ports == [("prefill-0", "65533"), ("decode-0", "65534"), ("decode-1", "65535")]
