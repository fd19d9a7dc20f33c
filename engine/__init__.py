"""splitserve.engine: model, weights, paged KV cache, scheduler, runner, sampler."""
