"""The model runner and what feeds it: scheduler, requests and blocks, persistent batch,
block table, sampler."""
