"""The frontend's serving settings, apart from the code that uses them (the CLI reads their
defaults without importing the serving path)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MigrationSettings:
    """`limit`: migrations per request, at most (0: none). Timeouts in seconds, > 0.

    - `worker_wait_s`: a model whose last worker went stays served this long: a request for it
      (a new one, or one migrating) waits for a worker to come back, then fails with a 503
      (0: at once). The wait counts within `first_output_s`.
    """

    limit: int = 3
    first_output_s: float = 120.0
    idle_s: float = 60.0
    worker_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"the migration limit must be >= 0 (got {self.limit})")
        if not (self.first_output_s > 0 and self.idle_s > 0):
            raise ValueError("the first-output and idle timeouts must be > 0")
        if self.worker_wait_s < 0:
            raise ValueError(f"the worker wait must be >= 0 (got {self.worker_wait_s:g})")


@dataclass(frozen=True)
class CanarySettings:
    """Health canaries (canary.py): `period_s` 0 sends none."""

    period_s: float = 10.0
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.period_s < 0 or self.timeout_s <= 0:
            raise ValueError("the canary period must be >= 0 (0: off) and its timeout > 0")


@dataclass
class BusyThresholds:
    """When a worker counts as busy (load shedding); each None: not checked. Mutable: the
    frontend's `/busy_threshold` route changes it at run time (`update` validates first)."""

    kv_usage: float | None = 0.95  # fraction of its KV blocks in use, at least
    prefill_tokens: int | None = 16384  # prompt tokens waiting for prefill, at least
    retry_after_s: int = 1  # what a shed request is told (Retry-After)

    def __post_init__(self) -> None:
        self.update(**vars(self))

    def update(self, **changes: object) -> None:
        """Apply `changes` (field name -> value) all or none: ValueError names a bad one."""
        merged = {**vars(self), **changes}
        unknown = set(merged) - {"kv_usage", "prefill_tokens", "retry_after_s"}
        if unknown:
            raise ValueError(f"unknown busy threshold {sorted(unknown)[0]!r}")
        kv, prefill, retry = merged["kv_usage"], merged["prefill_tokens"], merged["retry_after_s"]
        if kv is not None and (
            isinstance(kv, bool) or not isinstance(kv, int | float) or not 0 < kv <= 1
        ):
            raise ValueError(f"kv_usage must be in (0, 1] or null (got {kv!r})")
        if prefill is not None and (
            isinstance(prefill, bool) or not isinstance(prefill, int) or prefill < 1
        ):
            raise ValueError(f"prefill_tokens must be a positive integer or null (got {prefill!r})")
        if isinstance(retry, bool) or not isinstance(retry, int) or retry < 0:
            raise ValueError(f"retry_after_s must be an integer >= 0 (got {retry!r})")
        self.kv_usage = None if kv is None else float(kv)
        self.prefill_tokens = prefill
        self.retry_after_s = retry
