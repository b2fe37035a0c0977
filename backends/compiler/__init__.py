"""Compiler adaptors: turn an FX piece into a callable (Inductor or eager)."""
