"""The test environment is reproducible: `constraints.txt` pins what pyproject.toml asks for."""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


@pytest.mark.unit
def test_every_requirement_is_pinned_within_its_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    for line in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue  # not for this platform
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned: run scripts/lock_test_env.py"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{req.name}=={pins[name]} is outside pyproject's {req.specifier}"
        )


@pytest.mark.unit
def test_ci_runs_the_readme_test_command_with_the_constraints() -> None:
    readme = (ROOT / "README.md").read_text()
    command = "pip install -e '.[test]' -c constraints.txt && python -m pytest"
    assert re.search(rf"^{re.escape(command)}$", readme, re.MULTILINE)
    run = (ROOT / ".ci" / "run").read_text().splitlines()
    assert run[-1] == command
    browser = "apt-get update && apt-get install -y chromium"  # the browser test's Chromium
    assert re.search(rf"^{re.escape(browser)}$", readme, re.MULTILINE) and browser in run
