"""A canary's verdicts without processes: which workers count as unhealthy."""

from __future__ import annotations

import pytest

from kvbaton.frontend.canary import Canary
from kvbaton.frontend.settings import CanarySettings

pytestmark = pytest.mark.unit


class Discovered:
    """Stands in for a model's `generate` client: only the instances it lists."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def instance_ids(self) -> list[int]:
        return list(self.ids)


def test_a_worker_that_left_discovery_is_not_counted_unhealthy() -> None:
    client = Discovered([1, 2, 3])
    canary = Canary(client, "m", [1, 2], CanarySettings())  # type: ignore[arg-type]
    canary.suspect(1, "silent")
    canary.suspect(2, "silent")
    assert canary.unhealthy_live() == {1, 2}
    assert canary.healthy([1, 2, 3]) == [3]
    client.ids = [2, 3]  # 1 left before the canaries' next pass
    assert canary.unhealthy_live() == {2}
    assert canary.healthy([1, 2]) == [1, 2]  # none healthy: all are tried
