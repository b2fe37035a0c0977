"""FX graph passes and the pass manager."""
