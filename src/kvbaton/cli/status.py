"""`kvbaton status`: the instances discovery knows, as a table; then the slots of each live
`kvbaton serve` on the same discovery (their states, PIDs and restarts)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from kvbaton.protocols.discovery import Instance
from kvbaton.runtime.discovery import open_discovery
from kvbaton.runtime.names import SERVICES_ROOT
from kvbaton.runtime.serve_state import read_states
from kvbaton.runtime.settings import RuntimeSettings

COLUMNS = ("NAMESPACE", "COMPONENT", "ENDPOINT", "INSTANCE", "ADDRESS", "PID", "AGE")
SLOT_COLUMNS = ("SLOT", "STATE", "PID", "RESTARTS", "LAST EXIT")


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


def format_table(columns: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [columns, *rows]
    )


async def list_instances(settings: RuntimeSettings, namespace: str | None) -> list[Instance]:
    discovery = open_discovery(settings.discovery)
    try:
        prefix = SERVICES_ROOT + (f"{namespace}/" if namespace else "")
        records = await discovery.get_prefix(prefix)
    finally:
        await discovery.close()
    instances = []
    for value in records.values():
        try:
            instances.append(Instance.from_json(value))
        except Exception:  # a foreign or partial record: not ours to show
            continue
    return sorted(instances, key=lambda i: (i.namespace, i.component, i.endpoint, i.instance_id))


def status(settings: RuntimeSettings, namespace: str | None) -> int:
    instances = asyncio.run(list_instances(settings, namespace))
    now = time.time()
    rows = [
        (
            i.namespace,
            i.component,
            i.endpoint,
            f"{i.instance_id:x}",
            i.address,
            str(i.pid),
            _age(now - i.registered_at),
        )
        for i in instances
    ]
    print(f"discovery: {settings.discovery}")
    print(format_table(COLUMNS, rows) if rows else "no instances")
    for state in read_states(settings.discovery):
        slots = [
            (s["name"], s["state"], str(s["pid"] or "-"), str(s["restarts"]), s["last_exit"] or "-")
            for s in state["slots"]
        ]
        print(f"\nkvbaton serve (pid {state['pid']}), namespace {state['namespace']}:")
        print(format_table(SLOT_COLUMNS, slots))
    return 0
