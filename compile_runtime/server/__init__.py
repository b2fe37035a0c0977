"""The OpenAI-compatible HTTP server (``compile-runtime serve``) on the online engine, a drop-in
for vLLM's OpenAI server.

In the order a request goes through it:

* ``run.py``: ``serve``, uvicorn on the app; ``drain.py``: SIGTERM lets running requests
  finish (new ones get a 503), then exits 0.
* ``app.py``: the FastAPI app, its routes and lifespan.
* ``access_log.py``: one INFO line per request (status, tokens, seconds).
* ``api_keys.py``: ``--api-key``, a 401 without it; ``request_limits.py``: bounds on the
  body's size, on the large bodies handled at once and on the prompts and choices of one
  request.
* ``request_body.py``: each body decoded and validated as FastAPI does, a large one in a
  thread, off the event loop.
* ``protocol.py``: the request bodies (pydantic), OpenAI's fields and vLLM's extras, every
  field typed; ``validation.py``: its checks past types (text that is not Unicode, the
  shapes of formats and tools, the size bounds of output constraints and lists).
* ``worker_pool.py``: the blocking work of preparing a request (tokenizing, templates,
  constraint checks, adapter loading) in worker threads, each step time-bounded.
* ``chat_template.py``: what a request may pass to the chat template (its own template only
  with ``--trust-request-chat-template``; ``chat_template_kwargs`` the template reads).
* ``unsupported.py``: fields outside them: a 400 naming one the engine cannot honour, else
  one warning naming the unknown ones.
* ``completions.py``, ``chat_completions.py``: the two generating endpoints.
* ``structured.py``, ``tools.py``: structured-output fields and forced tool calls as one
  output constraint; the constrained output as ``tool_calls``; ``grammar_process.py``: its
  grammar compiled first in a child process killed at the time bound.
* ``tool_parsers.py``: ``tool_choice="auto"``: calls in the model family's own syntax
  (hermes, llama3_json) parsed out of free text; ``tool_call_text.py``: calls read out of
  JSON text still growing, and their stream deltas.
* ``tokenization.py``: ``/tokenize`` and ``/detokenize``.
* ``engine_inputs.py``: a request as prompt token ids and one ``SamplingParams`` per choice.
* ``handlers.py``: ``Server``, the engine, and the one way a call's requests reach it.
* ``streaming.py``: following the choices' requests, whole or as server-sent events.
* ``choice.py``: one choice's text, detokenized incrementally and cut at stop strings.
* ``openai_format.py``: the response bodies and stream chunks; ``logprobs.py`` their logprobs.
* ``api_error.py``: the error a handler raises and its OpenAI-shaped body (no web framework needed).
* ``errors.py``: the app's error handlers, so every path answers in that shape.
* ``metrics.py``: the Prometheus ``/metrics``.
* ``responses.py``: ``/v1/responses`` on the chat pipeline; ``response_items.py`` its objects,
  ``response_events.py`` its stream's events, ``response_store.py`` the responses kept.
* ``lora_modules.py``: the LoRA adapters served by name, and the routes that load and unload
  them at run time.
"""
