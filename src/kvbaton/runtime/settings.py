"""Runtime settings: CLI flags (passed as keyword overrides), then `KVBATON_*` variables, then
defaults. The defaults need no server: file discovery in a per-user directory and the TCP request
plane on 127.0.0.1."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def runtime_dir() -> Path:
    """A per-user directory for this machine's kvbaton state: $XDG_RUNTIME_DIR/kvbaton, else
    kvbaton-UID under the temp dir (not created here)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.access(base, os.W_OK):
        return Path(base) / "kvbaton"
    return Path(tempfile.gettempdir()) / f"kvbaton-{os.getuid()}"


def default_discovery_url() -> str:
    """runtime_dir()/discovery."""
    return f"file://{runtime_dir() / 'discovery'}"


REQUEST_PLANES = ("tcp", "http", "nats")


class RuntimeSettings(BaseSettings):
    """Every setting of the distributed runtime of one process."""

    model_config = SettingsConfigDict(env_prefix="KVBATON_", frozen=True, extra="ignore")

    discovery: str = Field(default_factory=default_discovery_url)
    """`file:///dir` (default), `mem://name` (one process), `etcd://host:port[,host:port]`,
    `kubernetes[://NAMESPACE][?api=URL]`."""
    request_plane: str = "tcp"
    """How requests reach this process's endpoints: `tcp` (default), `http` or `nats` (through
    the server at `nats_url`). A caller reaches any instance on any plane: the plane is in the
    instance's address."""
    event_plane: str = "direct"
    """How KV events and load travel: `direct` (routers subscribe to each worker over the
    request plane; no broker) or `nats` / `nats://host:port` (subjects on a NATS server)."""
    nats_url: str = "nats://127.0.0.1:4222"
    """The NATS server of `--request-plane nats` and `--event-plane nats`."""
    host: str = "127.0.0.1"
    """Address the request-plane server binds and advertises."""
    port: int = Field(default=0, ge=0, le=65535)
    """0 picks a free port."""
    system_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve /live, /health and /metrics on `host` at this port (0: any free port; unset: off)."""
    lease_ttl: float = Field(default=10.0, gt=0)
    """Seconds after a process's last keep-alive at which its keys vanish."""
    max_frame_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    max_streams_per_connection: int = Field(default=8192, ge=1)
    """Streams one caller's connection may have open at once; more are refused unrun."""
    stream_window: int = Field(default=256, ge=0)
    """Responses a server may send on one stream ahead of the caller's reading (0: no limit)."""
    connect_timeout: float = Field(default=5.0, gt=0)
    wait_for_instances_timeout: float = Field(default=30.0, gt=0)
    cancel_grace: float = Field(default=0.5, ge=0)
    """Seconds a stopped handler may take to return before its task is cancelled."""
    peer_timeout: float = Field(default=5.0, gt=0)
    """Over nats, which has no connection between caller and server: seconds without a sign of
    life (a frame or a heartbeat) from the other side of an open stream before it is broken."""
    drain_timeout: float = Field(default=10.0, ge=0)
    """Seconds in-flight streams may take to finish at shutdown before they are cancelled."""

    @field_validator("request_plane")
    @classmethod
    def _known_plane(cls, value: str) -> str:
        if value not in REQUEST_PLANES:
            raise ValueError(
                f"unknown request plane {value!r}; supported: {', '.join(REQUEST_PLANES)}"
            )
        return value

    @field_validator("event_plane")
    @classmethod
    def _known_event_plane(cls, value: str) -> str:
        if value not in ("direct", "nats") and not value.startswith("nats://"):
            raise ValueError(
                f"unknown event plane {value!r}; supported: direct, nats, nats://host:port"
            )
        return value

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, value: str) -> str:
        if not value.startswith("nats://"):
            raise ValueError(f"not a NATS URL: {value!r} (nats://host:port)")
        return value

    @property
    def event_plane_url(self) -> str | None:
        """The NATS server of the event plane; None for `direct`."""
        if self.event_plane == "direct":
            return None
        return self.nats_url if self.event_plane == "nats" else self.event_plane
