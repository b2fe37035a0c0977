"""The compiler: a model's forward traced once, split at attention, each piece compiled.

In the order a first call goes through them:

* ``decorator``: ``@compile`` and the record of what compiling a model produced
  (``CompiledModel``), with the per-model settings (``trace_key_factors``,
  ``trace_at_first_call``, ``set_graph_factory``);
* ``compiled_forward``: one model's compiled forward: the first call traces or loads
  the saved program, later calls run the result directly;
* ``program``: the saved program's one owner (may this call use one, load, save);
  ``program_draft``: what a cold start keeps for it; ``saved_program``: what a program is
  on disk and how it is keyed;
* ``graph_compiler``: the torch.compile backend: passes, split, pieces in place;
* ``split``: the split at the splitting ops; ``graph_hash``: a piece's structural hash;
* ``capture_safety``: what in a piece would break a CUDA graph (host syncs, data-dependent
  shapes and sizes, CPU tensors, failed traces), read off its FX graph on any device;
* ``piece_store``: each piece's callables by (hash, size), loaded or compiled and stored;
* ``piecewise``: a piece at run time: the callable for this step's token count.
"""
