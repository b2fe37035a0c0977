"""``LoRARequest``: which adapter a request runs under, as vLLM's ``LoRARequest`` names it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name``: the adapter's name (the server's model name for it);
    ``lora_int_id``: its unique id, at least 1 (the engine's key for it: a slot, the
    prefix cache); ``lora_path``: the PEFT directory (adapter_config.json +
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(
                f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}"
            )
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name is empty; give the adapter a name")
        if not self.lora_path:
            raise ValueError(
                f"LoRARequest {self.lora_name!r} has no lora_path; give the PEFT directory"
            )

    @property
    def cache_salt(self) -> bytes:
        """What makes its KV blocks its own in the prefix cache (core/kv_blocks.py)."""
        return f"lora:{self.lora_int_id}:{self.lora_path}".encode()
