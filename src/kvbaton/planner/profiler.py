"""Measuring a worker for the planner's performance model (`Profile`), over its `generate`
endpoint, the way the frontend reaches it (`kvbaton profile`, cli/profile.py, starts the worker).

- prefill: one request at a time of `n` random prompt tokens (fresh ones every time, so no
  prefix-cache hit) and `max_tokens=1`; the point is the median time to its first token. That
  includes the request plane's round trip, as a client's TTFT does.
- decode: `b` requests at once of `context` random prompt tokens each, made to generate
  `max_tokens` (EOS ignored); the point is the median over the streams of each one's mean
  time per token while all `b` requests are decoding (after the last first token, before the
  first last token). A mean per stream, not single gaps: outputs reach the caller in clumps
  when steps are short (two tokens read at once make one gap ~0 and the next one double)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import msgspec

from kvbaton.llm.model_cards import model_cards_prefix
from kvbaton.planner.types import Profile, ProfilePoint
from kvbaton.protocols.llm import EngineOutput, ModelCard, PreprocessedRequest, SamplingParams
from kvbaton.runtime import Client, DistributedRuntime, NoInstancesError


@dataclass(frozen=True)
class ProfilePlan:
    """What to measure; `check()` names the first bad value."""

    role: str  # "prefill" or "decode"
    prefill_tokens: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_context: int = 512
    decode_tokens: int = 64  # generated per decode request
    repeats: int = 3  # prefill requests per point
    request_timeout: float = 600.0  # seconds, per request (prefill) or batch (decode)

    def check(self) -> ProfilePlan:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode (got {self.role!r})")
        for name in ("prefill_tokens", "decode_batches"):
            values = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            if not values:
                raise ValueError(f"{flag} needs at least one value")
            if min(values) < 1:
                raise ValueError(f"{flag} values must be positive (got {min(values)})")
            if any(b <= a for a, b in pairwise(values)):
                raise ValueError(f"{flag} values must be strictly ascending")
        for name, least in (("decode_context", 1), ("decode_tokens", 4), ("repeats", 1)):
            if getattr(self, name) < least:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be at least {least} (got {getattr(self, name)})")
        if self.request_timeout <= 0:
            raise ValueError("--request-timeout must be positive")
        return self


@dataclass
class Probe:
    """A worker's `generate` endpoint, its model card and its vocabulary size."""

    client: Client
    card: ModelCard
    vocab_size: int
    rng: random.Random

    def _request(self, tokens: int, max_tokens: int) -> PreprocessedRequest:
        prompt = [self.rng.randrange(self.vocab_size) for _ in range(tokens)]
        sampling = SamplingParams(
            max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        return PreprocessedRequest(model=self.card.name, token_ids=prompt, sampling=sampling)

    async def _stream(
        self, request: PreprocessedRequest, timeout: float
    ) -> list[tuple[float, int]]:
        """(arrival time, tokens) of each output of one request that carries tokens."""
        arrivals: list[tuple[float, int]] = []
        async for out in self.client.round_robin(request, timeout=timeout):
            assert isinstance(out, EngineOutput)
            if out.token_ids:
                arrivals.append((time.monotonic(), len(out.token_ids)))
        return arrivals

    async def warm_up(self, timeout: float) -> None:
        """One small request, so that a worker's lazy setup is not measured."""
        await self._stream(self._request(16, 4), timeout)

    async def prefill_ms(self, tokens: int, timeout: float) -> float:
        request = self._request(tokens, 1)
        started = time.monotonic()
        arrivals = await self._stream(request, timeout)
        if not arrivals:
            raise RuntimeError(f"a request of {tokens} prompt tokens produced no token")
        return (arrivals[0][0] - started) * 1000.0

    async def itl_ms(self, batch: int, context: int, max_tokens: int, timeout: float) -> float:
        requests = [self._request(context, max_tokens) for _ in range(batch)]
        async with asyncio.timeout(timeout):
            streams = await asyncio.gather(*(self._stream(r, timeout) for r in requests))
        if any(len(s) < 2 for s in streams):
            raise RuntimeError(f"a decode request stopped before {max_tokens} tokens")
        all_decoding = max(s[0][0] for s in streams)  # every stream has its first token
        none_done = min(s[-1][0] for s in streams)  # no stream has its last one yet
        itls = []
        for stream in streams:
            window = [(t, n) for t, n in stream if all_decoding <= t <= none_done]
            tokens = sum(n for _, n in window[1:])
            if tokens:
                itls.append((window[-1][0] - window[0][0]) * 1000.0 / tokens)
        if not itls:
            raise RuntimeError(
                f"the {batch} decode requests never ran together (more than the worker's "
                "--max-num-seqs, or too few --decode-tokens)"
            )
        return statistics.median(itls)


async def open_probe(
    runtime: DistributedRuntime,
    endpoint: str,
    timeout: float,
    alive: Callable[[], None] = lambda: None,
    seed: int = 0,
) -> Probe:
    """Wait (at most `timeout` s) for an instance of `endpoint` ("ns.component.generate") and
    its model card; `alive` raises if the worker being waited for is gone."""
    parts = endpoint.split(".")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"--endpoint must be namespace.component.endpoint (got {endpoint!r})")
    namespace, component, _ = parts
    deadline = time.monotonic() + timeout
    client = await runtime.endpoint(endpoint).client(response_type=EngineOutput)
    try:
        while True:
            alive()
            card = await _card(runtime, namespace, endpoint)
            if card is not None and card.instance_id in client.instance_ids():
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no worker serving {endpoint} appeared within {timeout:g}s")
            try:
                await client.wait_for_instances(min(1.0, max(0.1, deadline - time.monotonic())))
            except NoInstancesError:
                continue
            await asyncio.sleep(0.1)  # the instance is there; its card may follow
        files = await _tokenizer_files(runtime, f"{namespace}.{component}.tokenizer_files", card)
        config = msgspec.json.decode(files.get("config.json", b"{}"))
        vocab_size = int(config.get("vocab_size", 0))
        if vocab_size < 2:
            raise ValueError(f"the worker's model {card.name} has no vocab_size in config.json")
        return Probe(client, card, vocab_size, random.Random(seed))
    except BaseException:
        await client.close()
        raise


