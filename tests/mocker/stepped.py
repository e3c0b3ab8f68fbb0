"""A mocker engine stepped by hand, for tests that need no event loop."""

from __future__ import annotations

from pathlib import Path

from kvbaton.engine import LLMEngine
from kvbaton.engine.connector import EngineRequest
from kvbaton.mocker import MockerRunner, MockerTiming
from kvbaton.mocker.runner import mocker_config
from kvbaton.protocols.kv import KvEvent
from kvbaton.protocols.llm import EngineOutput, SamplingParams


class Mocker:
    """A mocker engine stepped by hand; each step's simulated seconds are recorded.

    - Its KV pool: 32 blocks of 4 tokens unless `config` says otherwise.
    """

    def __init__(self, model: Path, timing: MockerTiming | None = None, **config: object) -> None:
        self.sleeps: list[float] = []
        self.outputs: dict[str, list[EngineOutput]] = {}  # by request, as `run` gave them
        self.events: list[KvEvent] = []
        self.runner = MockerRunner(model, timing or MockerTiming())
        options = {"num_kv_blocks": 32, "block_size": 4, **config}
        self.engine = LLMEngine(
            mocker_config(model=str(model), **options), self.events.append, self.runner
        )
        self.runner.blocks = self.engine.blocks

    def run(self, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
        outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
        finals: dict[str, EngineOutput] = {}
        self.outputs |= {rid: [] for rid in prompts}
        for rid, tokens in prompts.items():
            self.engine.add_request(EngineRequest(rid, tokens, params))
        while self.engine.has_unfinished():
            busy = self.runner.busy_seconds
            step = self.engine.step()
            self.sleeps.append(self.runner.busy_seconds - busy)
            for out in step:
                self.outputs[out.request_id].append(out)
                outputs[out.request_id] += out.token_ids
                if out.finish_reason:
                    finals[out.request_id] = out
        self.finals = finals
        return outputs
