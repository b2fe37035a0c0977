"""The engine core's side, in the driver process: what runs each step and what it keeps.

``scheduler`` (the step loop, preemption) with ``admission`` (what a request must satisfy),
``stop_rules``, the KV blocks (``block_pool``, ``prefix_cache``), the requests (``request``,
``sampling_params``), the grammars' state (``structured_output``) and the drafts' counts
(``spec_decode_stats``); ``scheduler_output`` is what it sends the worker and gets back.
"""
