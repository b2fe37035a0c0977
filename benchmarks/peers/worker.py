"""One side of ``benchmarks/vs_vllm.py``, in its own process and virtualenv.

Speaks JSON lines: it writes ``{"ready": true, "startup_s": ..., "info": {...}}``
once its engine is built, then answers each request line on stdin

    {"op": "run", "requests": [[prompt_token_ids, max_tokens], ...],
     "loras": [[name, int_id, path] or null, ...]}   (loras: optional; vllm and ours)
        -> {"tokens": [[...], ...], "seconds": wall time of the generate call}
    {"op": "quit"}

with one line on stdout. Everything the libraries print goes to stderr (the
protocol keeps a private copy of the original stdout). Only the standard
library is imported at the top: the side's own library is imported by its
class, in whichever venv runs this file.

    <venv>/bin/python benchmarks/peers/worker.py --side vllm|llamacpp|hf|ours
        --precision fp32|bf16|q8_0|q4_1 --model PATH [--options JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
HF_MIXED_BATCH = 8  # transformers runs unequal prompts in groups of this size, left-padded
PAD = 0  # prompts use ids >= 1000, so the pad id never appears in a prompt

Requests = list[tuple[list[int], int]]
Loras = list[list] | None  # per request [name, int id, PEFT directory] or None


class VLLMSide:
    """vLLM's offline ``LLM`` (CPU build); continuous batching over all requests of a call."""

    def __init__(self, model: str, precision: str, options: dict):
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        kwargs = {"dtype": TORCH_DTYPES[precision], "gpu_memory_utilization": 0.5, "seed": 0}
        self.llm = LLM(model=model, **{**kwargs, **options})
        import vllm

        self.info = {"vllm": vllm.__version__}

    def run(self, requests: Requests, loras: Loras = None) -> list[list[int]]:
        prompts = [{"prompt_token_ids": p} for p, _ in requests]
        # Token ids only, as on every side: no detokenizing.
        params = [
            self.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
            for _, n in requests
        ]
        kwargs = {}
        if loras is not None:
            from vllm.lora.request import LoRARequest

            kwargs["lora_request"] = [spec and LoRARequest(*spec) for spec in loras]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, **kwargs)
        return [list(o.outputs[0].token_ids) for o in outputs]


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


class LlamaCppSide:
    """llama-cpp-python: one sequence at a time (its Python API runs one), greedy sampler."""

    def __init__(self, model: str, precision: str, options: dict):
        import llama_cpp
        import llama_cpp.llama_cpp as low

        default_params = low.llama_model_default_params

        def model_params():
            # On a CPU with AMX the backend's weight-repack (AMX) buffers segfault for Q8_0
            # and Q4_1 (seen on a Sapphire Rapids Xeon): there, every file loads without
            # them. Elsewhere llama.cpp runs as its users run it, repacking included.
            params = default_params()
            params.use_extra_bufts = False
            return params

        self.repack = not cpu_has_amx()
        if not self.repack:
            low.llama_model_default_params = model_params
        threads = os.cpu_count() or 2
        kwargs = {
            "n_ctx": 512,
            "n_batch": 512,
            "n_threads": threads,
            "n_threads_batch": threads,
            "seed": 0,
            "verbose": False,
        }
        self.llm = llama_cpp.Llama(model_path=model, **{**kwargs, **options})
        self.info = {
            "llama_cpp_python": llama_cpp.__version__,
            "threads": threads,
            "weight_repack": self.repack,
        }

    def run(self, requests: Requests) -> list[list[int]]:
        out = []
        for prompt, n in requests:
            self.llm.reset()  # no KV reuse from the previous prompt
            tokens: list[int] = []
            # generate() never stops on EOS by itself (only create_completion does);
            # temp=0 makes its sampler chain greedy, repeat_penalty=1 a no-op.
            for tok in self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0):
                tokens.append(int(tok))
                if len(tokens) == n:
                    break
            out.append(tokens)
        return out


