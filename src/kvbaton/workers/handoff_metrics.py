"""A decode worker's KV handoffs on its `/metrics` (the system server's registry): how its
prefill-first reads and its decode-first rooms ended, by how (`disagg/decode_side.py`,
`READ_ENDINGS`; `disagg/rooms.py`, `ROOM_ENDINGS`).

- Read from the worker's `DecodeSide` when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvbaton.disagg.decode_side import READ_ENDINGS, DecodeSide
from kvbaton.disagg.rooms import ROOM_ENDINGS

Outcome = TypeVar("Outcome", bound=str)


class HandoffCollector(Collector):
    def __init__(self, side: DecodeSide) -> None:
        self.side = side

    def collect(self) -> Iterator[Metric]:
        side = self.side
        yield _ended(
            "reads",
            "Prefill-first reads of a prompt's KV from a prefill worker",
            READ_ENDINGS,
            side.reads_ended,
        )
        yield _ended(
            "rooms",
            "Decode-first rooms (blocks a prefill worker writes a prompt's KV into)",
            ROOM_ENDINGS,
            side.rooms_ended,
        )


def _ended(
    name: str, what: str, endings: Mapping[Outcome, str], counts: Mapping[Outcome, int]
) -> CounterMetricFamily:
    family = CounterMetricFamily(
        f"kvbaton_disagg_{name}",
        f"{what} ended here, by outcome: "
        + "; ".join(f"{how}: {meaning}" for how, meaning in endings.items()),
        labels=["outcome"],
    )
    for how, count in list(counts.items()):
        family.add_metric([how], count)
    return family
