"""The calls between the workers of a disaggregated request (docs/architecture.md, "The
disaggregation protocol"). Each endpoint takes one request type and answers one type.

- `kv_release` (prefill-first, to the prefill worker): `KvRelease` -> `KvReleased`.
- `kv_claim` (decode-first, to the decode worker): `KvClaim` -> `KvClaimAnswer`, a stream the
  writer holds open until it reported.
- `kv_ready` (decode-first, to the decode worker): `KvReady` -> `Accepted`.
- `kv_abandon` (decode-first, from the router to the decode worker): `KvAbandon` -> `Accepted`.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_SECONDS = 1e6  # a bound that keeps every wait finite
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]


class KvRelease(msgspec.Struct, kw_only=True):
    """The decode worker read the blocks of `handle`, or will not."""

    handle: str


class KvReleased(msgspec.Struct, kw_only=True):
    """Whether the prefill worker held the blocks until this release."""

    released: bool


class KvClaim(msgspec.Struct, kw_only=True):
    """A prefill worker claims `room` before its first write; each write ends within
    `timeout_s`."""

    room: str
    timeout_s: Seconds


class KvClaimAnswer(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Accepted: the decode worker waits for the report at least `wait_s` after the claim."""

    accepted: bool
    wait_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)] | None = None


class KvReady(msgspec.Struct, kw_only=True):
    """The writer's report: its writes have ended, or will have in `linger_s` (a write that
    failed may still land until then); the blocks hold the prompt's KV if `ok`. `token_ids`:
    sampled by the prefill worker (the first token)."""

    room: str
    ok: bool
    token_ids: list[int] = msgspec.field(default_factory=list)
    linger_s: Seconds = 0.0


class KvAbandon(msgspec.Struct, kw_only=True):
    """No prefill worker will write into `room` unless one already claimed it."""

    room: str


class Accepted(msgspec.Struct, kw_only=True):
    """Whether the message changed the room (False: it had ended, or is unknown)."""

    accepted: bool
