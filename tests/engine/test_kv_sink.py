"""A request's KV sink is told of each layer of its prompt's KV as the forward pass writes it:
layer i's K and V are in the cache (and final) when it is told, layer i + 1's not yet; every
chunk of a chunked prefill is told every layer, in order, with the blocks that hold it; a
request without a sink, or a step past the prompt, tells nothing."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvbaton.engine import SamplingParams
from kvbaton.engine.connector import EngineRequest, PromptChunk
from tests.engine.reference import engine

pytestmark = pytest.mark.unit
BLOCK = 8


@dataclass
class Recorder:
    cache: torch.Tensor  # [blocks, layers, 2, block_size, kv_heads, head_dim]
    calls: list[tuple[PromptChunk, int]] = field(default_factory=list)
    seen: list[torch.Tensor] = field(default_factory=list)  # the chunk's rows of the layer, then

    def rows(self, chunk: PromptChunk, layer: int) -> torch.Tensor:
        """The chunk's tokens' K and V in `layer`: [tokens, 2, kv_heads, head_dim]."""
        positions = range(chunk.start, chunk.end)
        return torch.stack(
            [
                self.cache[chunk.block_ids[p // BLOCK - chunk.first_block], layer, :, p % BLOCK]
                for p in positions
            ]
        )

    def layer_written(self, chunk: PromptChunk, layer: int) -> None:
        self.calls.append((chunk, layer))
        self.seen.append(self.rows(chunk, layer).clone())
        if layer + 1 < self.cache.shape[1]:
            assert not self.rows(chunk, layer + 1).any(), "the next layer is not computed yet"


def test_the_sink_sees_each_layer_as_it_is_written(tiny_models: dict[str, Path]) -> None:
    eng = engine(
        tiny_models["llama-tied"],
        block_size=BLOCK,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    runner = eng.model_runner
    assert runner is not None and runner.cache is not None
    layers = runner.cache.shape[1]
    sink, decoding = Recorder(runner.cache), Recorder(runner.cache)
    prompt = [(5 * i) % 90 + 4 for i in range(37)]  # 3 chunks of at most 16 tokens, 5 blocks
    eng.add_request(
        EngineRequest("streamed", prompt, SamplingParams(max_tokens=3), hold_kv=True, kv_sink=sink)
    )
    # Runs on to decode: told of its prompt only.
    eng.add_request(
        EngineRequest("decoding", prompt[3:9], SamplingParams(max_tokens=6), kv_sink=decoding)
    )
    eng.add_request(
        EngineRequest("other", prompt[:20], SamplingParams(max_tokens=3))
    )  # no sink: not told
    blocks = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == "streamed":
                blocks = out.kv_blocks
    assert blocks is not None

    chunks = [chunk for chunk, layer in sink.calls if layer == 0]
    assert [layer for _, layer in sink.calls] == list(range(layers)) * len(chunks)
    assert chunks[0].start == 0 and chunks[-1].end == len(prompt)
    assert all(a.end == b.start for a, b in itertools.pairwise(chunks))
    for chunk in chunks:
        first, last = chunk.start // BLOCK, (chunk.end - 1) // BLOCK
        assert chunk.first_block == first and chunk.block_ids == blocks[first : last + 1]
    for (chunk, layer), seen in zip(sink.calls, sink.seen, strict=True):
        assert seen.any()
        assert torch.equal(sink.rows(chunk, layer), seen), "a layer changed after it was told"
    assert [(c.start, c.end, layer) for c, layer in decoding.calls] == [
        (0, 6, layer) for layer in range(layers)
    ]
    eng.release_kv("streamed")
