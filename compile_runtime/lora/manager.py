"""Which adapter sits in which slot, and each step's token-to-slot map (one per runner).

``max_loras`` slots per layer (``slots.py``); an adapter is read from its directory the
first time a step needs it (kept, up to ``max_cpu_loras``, least recently used dropped
first) and put into a slot; when every slot is taken, the least recently used adapter not
in this step is evicted. The scheduler never puts more distinct adapters in one step than
there are slots (``core/scheduler.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from compile_runtime.distributed import ColumnParallelLinear, RowParallelLinear
from compile_runtime.lora.adapter import LoRAAdapter, load_adapter, projection_shapes
from compile_runtime.lora.request import LoRARequest
from compile_runtime.lora.slots import LoRASlots, Part
from compile_runtime.models.loader import NativeUnsupported


class LoRAError(RuntimeError):
    """A step needs more adapters than there are slots (the scheduler prevents it)."""


def _parts(model: nn.Module, leaf: str, layer: nn.Module) -> list[Part]:
    stacked, fused = model._layouts()
    parts = [(s.part, s.shard) for s in stacked if s.fused == leaf]
    if not parts:
        out = layer.output_size if hasattr(layer, "output_size") else sum(layer.local_sizes)
        return [Part(leaf, None, 0, out)]
    return [Part(name, shard, *fused[leaf].offsets[shard]) for name, shard in parts]


def attach_lora(
    model: nn.Module, token_slots: torch.Tensor, max_loras: int, max_rank: int, dtype: torch.dtype
) -> dict[str, LoRASlots]:
    """Give every decoder-layer projection of a native model its slots (``layer.lora``);
    returns them by the path of the module holding the projection (``model.layers.0.mlp``)."""
    if not hasattr(model, "_layouts"):
        raise NativeUnsupported(
            f"LoRA adapters run on the native Llama-family models; {type(model).__name__} is "
            "not one (drop use_transformers, or enable_lora)"
        )
    found: dict[str, LoRASlots] = {}
    for path, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if ".layers." not in f".{path}":
            continue
        parent, leaf = path.rsplit(".", 1)
        module.lora = LoRASlots(
            module, _parts(model, leaf, module), token_slots, max_loras, max_rank, dtype
        )
        found[path] = module.lora
    return found


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        sizes: Any,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """``sizes``: the runner's config (``max_loras``, ``max_lora_rank``,
        ``max_cpu_loras``)."""
        max_loras, max_rank = sizes.max_loras, sizes.max_lora_rank
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = sizes.max_cpu_loras or max_loras
        config = model.config
        self.shapes = projection_shapes(config)
        self.num_layers = config.num_hidden_layers
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self._host_slots = np.full(max_num_tokens, -1, dtype=np.int32)
        self.layers = attach_lora(model, self.token_slots, max_loras, max_rank, dtype)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read, LRU first
        self._loaded: dict[int, LoRARequest] = {}  # slot -> the adapter in it
        self.num_loads = 0  # adapters put into a slot
        self.num_evictions = 0  # adapters taken out of a slot for another

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter read from its directory (once; kept up to ``max_cpu_loras``)."""
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is None or adapter.request != request:
            adapter = load_adapter(request, self.shapes, self.num_layers, self.max_rank)
            self.adapters[request.lora_int_id] = adapter
            while len(self.adapters) > self.max_cpu_loras:
                self.adapters.popitem(last=False)
        self.adapters.move_to_end(request.lora_int_id)
        return adapter

    def activate(self, requests: Sequence[LoRARequest]) -> dict[int, int]:
        """Slots for this step's distinct adapters (id -> slot), loading what is missing."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.max_loras:
            raise LoRAError(
                f"{len(wanted)} adapters in one step, but max_loras={self.max_loras} slots"
            )
        for lora_id in wanted:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
        for lora_id, request in wanted.items():
            if lora_id in self.slot_of and self._loaded[self.slot_of[lora_id]] == request:
                continue
            slot = self.slot_of.pop(lora_id, None)
            if slot is None:
                slot = self._free_slot(wanted)
            self._load(slot, self.adapter(request))
            self.slot_of[lora_id] = slot
        return {lora_id: self.slot_of[lora_id] for lora_id in wanted}

    def _free_slot(self, wanted: dict[int, LoRARequest]) -> int:
        taken = set(self.slot_of.values())
        for slot in range(self.max_loras):
            if slot not in taken:
                return slot
        for lora_id in self.slot_of:  # least recently used first
            if lora_id not in wanted:
                self.num_evictions += 1
                return self.slot_of.pop(lora_id)
        raise LoRAError("no slot to evict")  # activate checked the count

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for path, slots in self.layers.items():
            slots.load(slot, adapter, path.rsplit(".", 1)[0])
        self._loaded[slot] = adapter.request
        self.num_loads += 1

    def prepare_step(
        self, lora_requests: Sequence[LoRARequest | None], num_scheduled: np.ndarray, padded: int
    ) -> bool:
        """Write each token's slot (-1: no adapter; padding too) for a step whose requests
        run ``lora_requests`` over ``num_scheduled`` tokens each; whether any token has one."""
        used = [r for r in lora_requests if r is not None]
        total = int(num_scheduled.sum())
        host = self._host_slots
        if not used:
            host[:padded] = -1
        else:
            slot_of = self.activate(used)
            per_request = np.fromiter(
                (-1 if r is None else slot_of[r.lora_int_id] for r in lora_requests),
                dtype=np.int32,
                count=len(lora_requests),
            )
            host[:total] = np.repeat(per_request, num_scheduled)
            host[total:padded] = -1
        self.token_slots[:padded].copy_(torch.from_numpy(host[:padded]))
        return bool(used)
