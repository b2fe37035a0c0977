"""CUDA graphs: the wrapper that captures and replays (``wrapper``), the dispatcher that
decides which graph a batch runs and how far it is padded (``dispatcher``), and the start-up
capture of every graph (``capture``); on a CPU the same wrapper holds CPU graphs
(``cpu_graph.py``: native calls recorded and replayed from C), the torch ops a capture lets
through or calls back (``cpu_graph_ops.py``) and their memory pool shared between sizes
(``cpu_graph_pool.py``)."""
