"""The engine: ``cr.LLM`` runs the scheduler loop in the driver process and reaches the model
runner on every rank through an executor.

* ``llm``: ``cr.LLM`` (``generate``, ``chat``), shaped as vLLM's offline API;
* ``offline_call``: one call's requests stepped until done, and each sample's output;
* ``outputs``: ``RequestOutput`` / ``CompletionOutput`` (vLLM's shapes) and the call's stats;
* ``incremental_text``: a request's text as tokens arrive, and its stop strings;
* ``chat``: a conversation through the chat template, as prompt ids;
* ``core``: ``EngineCore``, one step (schedule, run, advance); ``async_engine``: the online
  loop the server runs (requests join and leave while it steps).
"""
