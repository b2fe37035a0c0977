"""Build a model from a Hugging Face-style directory: native when we have it, else the adapter.

``read_hf_config`` is the one place the directory's config.json is read: the engine
reads it once at start-up and passes it along (to the checks, the sizing, the
runner and ``load_model``); a worker in another process receives it with its
configuration.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig

from compile_runtime.cache.location import cache_root
from compile_runtime.config import CompilationConfig, set_compilation_config
from compile_runtime.cpu.hugepages import moves_held_back
from compile_runtime.cpu.kernel_tuning import tune_linear_kernels, tuning_enabled
from compile_runtime.cpu.linear import pack_linear_weights
from compile_runtime.cpu.quant_gemm import kernel_available as quant_kernel_available
from compile_runtime.distributed.parallel_state import get_pp_world_size, get_tp_world_size
from compile_runtime.models.gguf import GGUFError, gguf_file_in
from compile_runtime.models.llama import ARCHITECTURES, CausalLM
from compile_runtime.models.loader import (
    QUANTIZATIONS,
    ModelFileError,
    NativeUnsupported,
    read_json_object,
)
from compile_runtime.models.mapped_weights import PackedWeightFile
from compile_runtime.models.transformers_adapter import TransformersCausalLM
from compile_runtime.platforms.select import platform_for

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype_and_device(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Layers read the default dtype/device at construction (attention picks its backend)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)


@contextlib.contextmanager
def skip_weight_init() -> Iterator[None]:
    """Layers built inside keep their parameters uninitialised (``torch.nn.init`` is a no-op).

    For models whose every parameter the checkpoint then fills (the loader
    checks it): random initialisation of weights about to be overwritten was
    the largest part of loading a deep model.
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


# config.json's sizes of tensors: each a positive integer where the model has it.
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
# The rotary table holds every position: past 16M (Llama 4 has 10M) it alone takes gigabytes.
MAX_POSITIONS = 1 << 24
_WEIGHT_FILES = (".safetensors", ".gguf", ".bin", ".pt")


def read_hf_config(model_dir: str) -> Any:
    """The model's config (config.json, as transformers reads it: a ``PretrainedConfig``).

    The file is untrusted: a damaged one, a field of the wrong type, or sizes that would
    allocate more than the weights beside it can fill is one ``ModelFileError`` naming the
    file and field, before any tensor is made."""
    path = os.path.join(model_dir, "config.json")
    if os.path.isfile(path):
        read_json_object(path)
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (ImportError, OSError):  # no config.json, no such model type installed
        raise
    except Exception as e:  # transformers' checks of the fields: errors of many kinds
        detail = " ".join(str(e).split())[:300]
        raise ModelFileError(
            f"{path}: {detail} ({type(e).__name__}); fix the field or restore the file"
        ) from None
    _check_sizes(config, path, model_dir)
    return config


