"""Page-locking (pinning) a host buffer for a GPU's copies (docs/architecture.md, "KV tiers").

- A GPU copies between its memory and pinned host memory by DMA, asynchronously; pageable
  memory goes through the driver's staging copies, synchronously.
- `pin` registers the buffer's pages with CUDA; `unpin` undoes it, before the memory is
  unmapped.
- Without CUDA nothing is pinned; a refusal warns once per buffer: copies still work, slower.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def _address(buffer: memoryview) -> int:
    import torch

    return int(torch.frombuffer(buffer, dtype=torch.uint8).data_ptr())


def _cudart() -> Any:
    import torch

    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def pin(buffer: memoryview) -> bool:
    """Register `buffer` with CUDA; whether it is now pinned."""
    import torch

    if len(buffer) == 0 or not torch.cuda.is_available():
        return False
    try:
        torch.cuda.check_error(_cudart().cudaHostRegister(_address(buffer), len(buffer), 0))
    except RuntimeError as e:  # torch.cuda.CudaError is one
        log.warning(
            "could not pin the %.2f GiB KV host buffer (%s): GPU copies stage through pageable "
            "memory",
            len(buffer) / 2**30,
            e,
        )
        return False
    return True


def unpin(buffer: memoryview) -> None:
    """Undo `pin(buffer)`."""
    import torch

    torch.cuda.check_error(_cudart().cudaHostUnregister(_address(buffer)))
