"""CUDA graphs: the wrapper that captures and replays, the dispatcher that decides which graph
a batch runs (and how far it is padded), and the start-up capture of every graph; on a CPU
the same wrapper holds CPU graphs (``cpu_graph.py``: native calls recorded and replayed from
C) and their memory pool shared between sizes (``cpu_graph_pool.py``)."""