class HFSide:
    """transformers ``generate``, eager PyTorch, greedy, EOS an ordinary token."""

    def __init__(self, model: str, precision: str, options: dict):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        self.torch = torch
        dtype = getattr(torch, TORCH_DTYPES[precision])
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, **options).eval()
        self.model.generation_config.eos_token_id = None  # every request runs to its length
        self.info = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "attn_implementation": self.model.config._attn_implementation,
        }

    def run(self, requests: Requests) -> list[list[int]]:
        equal = len({len(p) for p, _ in requests}) == 1 and len({n for _, n in requests}) == 1
        group = len(requests) if equal else HF_MIXED_BATCH
        out: list[list[int]] = []
        for i in range(0, len(requests), group):
            out += self._generate(requests[i : i + group])
        return out

    def _generate(self, group: Requests) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(n for _, n in group),
                do_sample=False,
                pad_token_id=PAD,
            )
        return [out[i, width : width + n].tolist() for i, (_, n) in enumerate(group)]


class OursSide:
    """``cr.LLM(model, dtype=...)``: the defaults, plus ``--options`` only when asked; a
    quantized file's precision (q8_0, q4_1) leaves ``dtype`` at its default, "auto"."""

    def __init__(self, model: str, precision: str, options: dict):
        import torch

        import compile_runtime as cr

        self.cr = cr
        self.llm = cr.LLM(model, dtype=TORCH_DTYPES.get(precision, "auto"), **options)
        self.info = {
            "compile_runtime": getattr(cr, "__version__", None),
            "dtype": str(getattr(self.llm, "dtype", None)),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "options": options,
        }
        try:
            self.info["startup"] = self.llm.startup.summary()
        except Exception as e:  # an informational line only
            self.info["startup"] = f"unavailable: {e!r}"
        try:
            rc = self.llm.runner_config
            self.info["runner"] = {
                k: getattr(rc, k)
                for k in (
                    "max_num_seqs",
                    "max_num_batched_tokens",
                    "max_model_len",
                    "kv_cache_bytes",
                    "num_threads",
                    "enable_prefix_caching",
                )
                if hasattr(rc, k)
            }
        except Exception as e:
            self.info["runner"] = f"unavailable: {e!r}"

    def run(self, requests: Requests, loras: Loras = None) -> list[list[int]]:
        params = [
            self.cr.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            for _, n in requests
        ]
        kwargs = {}
        if loras is not None:
            from compile_runtime.lora import LoRARequest

            kwargs["lora_request"] = [spec and LoRARequest(*spec) for spec in loras]
        prompts = [p for p, _ in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, **kwargs)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def close(self) -> None:
        self.llm.shutdown()


SIDES = {"vllm": VLLMSide, "llamacpp": LlamaCppSide, "hf": HFSide, "ours": OursSide}


def serve(make_side, answer) -> None:
    """The worker protocol: build the side (``make_side(args)``), say it is ready, then answer
    one JSON line per message (``answer(side, msg)``) until ``{"op": "quit"}``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", required=True)
    parser.add_argument("--precision", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--options", default="{}", help="JSON: extra keyword arguments")
    args = parser.parse_args()

    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own stdout
    os.dup2(2, 1)  # whatever the libraries print goes to stderr
    sys.stdout = sys.stderr

    def send(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    start = time.perf_counter()
    try:
        side = make_side(args)
    except BaseException as e:
        send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        raise
    send({"ready": True, "startup_s": time.perf_counter() - start, "info": side.info})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "quit":
            break
        try:
            send(answer(side, msg))
        except Exception as e:
            import traceback

            traceback.print_exc()
            send({"error": f"{type(e).__name__}: {e}"})
    if hasattr(side, "close"):
        side.close()
    send({"bye": True})


def _answer_run(side, msg: dict) -> dict:
    requests = [(list(p), int(n)) for p, n in msg["requests"]]
    start = time.perf_counter()
    tokens = side.run(requests, msg["loras"]) if msg.get("loras") else side.run(requests)
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


def main() -> None:
    serve(
        lambda args: SIDES[args.side](args.model, args.precision, json.loads(args.options)),
        _answer_run,
    )


if __name__ == "__main__":
    main()
