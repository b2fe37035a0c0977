"""LoRA adapters served from one base model: many PEFT adapters, each request naming its own.

``request.py``: ``LoRARequest`` (vLLM's). ``adapter.py``: reading and checking a PEFT
directory against the base model. ``slots.py``: the per-layer tensors adapters are loaded
into (``max_loras`` slots) and the op that applies them (``compile_runtime/cpu/lora.py``).
``manager.py``: which adapter sits in which slot (LRU), and each step's token-to-slot map.
"""

from compile_runtime.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from compile_runtime.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRAAdapterError", "LoRARequest", "load_adapter"]
