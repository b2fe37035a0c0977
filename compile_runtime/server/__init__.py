"""The OpenAI-compatible HTTP server (``compile-runtime serve``) on the online engine.

In the order a request goes through it:

* ``run.py``: ``serve``, uvicorn on the app; SIGTERM lets running requests finish.
* ``app.py``: the FastAPI app, its routes and lifespan.
* ``protocol.py``: the request bodies (pydantic; an unknown field is a 400).
* ``handlers.py``: ``Server``, the engine and the completion and chat handlers.
* ``engine_inputs.py``: a request as prompt token ids and one ``SamplingParams`` per choice.
* ``streaming.py``: following the choices' requests, whole or as server-sent events.
* ``choice.py``: one choice's text, detokenized incrementally and cut at stop strings.
* ``openai_format.py``: the response bodies and stream chunks.
* ``errors.py``: OpenAI-shaped error bodies and the app's error handlers.
* ``metrics.py``: the Prometheus ``/metrics``.
"""
