"""Outputs that arrive together while their reader is busy are read as one (issue 32): the
tokens, logprobs, finish reason and usage the client sees are those of the outputs one by one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvbaton.frontend.postprocess import ChoiceState
from kvbaton.frontend.tool_calls import TOOL_CALL_FORMATS
from kvbaton.frontend.tools import ToolUse
from kvbaton.llm.tokenizer import Tokenizer
from kvbaton.protocols.llm import EngineOutput, KvPoolInfo, KvTarget, TokenLogprob, Usage
from kvbaton.router.policies import RoundRobinRouter, RouteRequest, follow

pytestmark = pytest.mark.unit


def out(tokens: list[int], finish: str | None = None, logprobs: bool = False) -> EngineOutput:
    return EngineOutput(
        request_id="r",
        token_ids=tokens,
        finish_reason=finish,
        usage=Usage(prompt_tokens=3, completion_tokens=9, cached_tokens=2) if finish else None,
        logprobs=[[TokenLogprob(t, -t / 10)] for t in tokens] if logprobs else None,
    )


def test_merged_outputs_keep_token_and_logprob_order_and_the_last_finish() -> None:
    merged = out([5], logprobs=True).merged(out([6, 7], logprobs=True))
    assert merged is not None
    merged = merged.merged(out([8], "stop", logprobs=True))
    assert merged is not None
    assert merged.token_ids == [5, 6, 7, 8]
    assert [lp[0].token_id for lp in merged.logprobs or []] == [5, 6, 7, 8]
    assert (merged.finish_reason, merged.usage) == ("stop", out([], "stop").usage)


def test_merged_outputs_keep_the_first_output_s_prompt_logprobs() -> None:
    prompt = [[TokenLogprob(4, -0.5)], [TokenLogprob(2, -1.5)]]
    first = msgspec.structs.replace(out([5]), prompt_logprobs=prompt)
    merged = first.merged(out([6]))
    assert merged is not None and merged.prompt_logprobs == prompt
    one_token_prompt = msgspec.structs.replace(out([5]), prompt_logprobs=[])
    merged = one_token_prompt.merged(out([6]))
    assert merged is not None and merged.prompt_logprobs == []
    merged = out([5]).merged(out([6]))
    assert merged is not None and merged.prompt_logprobs is None


def test_the_last_output_and_outputs_that_move_kv_stay_apart() -> None:
    pool = KvPoolInfo(layout="l", num_blocks=8, block_bytes=64, host="h")
    target = KvTarget(
        decode_instance_id=1,
        decode_component="ns.decode",
        room="room",
        block_ids=[3],
        first_block=0,
        block_size=4,
        pool=pool,
    )
    assert out([1], "length").merged(out([2])) is None
    assert out([1]).merged(EngineOutput(request_id="r", token_ids=[], kv_blocks=[4])) is None
    assert EngineOutput(request_id="r", token_ids=[], kv_target=target).merged(out([2])) is None


class ArrivedStream:
    """A ResponseStream whose responses have all arrived (a reader that lagged)."""

    def __init__(self, outputs: list[EngineOutput]) -> None:
        self._outputs = iter(outputs)
        self._left = len(outputs)
        self.instance_id: int | None = None
        self.closed = False

    async def open(self) -> ArrivedStream:
        self.instance_id = 7
        return self

    def __aiter__(self) -> ArrivedStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if not self._left:
            raise StopAsyncIteration
        return self.take()

    def ready(self) -> bool:
        return self._left > 0

    def take(self) -> EngineOutput:
        self._left -= 1
        return next(self._outputs)

    async def aclose(self) -> None:
        self.closed = True


async def test_follow_reads_what_arrived_together_as_one_output() -> None:
    router = RoundRobinRouter()
    route = router.route(RouteRequest(token_ids=[1, 2, 3], extra_keys=None), [7])
    stream = ArrivedStream([out([1]), out([2]), out([3], "length")])
    served_by: list[int] = []
    outputs = [o async for o in follow(stream, route, served_by)]  # type: ignore[arg-type]
    assert [o.token_ids for o in outputs] == [[1, 2, 3]]
    assert outputs[0].finish_reason == "length"
    assert served_by == [7] and stream.closed


@pytest.fixture(scope="module")
def tokenizer(chat_model: Path) -> Tokenizer:
    return Tokenizer(chat_model)


def pieces(tokenizer: Tokenizer, text: str) -> Iterator[int]:
    yield from tokenizer.encode(text, add_special_tokens=False)


def test_a_stop_string_inside_a_merged_output_counts_the_tokens_up_to_it(
    tokenizer: Tokenizer,
) -> None:
    ids = list(pieces(tokenizer, "Hello there, France! And more after it."))
    one_by_one = ChoiceState(tokenizer, [1, 2, 3], ["France"])
    texts = []
    for token in ids:
        texts.append(one_by_one.update(out([token], logprobs=True)).text)
        if one_by_one.finished:
            break
    merged = ChoiceState(tokenizer, [1, 2, 3], ["France"])
    delta = merged.update(out(ids, "length", logprobs=True))
    assert (delta.text, delta.finish_reason) == ("".join(texts), "stop")
    assert merged.completion_tokens == one_by_one.completion_tokens < len(ids)
    assert delta.tokens == len(delta.logprobs) == merged.completion_tokens


def test_a_call_read_one_token_at_a_time_streams_its_arguments_merged_or_not(
    tokenizer: Tokenizer,
) -> None:
    ids = list(pieces(tokenizer, '<tool_call>{"name": "f", "arguments": {"city": "Paris"}}'))
    tools = ToolUse(TOOL_CALL_FORMATS["hermes"], "required", [], [], parallel=False)
    one_by_one = ChoiceState(tokenizer, [1, 2, 3], [], tools=tools)
    calls = [c for token in ids for c in one_by_one.update(out([token])).tool_calls]
    merged = ChoiceState(tokenizer, [1, 2, 3], [], tools=tools).update(out(ids)).tool_calls
    for deltas in (calls, merged):
        head, *fragments = deltas
        assert (head.index, head.name, head.arguments) == (0, "f", "")
        assert "".join(d.arguments for d in fragments) == '{"city": "Paris"}'
    assert len(calls) > len(merged) == 2  # one fragment per output: as the arguments are written
