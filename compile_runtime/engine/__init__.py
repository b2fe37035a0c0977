"""The engine: the front end ``cr.LLM`` and the engine core it steps in the driver process,
which reaches the worker on every rank through an executor.

* ``llm``: ``cr.LLM`` (``generate``, ``chat``), shaped as vLLM's offline API;
* ``engine_config``: the engine's configuration, decided once and frozen;
* ``core``: ``EngineCore``, the scheduler's one owner: requests in, one step (schedule, run,
  advance) at a time; ``async_engine``: the online loop the server runs around it;
* ``worker_restarts``: the workers started again after they died, within a budget;
* ``offline_call``: one ``generate`` call's requests stepped until done, and their outputs;
* ``outputs``: ``RequestOutput`` / ``CompletionOutput`` (vLLM's shapes) and the call's stats;
* ``incremental_text``: a request's text as tokens arrive, and its stop strings;
* ``chat``: a conversation through the chat template, as prompt ids;
* ``data_parallel``: ``DataParallelCore``, several engine cores behind one front end.
"""
