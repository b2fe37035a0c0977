"""Attention: the splitting op (``op``), the layer models use (``layer``), what a layer needs
to know (``spec``), per-step metadata (``metadata``) and which layers share it (``groups``),
the paged KV cache (``kv_cache``), the plain attention maths the reference backend and the
tests share (``dense``), what a backend declares and the one ``AttentionImpl.forward`` that
owns the step's cache write and the output's padding rows (``backend``), and which backend a
layer gets (``selector``: by name, or the first that fits the device).

The implementations live in ``compile_runtime.backends.attention``; ``selector`` imports
them by module name when asked, so this package never depends on them.
"""
