"""Reading a PEFT LoRA directory and checking it against the base model, before any of it
is used: what cannot be applied exactly is a ``LoRAAdapterError`` naming the file and what
to do, and the engine goes on serving the others.

Applied as PEFT computes it: ``y = W x + (B A x) * scaling``, with ``scaling`` =
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), per module from
``rank_pattern`` / ``alpha_pattern`` where they name it. The scaling is folded into B.
Not applied (an error): DoRA, ``modules_to_save``, trained biases (``bias`` other than
"none"), ``fan_in_fan_out`` weights, adapters on the embedding or LM head, a rank over
``max_lora_rank``, shapes another model has.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from compile_runtime.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, and which of the base model's sizes they map.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<which>lora_A|lora_B)(?:\.[\w-]+)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """An adapter directory that cannot be applied to this base model."""


@dataclass
class LoRAAdapter:
    """One adapter's weights: module path (``model.layers.0.self_attn.q_proj``) to
    ``(A [r, in], B [out, r] * scaling)`` in float32."""

    request: LoRARequest
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def name(self) -> str:
        return self.request.lora_name


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of each projection an adapter may target, for a Llama-family config."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {
        "q_proj": (hidden, heads * head),
        "k_proj": (hidden, kv_heads * head),
        "v_proj": (hidden, kv_heads * head),
        "o_proj": (heads * head, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: a key names a module by its path's end."""
    for key, value in (patterns or {}).items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return value
    return default


def _read_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter directory {path!r} does not exist")
    if not os.path.isfile(config_path):
        raise LoRAAdapterError(f"{config_path}: missing; a PEFT LoRA directory has one")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{config_path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_path}: not a JSON object")
    unsupported = []
    if config.get("peft_type", "LORA") != "LORA":
        unsupported.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
    if config.get("use_dora"):
        unsupported.append("use_dora (DoRA)")
    if config.get("modules_to_save"):
        unsupported.append(f"modules_to_save {config['modules_to_save']}")
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias {config['bias']!r} (trained biases)")
    if config.get("fan_in_fan_out"):
        unsupported.append("fan_in_fan_out")
    if unsupported:
        raise LoRAAdapterError(f"{config_path}: cannot apply {', '.join(unsupported)}")
    return config


def load_adapter(
    request: LoRARequest, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int
) -> LoRAAdapter:
    """Read and check ``request``'s directory against the base model's projection ``shapes``
    (``projection_shapes``) and ``num_layers``; the adapter, scaling folded into B."""
    from safetensors import safe_open

    config = _read_config(request.lora_path)
    weights_path = os.path.join(request.lora_path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        bin_hint = (
            " (adapter_model.bin is not read: save with safetensors)"
            if os.path.isfile(os.path.join(request.lora_path, "adapter_model.bin"))
            else ""
        )
        raise LoRAAdapterError(f"{weights_path}: missing{bin_hint}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            for key in f.keys():
                match = _KEY.match(key)
                if match is None:
                    raise LoRAAdapterError(
                        f"{weights_path}: tensor {key!r} is not a LoRA A or B weight"
                    )
                pairs.setdefault(match["module"], {})[match["which"]] = f.get_tensor(key)
    except LoRAAdapterError:
        raise
    except Exception as e:  # a damaged file: safetensors' own error, named
        raise LoRAAdapterError(f"{weights_path}: not a readable safetensors file ({e})") from None
    if not pairs:
        raise LoRAAdapterError(f"{weights_path}: holds no LoRA weights")
    weights = {}
    top_rank = 0
    for module, pair in sorted(pairs.items()):
        weights[module] = _checked_pair(
            module, pair, config, shapes, num_layers, max_rank, weights_path
        )
        top_rank = max(top_rank, weights[module][0].shape[0])
    return LoRAAdapter(request, top_rank, weights)


def _checked_pair(
    module: str,
    pair: dict[str, torch.Tensor],
    config: dict[str, Any],
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
    max_rank: int,
    weights_path: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = module.rsplit(".", 1)[-1]
    layer = re.search(r"\.layers\.(\d+)\.", module)
    if leaf not in shapes or layer is None:
        raise LoRAAdapterError(
            f"{weights_path}: an adapter on {module!r} cannot be applied; adapters may "
            f"target {', '.join(PROJECTIONS)} of the decoder layers (not the embedding or "
            "the LM head)"
        )
    if int(layer[1]) >= num_layers:
        raise LoRAAdapterError(
            f"{weights_path}: {module!r} names layer {layer[1]}; the base model has "
            f"{num_layers} layers: the adapter was trained for another model"
        )
    if set(pair) != {"lora_A", "lora_B"}:
        raise LoRAAdapterError(f"{weights_path}: {module!r} has {sorted(pair)} but needs A and B")
    a, b = pair["lora_A"], pair["lora_B"]
    rank = a.shape[0]
    in_size, out_size = shapes[leaf]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
        raise LoRAAdapterError(
            f"{weights_path}: {module!r} A {list(a.shape)} and B {list(b.shape)} are not "
            "a LoRA pair ([r, in] and [out, r])"
        )
    if a.shape[1] != in_size or b.shape[0] != out_size:
        raise LoRAAdapterError(
            f"{weights_path}: {module!r} maps {a.shape[1]} -> {b.shape[0]} features; the base "
            f"model's {leaf} maps {in_size} -> {out_size}: the adapter was trained for "
            "another model"
        )
    if rank > max_rank:
        raise LoRAAdapterError(
            f"{weights_path}: {module!r} has rank {rank}, over max_lora_rank={max_rank}; "
            f"start the engine with max_lora_rank >= {rank} (--max-lora-rank)"
        )
    alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
    r = _pattern_value(config.get("rank_pattern"), module, config.get("r", rank))
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return a.float().contiguous(), (b.float() * scaling).contiguous()


class AdapterChecker:
    """The front end's check of each adapter a request names, done once per adapter before
    its first request is queued (the workers read it again when a step needs it)."""

    def __init__(self, sizes: Any, hf_config: Any):
        self.max_rank = sizes.max_lora_rank
        self.shapes = projection_shapes(hf_config)
        self.num_layers = hf_config.num_hidden_layers
        self._checked: set[LoRARequest] = set()

    def check(self, request: LoRARequest) -> None:
        if request not in self._checked:
            load_adapter(request, self.shapes, self.num_layers, self.max_rank)
            self._checked.add(request)

    def forget(self, request: LoRARequest) -> None:
        self._checked.discard(request)
