"""Attention backends."""
