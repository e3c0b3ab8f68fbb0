"""A mocker worker starts without torch: it computes nothing, and importing torch costs it
about a second of start-up (more on a loaded machine), which the planner's scale-ups wait
for (`bench/planner.py`'s goodput fell from 89.9% to 53-62% when the mocker's path began to
import it). The modules are the ones `kvbaton worker --engine mocker` imports on its way up,
the disaggregated sides' included."""

from __future__ import annotations

import pytest

from tests.helpers import fresh_interpreter

pytestmark = pytest.mark.unit

WORKER_PATH = [
    "kvbaton.cli.main",
    "kvbaton.cli.worker",
    "kvbaton.mocker",
    "kvbaton.workers.llm_worker",
    "kvbaton.disagg.decode_side",
    "kvbaton.disagg.engine_prefill",
    "kvbaton.disagg.prefill_side",
    "kvbaton.engine.vllm_engine",  # `_side` tells a vLLM engine apart by its class
    "kvbaton.kv_transfer",
]


def test_a_mocker_worker_s_modules_do_not_import_torch() -> None:
    script = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in WORKER_PATH)
        + "print(json.dumps(sorted(m for m in ('torch', 'llguidance') if m in sys.modules)))"
    )
    loaded = fresh_interpreter(script, timeout=60)
    assert loaded == [], loaded
