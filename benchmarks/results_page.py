"""Write docs/results.md from the measured records in docs/results/*.json.

Each JSON file is one benchmark::

    {"benchmark": "vs_vllm", "order": 2, "title": "...", "description": "...",
     "configuration": ["workload", "weights"],
     "records": [{"date": "2026-12-05", "cpu": "...", "command": "python ...", ...}, ...]}

Every record names its date, the CPU it ran on and the exact command; the other fields are
what was measured (units in their names: ``_s``, ``_ms``, ``_tok_s``, ``_gb``) or what was run
(the fields listed in ``configuration``). For each (CPU, configuration) only the most recent
record is shown. Rows are sorted newest first, then by CPU and configuration.

    python benchmarks/results_page.py           # writes docs/results.md
    python benchmarks/results_page.py --check   # exit status 1 if docs/results.md is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "results.md"
FIXED = ["date", "cpu", "command"]
HEADER = """\
# Results

Every row names the date it was measured, the CPU it ran on and the exact command that
measured it; the commands run from the repository root. All CPU runs used 2 cores and
torch's CPU build. Where a benchmark was run more than once on the same CPU and
configuration, only the most recent run is shown. Peers: vLLM 0.32's CPU build and
llama.cpp through llama-cpp-python 0.3.36, each in a virtual environment the benchmark
builds under `benchmarks/.peers/` on first use.

This page is written by `python benchmarks/results_page.py` from the records in
`docs/results/` (one JSON file per benchmark); edit those, not this page. An empty cell
means the benchmark does not measure that field for that row.
"""


def natural_key(value: object) -> tuple:
    """Numbers inside strings compare as numbers: "batch 8" before "batch 16"."""
    if isinstance(value, (int, float)):
        return ((0, float(value), ""),)
    parts = re.split(r"(\d+(?:\.\d+)?)", str(value))
    return tuple((0, float(p), "") if i % 2 else (1, 0.0, p) for i, p in enumerate(parts) if p)


def load(folder: Path = RESULTS) -> list[dict]:
    benchmarks = []
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        for i, record in enumerate(doc["records"]):
            missing = [f for f in FIXED + doc["configuration"] if f not in record]
            if missing:
                raise ValueError(f"{path.name}: record {i} lacks {missing}")
        benchmarks.append(doc)
    return sorted(benchmarks, key=lambda d: (d.get("order", 1000), d["benchmark"]))


def latest(doc: dict) -> list[dict]:
    """The most recent record per (CPU, configuration); a later record in the file wins a tie."""
    kept: dict[tuple, dict] = {}
    for record in doc["records"]:
        key = (record["cpu"], *(json.dumps(record[f]) for f in doc["configuration"]))
        if key not in kept or record["date"] >= kept[key]["date"]:
            kept[key] = record
    return sorted(
        kept.values(),
        key=lambda r: (
            tuple(-ord(c) for c in r["date"]),
            r["cpu"],
            *(natural_key(r[f]) for f in doc["configuration"]),
        ),
    )


def cell(field: str, value: object) -> str:
    if value is None:
        return ""
    text = f"`{value}`" if field == "command" else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def table(doc: dict) -> str:
    records = latest(doc)
    columns = FIXED + list(doc["configuration"])
    for record in doc["records"]:  # the fields in the order the file gives them
        columns += [f for f in record if f not in columns]
    lines = [
        f"## {doc['title']}",
        "",
        doc["description"],
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(cell(c, r.get(c)) for c in columns) + " |" for r in records]
    return "\n".join(lines) + "\n"


def render(folder: Path = RESULTS) -> str:
    return HEADER + "".join("\n" + table(doc) for doc in load(folder))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python benchmarks/results_page.py")
            return 1
        print(f"{PAGE.relative_to(ROOT)} is up to date")
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(page.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
