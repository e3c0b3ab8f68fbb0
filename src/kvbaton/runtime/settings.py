"""Runtime settings: CLI flags (passed as keyword overrides), then `KVBATON_*` variables, then
defaults. The defaults need no server: file discovery in a per-user directory and the TCP request
plane on 127.0.0.1."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_discovery_url() -> str:
    """A per-user directory: $XDG_RUNTIME_DIR/kvbaton/discovery, else under the temp dir."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir and os.access(runtime_dir, os.W_OK):
        base = Path(runtime_dir) / "kvbaton"
    else:
        base = Path(tempfile.gettempdir()) / f"kvbaton-{os.getuid()}"
    return f"file://{base / 'discovery'}"


class RuntimeSettings(BaseSettings):
    """Every setting of the distributed runtime of one process."""

    model_config = SettingsConfigDict(env_prefix="KVBATON_", frozen=True, extra="ignore")

    discovery: str = Field(default_factory=default_discovery_url)
    """`file:///dir` (default), `mem://name` (one process)."""
    request_plane: str = "tcp"
    host: str = "127.0.0.1"
    """Address the request-plane server binds and advertises."""
    port: int = Field(default=0, ge=0, le=65535)
    """0 picks a free port."""
    lease_ttl: float = Field(default=10.0, gt=0)
    """Seconds after a process's last keep-alive at which its keys vanish."""
    max_frame_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    stream_window: int = Field(default=256, ge=0)
    """Responses a server may send on one stream ahead of the caller's reading (0: no limit)."""
    connect_timeout: float = Field(default=5.0, gt=0)
    wait_for_instances_timeout: float = Field(default=30.0, gt=0)
    cancel_grace: float = Field(default=0.5, ge=0)
    """Seconds a stopped handler may take to return before its task is cancelled."""
    drain_timeout: float = Field(default=10.0, ge=0)
    """Seconds in-flight streams may take to finish at shutdown before they are cancelled."""

    @field_validator("request_plane")
    @classmethod
    def _known_plane(cls, value: str) -> str:
        if value != "tcp":
            raise ValueError(f"unknown request plane {value!r}; supported: 'tcp'")
        return value
