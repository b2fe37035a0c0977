"""A fresh process that compiles the toy model with Inductor and reports counters (JSON)."""

from __future__ import annotations

import argparse
import json
import logging

import torch

import compile_runtime as cr
from testing.toy import build

parser = argparse.ArgumentParser()
parser.add_argument("--cache-dir", required=True)
parser.add_argument("--config", default="{}")
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")

config = cr.CompilationConfig.model_validate(
    {"backend": "inductor", "cache_dir": args.cache_dir, **json.loads(args.config)}
)
model = build(config, num_layers=2)
with torch.no_grad():
    out = model(torch.arange(7) % 64)
c = cr.compilation_counter
print(
    json.dumps(
        {
            "inductor": c.num_inductor_compiles,
            "traces": c.num_graphs_seen,
            "programs": c.num_programs_loaded,
            "hits": c.num_cache_hits,
            "misses": c.num_cache_misses,
            "saved": c.num_compiled_artifacts_saved,
            "loaded": c.num_compiled_artifacts_loaded,
            "threads": torch.get_num_threads(),
            "output": out.tolist(),
        }
    )
)