async def _card(runtime: DistributedRuntime, namespace: str, endpoint: str) -> ModelCard | None:
    for value in (await runtime.discovery.get_prefix(model_cards_prefix(namespace))).values():
        try:
            card = ModelCard.from_json(value)
        except msgspec.DecodeError:
            continue
        if card.endpoint == endpoint:
            return card
    return None


async def _tokenizer_files(
    runtime: DistributedRuntime, endpoint: str, card: ModelCard
) -> dict[str, bytes]:
    client = await runtime.endpoint(endpoint).client()
    try:
        await client.wait_for_instances(30.0)
        files: dict[str, Any] = await client.direct(
            None, card.instance_id, timeout=30.0
        ).__anext__()
    finally:
        await client.close()
    return files


async def measure(
    probe: Probe, plan: ProfilePlan, engine: str, progress: Callable[[str], None]
) -> Profile:
    """The plan's curve of the probed worker (one warm-up request first)."""
    limit = probe.card.context_length
    if plan.role == "prefill" and plan.prefill_tokens[-1] + 1 > limit:
        raise ValueError(
            f"--prefill-tokens {plan.prefill_tokens[-1]} + 1 exceeds the worker's context "
            f"length {limit}"
        )
    if plan.role == "decode" and plan.decode_context + plan.decode_tokens > limit:
        raise ValueError(
            f"--decode-context {plan.decode_context} + --decode-tokens {plan.decode_tokens} "
            f"exceeds the worker's context length {limit}"
        )
    await probe.warm_up(plan.request_timeout)
    profile = Profile(engine=engine, model=probe.card.name)
    if plan.role == "prefill":
        for tokens in plan.prefill_tokens:
            times = [
                await probe.prefill_ms(tokens, plan.request_timeout) for _ in range(plan.repeats)
            ]
            ms = statistics.median(times)
            progress(f"prefill {tokens} tokens: {ms:.2f} ms (median of {plan.repeats})")
            profile.prefill.append(ProfilePoint(float(tokens), ms))
    else:
        profile.decode_context = plan.decode_context
        for batch in plan.decode_batches:
            ms = await probe.itl_ms(
                batch, plan.decode_context, plan.decode_tokens, plan.request_timeout
            )
            progress(f"decode batch {batch} at {plan.decode_context} tokens: ITL {ms:.2f} ms")
            profile.decode.append(ProfilePoint(float(batch), ms))
    return profile


def merge(new: Profile, old: Profile | None) -> Profile:
    """`new`, keeping the other role's curve of `old` if it profiled the same engine and model
    (so that both roles can be profiled into one file)."""
    if old is None or (old.engine, old.model) != (new.engine, new.model):
        return new
    if not new.prefill:
        new.prefill = old.prefill
    if not new.decode:
        new.decode, new.decode_context = old.decode, old.decode_context
    return new


def format_table(points: Sequence[ProfilePoint], x_name: str, y_name: str) -> str:
    rows = [(x_name, y_name), *((f"{p.x:g}", f"{p.ms:.2f}") for p in points)]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{x.rjust(width)}  {y.rjust(9)}" for x, y in rows)
