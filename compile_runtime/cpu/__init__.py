"""The CPU platform's code, in one home: every number this project measures runs here.

Linear layers: ``linear`` (the op: the kernels a float weight can run by and which one runs
a call; each layer's weight processed once after loading), ``kernel_tuning`` (that choice
measured on this CPU, cached), ``packed_weights`` (the one record of what processing made of
a weight, found by the op), ``gemv`` and ``amx`` (C kernels for float weights),
``hugepages`` (weights moved into huge pages). Quantized weights: ``quant_formats`` (GGUF's
Q8_0/Q4_0/Q4_1 blocks in the kernels' layout), ``quant_gemm`` (the int8 VNNI kernel),
``quant_embedding`` (lookups that dequantize only their rows); ``lora`` (each token's LoRA
adapter added to a linear layer's output).

Attention: ``attention`` (the ``cpu_batched`` backend, the CPU default: the whole batch per
layer), ``attention_plan`` (its host plan of each step), ``decode_kernel`` (its C decode
kernel).

CPU graphs: ``graph`` (a size's native calls recorded once and replayed from a C loop),
``graph_ops`` (the torch ops a capture lets through or calls back), ``graph_pool`` (their
memory, shared between sizes).

The C side: ``csrc/`` (plain C with OpenMP, no torch headers), ``c_library`` (builds a
library on first use, in the background from an engine's start), ``c_header`` (its
functions typed from their headers), ``native_function`` (a C function a CPU graph can
record). ``threads``: the engine's OpenMP thread count on the cores it shares.

What the CPU decides for the engine (attention order, no staging copies, graph kind, RAM
budget) is ``compile_runtime/platforms/cpu.py``.
"""
