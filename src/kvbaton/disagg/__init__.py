"""Disaggregation: the protocol between a prefill worker and a decode worker, in both transfer
orders (docs/architecture.md). Workers and the PrefillRouter use it; the engine is seen only
through its KV connector (`kvbaton.engine.connector`).

- `peers`: the calls; `side`: what both sides share; `prefill_side` (with `push`) and
  `decode_side` (with `rooms`): each side's handlers and state machines.
"""
