"""The engine core's side, in the driver process: what runs each step and what it keeps.

``scheduler`` (the step loop, preemption) over the KV blocks (``kv_blocks``: the pool and
the prefix cache's content addresses) and the requests (``request``: their state, what they
must satisfy to be queued, when they stop; ``sampling_params``: how each samples), with the
grammars' state (``structured_output``) and the counters (``stats``: prefix cache hits,
drafts accepted); ``scheduler_output`` is what it sends the worker and gets back.
"""
