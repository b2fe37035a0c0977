"""Graphs on either device: the wrapper that captures and replays a piece or the whole
forward per size (``wrapper``), the dispatcher that decides which graph a batch runs and how
far it is padded (``dispatcher``), and the capture of every graph (``capture``). On a GPU
they are CUDA graphs; on a CPU the same wrapper holds CPU graphs
(``compile_runtime/cpu/graph.py``: native calls recorded and replayed from C). The mode
names keep vLLM's API: ``CUDAGraphMode`` covers both."""
