"""What one request may hold in its decode worker's KV (admission's unit of account)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KvDemand:
    """KV a request may hold at its end, in tokens (whole blocks): its prompt plus
    ``max_tokens``, rounded up. (A remote-prefilled prompt takes fresh blocks on the decode
    worker, prefix hits or not, so the figure is exact there.)"""

    num_tokens: int
    num_prompt_tokens: int
    max_tokens: int

    @classmethod
    def of(cls, num_prompt_tokens: int, max_tokens: int, block_size: int) -> KvDemand:
        blocks = math.ceil((num_prompt_tokens + max_tokens) / max(block_size, 1))
        return cls(blocks * max(block_size, 1), num_prompt_tokens, max_tokens)
