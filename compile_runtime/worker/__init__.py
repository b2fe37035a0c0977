"""The worker's side, in every rank: one step of the scheduler's plan through the model.

``worker`` (one rank: its process group, its step loop) holds the ``model_runner``, which ties
``startup`` (the profiling forward, the KV cache) with ``kv_sizing``,
``cudagraph_plan``, ``step_inputs``, the persistent batch (``input_batch``, ``block_table``),
and the token choice: ``sampling_step`` over ``sampling_metadata``, ``sampler``,
``rejection_sampler`` with ``ngram_proposer`` (speculative decoding) and ``grammar_bitmask``.
``capture_inputs`` gives each graph capture its inputs; ``microbatch`` splits a step in two;
``stage_handover`` passes hidden states from one pipeline stage to the next.
"""
