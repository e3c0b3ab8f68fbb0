"""The planner's records: what it observes each interval, the targets it plans for, the
profile it plans with, and what it decides. (The planner: planner.py.)"""

from __future__ import annotations

import msgspec


class Targets(msgspec.Struct, frozen=True, kw_only=True):
    """The SLA: time to first token and inter-token latency, in milliseconds."""

    ttft_ms: float
    itl_ms: float


class Observation(msgspec.Struct, kw_only=True):
    """One adjustment interval as seen from the frontend's metrics and the workers' loads.

    Rates are per second over the interval; the mean lengths are over the requests that
    completed in it (status 200; 0 when none did). `queued_prefill` counts requests waiting in
    the prefill workers' queues (or, aggregated, the decode workers') at the end of the
    interval."""

    interval_s: float
    request_rate: float = 0.0
    avg_input_tokens: float = 0.0
    avg_output_tokens: float = 0.0
    ttft_ms: float = 0.0  # mean over the interval
    itl_ms: float = 0.0  # mean over the interval
    prefix_hit_rate: float = 0.0  # fraction of prompt tokens found in the KV cache
    queued_prefill: int = 0
    prefill_workers: int = 0
    decode_workers: int = 0


class ProfilePoint(msgspec.Struct, array_like=True):
    x: float
    ms: float


class Profile(msgspec.Struct, kw_only=True):
    """A worker's measured curves, written by `kvbaton profile` and read by the planner.

    `prefill`: prompt tokens of one request -> its prefill time (ms), ascending in tokens.
    `decode`: concurrent decoding sequences (the batch) -> inter-token latency (ms), ascending
    in batch size; measured at `decode_context` tokens of context per sequence."""

    engine: str  # "mocker", "torch"
    model: str
    prefill: list[ProfilePoint] = msgspec.field(default_factory=list)
    decode: list[ProfilePoint] = msgspec.field(default_factory=list)
    decode_context: int = 0

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> Profile:
        return msgspec.json.decode(data, type=cls)


class Decision(msgspec.Struct, kw_only=True):
    """One interval's plan, with every input it was made from (logged and exported)."""

    prefill: int
    decode: int
    predicted_request_rate: float
    predicted_input_tokens: float
    predicted_output_tokens: float
    prefill_demand: float  # tokens/s to prefill
    decode_demand: float  # tokens/s to decode
    prefill_capacity: float  # tokens/s one prefill worker sustains at the TTFT target
    decode_capacity: float  # tokens/s one decode worker sustains at the ITL target
    reasons: list[str] = msgspec.field(default_factory=list)
    # The remaining inputs, defaulted so that older records still decode.
    prefix_hit_rate: float = 0.0
    current_prefill: int = 0
    current_decode: int = 0
