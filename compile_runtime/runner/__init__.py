"""The scheduler and the model runner, each split by concept.

Scheduler side: ``scheduler`` (the step loop, preemption) with ``admission``,
``stop_rules``, ``prefix_cache``, ``block_pool``, ``request``; ``scheduler_output``
is the protocol to the runner (``scheduler_invariants``: the tests' checker).
Runner side: ``model_runner`` ties ``startup`` (KV cache, start-up times),
``cudagraph_plan``, ``attention_groups``, ``step_inputs``, ``sampling_step``, the
persistent batch (``input_batch``, ``block_table``), the samplers and the n-gram
proposer; ``cpu_threads`` and ``kv_sizing`` are decided once per engine.
"""
