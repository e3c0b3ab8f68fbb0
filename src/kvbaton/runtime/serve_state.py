"""Where `kvbaton serve` keeps its slots for `kvbaton status` and the frontends' cluster page:
one JSON file per serve process (`cli/supervisor.py` writes it), under the per-user runtime
directory.

- A file names its serve's PID and discovery; readers take those of their own discovery whose
  serve still lives, and remove the files of serves that do not (a killed serve leaves its
  file: SIGKILL gives it no chance to remove it).
- A slot names its role: "frontend", or its worker's ("agg", "prefill", "decode").
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvbaton.runtime.settings import runtime_dir


def state_path(pid: int) -> Path:
    """The state file of the serve process `pid` (its directory is created)."""
    directory = runtime_dir() / "serve"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"serve-{pid}.json"


def alive(pid: int) -> bool:
    """A process `pid` exists (on this host)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_states(discovery: str) -> list[dict[str, Any]]:
    """The states of the live serve processes on `discovery`; removes the files of dead ones
    (of any discovery)."""
    states = []
    for path in sorted((runtime_dir() / "serve").glob("serve-*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # removed or replaced while read
        if not alive(int(state.get("pid", 0))):
            path.unlink(missing_ok=True)
        elif state.get("discovery") == discovery:
            states.append(state)
    return states
