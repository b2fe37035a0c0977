"""The OpenAI-compatible HTTP server (``compile-runtime serve``) on the online engine."""
