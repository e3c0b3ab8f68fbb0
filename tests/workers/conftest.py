"""The `handoff` fixture: a started `KvHandoff` on stand-ins (fakes.py), whose transfer timeout
(the wait for a claim) is 0.5 s; closed at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvbaton.workers.kv_handoff import KvHandoff
from tests.workers.fakes import make_handoff


@pytest.fixture
async def handoff() -> AsyncIterator[KvHandoff]:
    made = make_handoff(timeout_s=0.5)
    made.start()
    yield made
    await made.close()
