"""Native model implementations and the transformers adapter."""
