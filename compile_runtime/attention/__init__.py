"""Attention: the splitting op (``op``), the layer models use (``layer``), what a layer needs
to know (``spec``), per-step metadata (``metadata``) and which layers share it (``groups``), the paged KV cache (``kv_cache``) and the
plain attention maths the reference backend and the tests share (``dense``).

Import from the modules: the attention backends (``compile_runtime.backends.attention``) sit
between ``metadata``/``kv_cache`` below them and ``layer`` above them.
"""
