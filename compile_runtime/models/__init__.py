"""Models: what the runner needs of one (``interface``), the native Llama family (``llama``,
``loader``), the transformers adapter, and ``registry.load_model`` that picks between them."""
