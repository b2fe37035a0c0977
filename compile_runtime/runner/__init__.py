"""Model runner: persistent batch, paged KV cache, block table, scheduler, sampler."""
