"""Compiled decode packages on disk: a lookup marks a package in use; a build removes the
packages of its model and settings that other sources built and nothing looked up for a week
(`decode_package.remove_stale`), and nothing else."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvbaton.engine import decode_package
from kvbaton.engine.decode_package import PackageSpec

pytestmark = pytest.mark.unit


def package(folder: Path, name: str, unused_s: float) -> Path:
    """An empty package file and its lock file, last looked up `unused_s` ago."""
    path = folder / name
    path.write_bytes(b"")
    (folder / f".{name}.lock").write_bytes(b"")
    then = time.time() - unused_s
    os.utime(path, (then, then))
    return path


def test_a_build_removes_only_stale_packages_of_its_model(tmp_path: Path) -> None:
    week = decode_package.STALE_S
    built = package(tmp_path, "m-bfloat16-b16-t2-0123456789abcdef.so", 0)
    stale = package(tmp_path, "m-bfloat16-b16-t2-fedcba9876543210.so", week + 60)
    kept = [
        package(tmp_path, "m-bfloat16-b16-t2-00000000000000aa.so", week - 60),  # in use
        package(tmp_path, "m-bfloat16-b16-t4-11111111111111bb.so", week + 60),  # other threads
        package(tmp_path, "m2-bfloat16-b16-t2-22222222222222cc.so", week + 60),  # other model
        package(tmp_path, "m-bfloat16-b16-t2-not-a-digest.so", week + 60),  # not a package's
    ]
    assert decode_package.remove_stale(built) == [stale]
    left = {p.name for p in tmp_path.iterdir()}
    assert stale.name not in left and f".{stale.name}.lock" not in left
    assert {p.name for p in [built, *kept]} <= left
    assert {f".{p.name}.lock" for p in [built, *kept]} <= left


def test_looking_a_package_up_marks_it_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVBATON_COMPILED_DIR", str(tmp_path / "compiled"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = PackageSpec(model, "bfloat16", 16, 2)
    spec.path.parent.mkdir()
    found = package(spec.path.parent, spec.path.name, 30 * 86400)
    assert decode_package.built_package(spec) == found
    assert time.time() - found.stat().st_mtime < decode_package.STALE_S / 2
