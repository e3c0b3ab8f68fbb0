"""How long the mocker's steps take. The defaults are those of Dynamo's mocker, so that results
compare with it: a step costs its prefill time (t = the step's prefill tokens) plus its decode
time (u = the fraction of KV blocks in use), divided by the speedup ratio. A load from the KV
tiers costs the modeled KV's bytes over the tier's bandwidth (`host_gbps`, `disk_gbps`), divided
by the speedup ratio too."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MockerTiming:
    prefill: tuple[float, float, float] = (4.21e-7, 0.01518, 16.5)  # ms = a*t^2 + b*t + c
    decode: tuple[float, float, float] = (-25.74, 54.01, 5.74)  # ms = max(1, a*u^2 + b*u + c)
    speedup_ratio: float = 1.0
    host_gbps: float = 10.0  # GB/s a load from host memory moves
    disk_gbps: float = 2.0  # ... from disk (an NVMe drive's sequential read)

    def __post_init__(self) -> None:
        if self.speedup_ratio <= 0:
            raise ValueError(f"speedup_ratio must be positive (got {self.speedup_ratio})")
        if self.host_gbps <= 0 or self.disk_gbps <= 0:
            raise ValueError("host_gbps and disk_gbps must be positive")
        if len(self.prefill) != 3 or len(self.decode) != 3:
            raise ValueError("prefill and decode take three coefficients each: a, b, c")

    def prefill_ms(self, tokens: int) -> float:
        a, b, c = self.prefill
        return a * tokens * tokens + b * tokens + c

    def decode_ms(self, kv_usage: float) -> float:
        a, b, c = self.decode
        return max(1.0, a * kv_usage * kv_usage + b * kv_usage + c)

    def step_seconds(self, prefill_tokens: int, decodes: int, kv_usage: float) -> float:
        """A step with `prefill_tokens` to prefill and `decodes` sequences decoding."""
        ms = self.prefill_ms(prefill_tokens) if prefill_tokens else 0.0
        if decodes:
            ms += self.decode_ms(kv_usage)
        return ms / 1000.0 / self.speedup_ratio

    def load_seconds(self, host_bytes: int, disk_bytes: int) -> float:
        """A load of `host_bytes` from host memory and `disk_bytes` from disk."""
        seconds = host_bytes / (self.host_gbps * 1e9) + disk_bytes / (self.disk_gbps * 1e9)
        return seconds / self.speedup_ratio


def parse_coefficients(text: str) -> tuple[float, float, float]:
    """ "a,b,c" -> (a, b, c), for the command line."""
    parts = [float(p) for p in text.split(",")]
    if len(parts) != 3:
        raise ValueError(f"expected three comma-separated coefficients, got {text!r}")
    return parts[0], parts[1], parts[2]
