"""CUDA graphs: the wrapper that captures and replays, the dispatcher that decides which graph
a batch runs (and how far it is padded), and the start-up capture of every graph."""
