"""Pluggable backends: compiler adaptors and attention implementations."""
