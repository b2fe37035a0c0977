"""``/v1/responses`` side by side: the same requests to vLLM's server and ours, the event
types their streams send, in order, compared.

Each server alone on the machine, one after the other (as ``serve_vs_vllm.py`` starts them:
vLLM 0.32 CPU on the float32 HF directory, ours on the GGUF file), greedy:

* ``plain``: a string input, streamed;
* ``instructions``: a message list with instructions, streamed;
* ``forced tool``: a function tool named in ``tool_choice``, streamed;
* ``json_schema``: ``text.format`` a JSON schema, not streamed (the output items' types).

Prints, per request, each side's event types (runs of one type as one, ``delta x N``) and
whether they match; writes JSON. Left out: timing (see ``serve_vs_vllm.py``), reasoning
items and background responses (neither side's model reasons; we refuse ``background``).

    python benchmarks/responses_vs_vllm.py [--out benchmarks/results/responses_vs_vllm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request

from serve_vs_vllm import SERVED_NAME, free_port, install, server_command, stop, wait_ready

from compile_runtime.table import format_table

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BASE = {"model": SERVED_NAME, "temperature": 0, "max_output_tokens": 24}
REQUESTS = {
    "plain": {"input": "Name a colour.", "stream": True},
    "instructions": {
        "instructions": "Answer in one word.",
        "stream": True,
        "input": [{"role": "user", "content": "Capital of France?"}],
    },  # fmt: skip
    "forced tool": {
        "input": "Weather in Paris?",
        "stream": True,
        "max_output_tokens": 40,
        "tools": [{"type": "function", "name": "weather", "parameters": CITY}],
        "tool_choice": {"type": "function", "name": "weather"},
    },  # fmt: skip
    "json_schema": {
        "input": "A city in France, as JSON.",
        "max_output_tokens": 40,
        "text": {"format": {"type": "json_schema", "name": "city", "schema": CITY}},
    },  # fmt: skip
}


def collapse(types: list[str]) -> list[str]:
    out: list[str] = []
    for t in types:
        if out and out[-1].split(" x ")[0] == t:
            n = int(out[-1].split(" x ")[1]) + 1 if " x " in out[-1] else 2
            out[-1] = f"{t} x {n}"
        else:
            out.append(t)
    return [o.split(" x ")[0] + (" x N" if " x " in o else "") for o in out]


def send(port: int, body: dict) -> list[str]:
    """The event types of a streamed response, or the output items' types of a whole one."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/responses", json.dumps({**BASE, **body}).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as e:
        return [f"HTTP {e.code}: {e.read().decode()[:120]}"]
    if not body.get("stream"):
        return ["output: " + item["type"] for item in json.loads(text)["output"]]
    types = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: {"):
                types.append(json.loads(line[6:])["type"])
    return collapse(types)


LOG_DIR = os.path.join(install.PEERS, "logs")


def run_side(side: str) -> dict[str, list[str]]:
    port = free_port()
    cmd, env = server_command(side, "fp32", port)
    os.makedirs(LOG_DIR, exist_ok=True)
    log_path = os.path.join(LOG_DIR, f"responses-{side}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        wait_ready(port, proc, log_path)
        return {name: send(port, body) for name, body in REQUESTS.items()}
    finally:
        stop(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results",
                                                      "responses_vs_vllm.json"))  # fmt: skip
    args = parser.parse_args()
    results = {side: run_side(side) for side in ("vllm", "ours")}
    rows = []
    for name in REQUESTS:
        theirs, ours = results["vllm"][name], results["ours"][name]
        rows.append([name, ", ".join(theirs), ", ".join(ours), "yes" if theirs == ours else "NO"])
    print(format_table(["request", "vLLM 0.32", "ours", "same"], rows))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
