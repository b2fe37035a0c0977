"""PEFT LoRA adapters built locally for tests and benchmarks, and PEFT's own greedy tokens
with them: the reference our LoRA path is compared with."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def make_peft_adapter(
    base_model,
    out_dir: str,
    *,
    r: int,
    target_modules: Sequence[str],
    lora_alpha: float = 16,
    use_rslora: bool = False,
    seed: int = 0,
    scale: float = 1.0,
    **config,
) -> str:
    """Save a LoRA adapter for ``base_model`` (a transformers model, left unchanged) with
    random non-zero A and B (``init_lora_weights=False``), B times ``scale``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        init_lora_weights=False,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        **config,
    )
    peft_model = get_peft_model(base_model, lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    peft_model.unload()  # the base model's modules back as they were
    return out_dir


def peft_greedy(
    base_model, adapter_dir: str | None, prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[list[int]]:
    """transformers + PEFT greedy tokens of each prompt (one at a time, EOS an ordinary token)."""
    from peft import PeftModel

    model = base_model
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(base_model, adapter_dir).eval()
    outs = []
    with torch.no_grad():  # generate's greedy loop, without its EOS handling (min_new_tokens
        for prompt in prompts:  # would forbid EOS, where an engine's ignore_eos only goes on)
            ids = torch.tensor([list(prompt)])
            out = model(input_ids=ids, use_cache=True)
            tokens: list[int] = []
            while True:
                tokens.append(int(out.logits[0, -1].argmax()))
                if len(tokens) == max_tokens:
                    break
                out = model(
                    input_ids=torch.tensor([[tokens[-1]]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
            outs.append(tokens)
    if adapter_dir is not None:
        model.unload()
    return outs
