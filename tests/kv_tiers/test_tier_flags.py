"""The tier flags of `worker` and `serve`: for the built-in engine only, the disk size with a
disk directory only, no negative sizes; `serve` passes them on to its workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbaton.cli.main import build_parser
from kvbaton.cli.worker import WORKER_FLAGS, check_engine_flags, tier_settings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (
            ["--engine", "fixed", "--kv-disk-dir", "d"],
            "--kv-disk-dir is for --engine torch or mocker",
        ),
        (
            ["--engine", "vllm", "--kv-offload-gib", "1"],
            "--kv-offload-gib is for --engine torch or mocker",
        ),
        (["--kv-disk-gib", "1"], "--kv-disk-gib needs --kv-disk-dir"),
        (["--kv-offload-gib", "-1"], "--kv-offload-gib must not be negative"),
    ],
)
def test_bad_tier_flags_are_refused(flags: list[str], error: str) -> None:
    args = build_parser().parse_args(["worker", *flags])
    with pytest.raises(ValueError, match=error):
        check_engine_flags(args)


def test_tier_settings_from_flags() -> None:
    args = build_parser().parse_args(["worker", "--kv-disk-dir", "~/kv", "--kv-offload-gib", "2"])
    check_engine_flags(args)
    settings = tier_settings(args)
    assert settings.enabled and settings.host_bytes == 2 * 2**30
    assert settings.disk_dir == Path("~/kv").expanduser() and settings.disk_bytes == 10 * 2**30
    assert not tier_settings(build_parser().parse_args(["worker"])).enabled
    assert {"kv_offload_gib", "kv_disk_dir", "kv_disk_gib"} <= set(WORKER_FLAGS)
