"""Small factories for torch-free unit tests of the scheduler and the block pool."""

from __future__ import annotations

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import SchedulerConfig, SpeculativeConfig
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.request import Request
from splitserve.engine.scheduler import Scheduler

EOS = 2


def make_request(
    request_id: str,
    prompt_len: int = 8,
    max_tokens: int = 4,
    first_token: int = 10,
    adapter_digest: str = "",
    **params,
) -> Request:
    """A request whose prompt is ``first_token, first_token + 1, ...`` (of the LoRA adapter
    of ``adapter_digest``, "": the base model)."""
    prompt = list(range(first_token, first_token + prompt_len))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Request(request_id, prompt, sampling, frozenset({EOS}), adapter_digest)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    speculative: SpeculativeConfig | None = None,
    max_loras: int = 0,
) -> Scheduler:
    kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_loras=max_loras,
    )
    return Scheduler(config, kv_cache, max_model_len, speculative)


def run_step(scheduler: Scheduler, token_id: int = 100):
    """Schedule one step and feed back ``token_id`` for every sampling chunk."""
    output = scheduler.schedule()
    sampled = {chunk.request_id: token_id for chunk in output.chunks if chunk.samples}
    return output, scheduler.update(output, sampled)
