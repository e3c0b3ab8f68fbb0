"""Write `constraints.txt`: the versions that `pip install -e '.[test]'` resolves today, pinned.

    python scripts/lock_test_env.py

- Run it on purpose (to take newer test tools or libraries), then run the whole test suite
  with the new file before committing it: the file lists versions known to work together.
- It asks pip for a fresh resolution (`--dry-run --ignore-installed`): what is installed here
  does not leak into it. It installs nothing.
- kvbaton itself is left out; so are packages installed from a local path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = """\
# The test environment, pinned: `pip install -e '.[test]' -c constraints.txt` (README, .ci/run).
# Made by `python scripts/lock_test_env.py`; update it on purpose, and commit it only after the
# whole test suite passed with it. pyproject.toml keeps the ranges; this file picks one point.
"""


def resolve() -> dict[str, str]:
    """Package name -> version, as pip resolves the test extra now."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [
                sys.executable, "-m", "pip", "install", "--quiet", "--dry-run",
                "--ignore-installed", "--report", str(report), "-e", f"{ROOT}[test]",
            ],
            check=True,
        )  # fmt: skip
        installs = json.loads(report.read_text())["install"]
    return {
        item["metadata"]["name"]: item["metadata"]["version"].split("+")[0]
        for item in installs
        if not item.get("is_direct")  # kvbaton itself
    }


def main() -> None:
    print("resolving the test extra (pip --dry-run, about 30 s) ...", file=sys.stderr)
    pins = resolve()
    lines = [f"{name}=={pins[name]}" for name in sorted(pins, key=str.lower)]
    (ROOT / "constraints.txt").write_text(HEADER + "\n".join(lines) + "\n")
    print(f"wrote constraints.txt: {len(lines)} packages", file=sys.stderr)


if __name__ == "__main__":
    main()
