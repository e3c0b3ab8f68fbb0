"""Moving KV blocks between workers (steps S7-S8): a worker's pool (`KvPool`) and its agent
(`KvTransferAgent`), over shared memory on one host or TCP between hosts."""

from kvbaton.kv_transfer.agent import BACKENDS, KvTransferAgent
from kvbaton.kv_transfer.pool import KvPool, host_id

__all__ = ["BACKENDS", "KvPool", "KvTransferAgent", "host_id"]