def _check_sizes(config: Any, path: str, model_dir: str) -> None:
    for field in (*_SIZES, "max_position_embeddings"):
        value = getattr(config, field, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ModelFileError(f"{path}: {field} is {value!r}, not a positive integer")
        if value is not None and value < 1:
            raise ModelFileError(f"{path}: {field} is {value}, not a positive integer")
    positions = getattr(config, "max_position_embeddings", None) or 0
    if positions > MAX_POSITIONS:
        raise ModelFileError(
            f"{path}: max_position_embeddings is {positions}, past the {MAX_POSITIONS} this "
            "engine builds a rotary table for; set it to the length the model was trained to"
        )
    vocab, hidden, layers = (
        getattr(config, f, None) or 0 for f in ("vocab_size", "hidden_size", "num_hidden_layers")
    )
    # A lower bound on the weights: the embedding, and one hidden x hidden map per layer.
    least = vocab * hidden + layers * hidden * hidden
    held = sum(
        os.path.getsize(os.path.join(model_dir, f))
        for f in os.listdir(model_dir)
        if f.endswith(_WEIGHT_FILES)
    )
    if held and least > 8 * held:  # even at one bit a weight the files are too small
        raise ModelFileError(
            f"{path}: vocab_size={vocab}, hidden_size={hidden} and num_hidden_layers={layers} "
            f"need at least {least} weights, more than the {held} bytes of weight files in "
            f"{model_dir} hold; this config.json does not belong to these weights"
        )


def resolve_quantization(
    quantization: str, model_dir: str, device: torch.device, native: bool
) -> str:
    """What ``quantization`` means here: "auto" keeps a GGUF file's Q8_0/Q4_0/Q4_1 weights
    quantized ("gguf") and leaves a float checkpoint as it is ("none"); "int8" makes a
    float checkpoint's linear weights Q8_0. The quantized kernels are CPU kernels of the
    native models: elsewhere the weights dequantize (one log line says so)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not one of {list(QUANTIZATIONS)}")
    is_gguf = gguf_file_in(model_dir) is not None
    if quantization == "auto":
        quantization = "gguf" if is_gguf else "none"
    if quantization == "gguf" and not is_gguf:
        raise ValueError(
            f'quantization="gguf" needs a GGUF file; {model_dir} is a float checkpoint '
            '(quantization="int8" quantizes it)'
        )
    if quantization == "int8" and is_gguf:
        raise ValueError(
            'quantization="int8" quantizes a float checkpoint; a GGUF file keeps its own '
            'quantization ("gguf", the default) or dequantizes ("none")'
        )
    packs = platform_for(device).packs_weights
    if quantization != "none" and (not packs or not native):
        logger.info(
            "quantization=%s: weights dequantized (the quantized kernels run the native "
            "models on a CPU; this is %s)",
            quantization,
            "the transformers adapter" if packs else device.type,
        )
        quantization = "none"
    if quantization != "none" and not quant_kernel_available():
        logger.warning(
            "quantization=%s: weights dequantized at load: this CPU has no quantized kernel "
            "(it needs AVX2 or AVX512-VNNI, and a C compiler); through dequantized weights at "
            "every call the model would run ~50x slower",
            quantization,
        )
        quantization = "none"
    return quantization


def _packed_weight_file(
    model: nn.Module,
    model_dir: str,
    quantization: str,
    compilation_config: CompilationConfig,
    device: torch.device,
    cpu_pack_weights: bool,
) -> PackedWeightFile | None:
    """Where a native CPU model's processed weights are kept between starts (None: nowhere,
    as when the cache is off)."""
    packs = platform_for(device).packs_weights and cpu_pack_weights
    if not packs or compilation_config.disable_cache:
        return None
    root = cache_root(compilation_config.cache_dir)
    return PackedWeightFile.for_model(model, model_dir, quantization, root)


def load_model(
    model_dir: str,
    compilation_config: CompilationConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    use_transformers: bool = False,
    cpu_pack_weights: bool = True,
    cpu_tune_kernels: bool = False,
    hf_config: Any = None,
    quantization: str = "auto",
) -> nn.Module:
    """The model in ``model_dir`` (a ``CausalLanguageModel``) with its weights, built under
    ``compilation_config``.

    Llama-family architectures use our native implementation; anything else
    (or ``use_transformers=True``) goes through the transformers adapter, and
    so does a Llama-family config the native model cannot run exactly (it
    raises ``NativeUnsupported``; one warning says why). On a CPU the linear
    weights are packed for oneDNN unless ``cpu_pack_weights`` is False (it
    changes the traced graph, so everything that traces a model for the cache
    key loads it here), and with ``cpu_tune_kernels`` each float weight shape gets the
    kernel measured fastest on this CPU per row count (``compile_runtime/cpu/kernel_tuning.py``).
    ``hf_config``: the config already read (None: read it here).
    ``quantization``: see ``resolve_quantization``.
    """
    if hf_config is None:
        hf_config = read_hf_config(model_dir)
    device = torch.device(device)
    packed_file: PackedWeightFile | None = None
    native = hf_config.model_type in ARCHITECTURES and not use_transformers
    quantization = resolve_quantization(quantization, model_dir, device, native)
    with set_compilation_config(compilation_config), default_dtype_and_device(dtype, device):
        if native:
            try:
                with skip_weight_init():  # load_weights fills every parameter or raises
                    model: nn.Module = CausalLM(hf_config)
            except NativeUnsupported as e:
                if get_tp_world_size() > 1 or get_pp_world_size() > 1:
                    raise NativeUnsupported(
                        f"{model_dir}: the native {hf_config.model_type} model cannot run this "
                        f"config ({e}), and the transformers adapter runs on one rank only; "
                        "use tensor_parallel_size=1 and pipeline_parallel_size=1"
                    ) from e
                logger.warning(
                    "%s: the native %s model cannot run this config (%s); running it through "
                    "the transformers adapter instead",
                    model_dir,
                    hf_config.model_type,
                    e,
                )
                native = False
            else:
                packed_file = _packed_weight_file(
                    model, model_dir, quantization, compilation_config, device, cpu_pack_weights
                )
                mapped = packed_file is not None and packed_file.map_into(model)
                if not mapped:
                    plan = {}
                    if quantization != "none":
                        plan = model.quantize_weights(model_dir, quantization)
                    # Into huge pages by the mapping of the file they are saved to, not a copy.
                    with moves_held_back() if packed_file else contextlib.nullcontext():
                        model.load_weights(model_dir)
        if not native:
            if gguf_file_in(model_dir) is not None:
                raise GGUFError(
                    f"{model_dir}: a GGUF file runs only on the native models (this one: "
                    f"{hf_config.model_type!r}{', use_transformers=True' if use_transformers else ''}"
                    "); convert the original checkpoint to safetensors for the adapter"
                )
            model = TransformersCausalLM(model_dir, hf_config, dtype)
    if platform_for(device).packs_weights and cpu_pack_weights:
        with moves_held_back() if packed_file and not mapped else contextlib.nullcontext():
            pack_linear_weights(model)
        if packed_file is not None and not mapped:
            packed_file.save_and_map(model, plan)
        if tuning_enabled(cpu_tune_kernels):
            tune_linear_kernels(model)
    logger.info(
        "loaded %s (%s, %s) from %s",
        type(model).__name__,
        hf_config.model_type,
        "native" if native else "transformers adapter",
        model_dir,
    )
    return model.eval()
