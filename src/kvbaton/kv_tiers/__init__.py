"""KV cache tiers below an engine's pool: host memory and a disk store shared by the workers of
a host (docs/architecture.md, "KV tiers")."""

from kvbaton.kv_tiers.tiers import KvTiers, TierSettings

__all__ = ["KvTiers", "TierSettings"]
