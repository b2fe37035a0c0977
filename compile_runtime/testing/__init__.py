"""Scaffolding for tests, examples and benchmarks, not used by the library: small compiled
models (toy, transformer), tiny model directories on disk, and attention test inputs."""
