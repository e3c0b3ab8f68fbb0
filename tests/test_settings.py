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
