"""``compile-runtime cache ...``: list, show, explain, verify, clear, prune, export, import."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
from typing import Any

from compile_runtime.cache import archive, manage, weight_file
from compile_runtime.cache.location import cache_root, check_root
from compile_runtime.cli.tune import describe
from compile_runtime.cpu.kernel_tuning import TuningTable, list_tables
from compile_runtime.table import format_table

_SIZE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_AGE = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: use a number with K, M, G or T (e.g. 5G)")
    return int(float(m.group(1)) * _SIZE[m.group(2).upper()])


def parse_age(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(
            f"age {text!r}: use a number with s, m, h, d or w (e.g. 30d)"
        )
    return float(m.group(1)) * _AGE[m.group(2)]


def _when(ts: float | None) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=1, default=str) if args.json else text)


def _corrupt_line(path: str, problem: str) -> str:
    return f"CORRUPT {path}: {problem}; {manage.FIX_HINT}"


def cmd_list(args: argparse.Namespace) -> int:
    listed = manage.list_entries(args.root)
    entries = [e for e in listed if not e.problem]
    rows = [
        [
            e.key,
            e.model_tag,
            e.rank,
            _when(e.created),
            _when(e.last_used),
            _mib(e.size_bytes),
            e.num_pieces,
            e.num_shapes,
            e.torch_version,
            e.hits,
        ]
        for e in entries
    ]
    headers = [
        "key",
        "model",
        "rank",
        "created",
        "last used",
        "size",
        "pieces",
        "shapes",
        "torch",
        "hits",
    ]
    damaged = {e.path: e.problem for e in listed if e.problem}
    damaged.update({os.path.join(args.root, e.key): e.key_problem for e in listed if e.key_problem})
    tables = list_tables(args.root)
    weights = weight_file.list_files(args.root)
    text = "\n".join(
        ([format_table(headers, rows)] if rows else [])
        + [_corrupt_line(path, problem) for path, problem in sorted(damaged.items())]
        + _weight_file_lines(weights)
        + _tuning_lines(tables)
    )
    data = [{k: v for k, v in e.to_json().items() if k != "artifacts"} for e in listed]
    data += [
        {"packed_weights": path, "bytes": size}
        | (
            {"problem": h}
            if isinstance(h, str)
            else {"key": h["key"], "tensors": len(h["tensors"])}
        )
        for path, size, h in weights
    ]
    data += [
        {"kernel_tuning": path, **(t.to_json() if isinstance(t, TuningTable) else {"problem": t})}
        for path, t in tables
    ]
    _emit(args, data, text or f"(no entries in {args.root})")
    return 0


def _weight_file_lines(files: list) -> list[str]:
    """The packed-weight files (``cache/weight_file.py``): each one's size and source."""
    if not files:
        return []
    rows = []
    for path, size, header in files:
        if isinstance(header, str):
            rows.append([os.path.basename(path), _mib(size), "-", f"damaged: {header}"])
            continue
        sources = ", ".join(os.path.basename(s[0]) for s in header["key"]["sources"])
        rows.append([os.path.basename(path), _mib(size), len(header["tensors"]), sources])
    table = format_table(["file", "size", "tensors", "source"], rows)
    return [f"\npacked weights ({weight_file.weights_folder('')}):\n{table}"]


def _tuning_lines(tables: list) -> list[str]:
    """The CPU kernel tuning tables (``compile_runtime/cpu/kernel_tuning.py``): each one's CPU and choices."""
    lines = []
    for path, table in tables:
        if not isinstance(table, TuningTable):
            lines.append(
                f"kernel tuning table {path}: {table} (ignored; the next start measures again)"
            )
            continue
        lines.append(f"\nkernel tuning {os.path.basename(path)}:\n{describe(table)}")
    return lines


def cmd_show(args: argparse.Namespace) -> int:
    data = manage.show(args.root, args.key)
    lines = [f"key {data['key']}  ({data['path']})", "", "key factors:"]
    if data["factors_problem"]:
        lines.append("  " + _corrupt_line(data["path"], data["factors_problem"]))
    for name, value in data["factors"].items():
        lines.append(f"  {name}: {json.dumps(value, sort_keys=True)}")
    for e in data["entries"]:
        if e["problem"]:
            lines += ["", _corrupt_line(e["path"], e["problem"])]
            continue
        lines += [
            "",
            f"{e['rank']}/{e['model_tag']}: compiled in {e['compile_seconds']} s, "
            f"{e['hits']} warm starts, graph: {e['graph']}",
        ]
        rows = []
        for key, rec in sorted(e["artifacts"].items()):
            piece_hash, shape, compiler = key.split("/")
            shared = next((p["pieces"] for p in e["pieces"] if p["hash"] == piece_hash), [])
            rows.append(
                [
                    piece_hash,
                    ",".join(map(str, shared)),
                    shape,
                    compiler,
                    _mib(rec["bytes"]),
                    rec.get("compile_seconds"),
                ]
            )
        lines.append(
            format_table(["piece hash", "pieces", "shape", "compiler", "size", "compile s"], rows)
        )
    _emit(args, data, "\n".join(lines))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    if args.keys and (args.config or args.model):
        raise manage.CacheError("give two keys, or --model (and optionally --config), not both")
    if len(args.keys) == 2:
        old_key, new_key = (manage.resolve_key(args.root, k) for k in args.keys)
        diff = manage.explain(
            manage.factors_of(args.root, old_key), manage.factors_of(args.root, new_key)
        )
        header = f"{old_key} vs {new_key}:"
    elif not args.keys and args.model:
        new_key, factors = _factors_for_model(args.model, args.config)
        old_key, diff = manage.closest_entry(args.root, factors)
        if old_key == new_key:
            _emit(
                args,
                {"key": new_key, "hit": True, "differences": []},
                f"would hit: entry {new_key} matches this config and model",
            )
            return 0
        header = f"would miss: this config and model have key {new_key}; " + (
            f"closest entry is {old_key}:" if old_key else "the cache is empty"
        )
    else:
        raise manage.CacheError("explain needs KEY_A KEY_B, or --model DIR [--config JSON]")
    rows = [[path, json.dumps(old), json.dumps(new)] for path, old, new in diff]
    text = (
        header + "\n" + (format_table(["factor", "old", "new"], rows) if rows else "no differences")
    )
    _emit(
        args,
        {
            "old": old_key,
            "new": new_key,
            "hit": False,
            "differences": [{"factor": p, "old": o, "new": n} for p, o, n in diff],
        },
        text,
    )
    return 0


def _factors_for_model(model_dir: str, config_json: str | None) -> tuple[str, dict]:
    """Trace the model once under the config (compiling nothing) to get its key factors."""
    import torch

    from compile_runtime.cache.key import compute_key
    from compile_runtime.compiler.decorator import trace_key_factors
    from compile_runtime.config import parse_config
    from compile_runtime.models.gguf import is_gguf, model_directory
    from compile_runtime.models.registry import load_model

    if not (os.path.isdir(model_dir) or is_gguf(model_dir)):
        raise manage.CacheError(f"--model {model_dir}: no such model directory or .gguf file")
    model_dir = model_directory(model_dir)
    config = parse_config(config_json)
    model = load_model(model_dir, config)
    with torch.no_grad():
        body = getattr(model, "model", model)
        seen = trace_key_factors(body, torch.zeros(4, dtype=torch.long), torch.arange(4))
    if not seen:
        raise manage.CacheError(
            f"the config compiles nothing (mode {config.mode.name}), so it never uses the cache"
        )
    return compute_key(seen[0]), seen[0]


def cmd_verify(args: argparse.Namespace) -> int:
    report = manage.verify(args.root, args.key, fix=args.fix)
    rows = [
        [
            r["key"],
            r["path"],
            "ok" if r["ok"] else "CORRUPT",
            "; ".join(r["problems"]),
            r.get("quarantined_to", ""),
        ]
        for r in report
    ]
    bad = sum(not r["ok"] for r in report)
    text = (
        format_table(["key", "entry", "status", "problems", "quarantined to"], rows)
        if rows
        else "(no entries)"
    ) + f"\n{len(report) - bad} ok, {bad} corrupt"
    _emit(args, report, text)
    return 1 if bad and not args.fix else 0


def cmd_clear(args: argparse.Namespace) -> int:
    removed = manage.clear(args.root, args.key)
    files = [] if args.key else weight_file.clear_files(args.root)
    text = f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}"
    _emit(args, removed + files, text + (f" and {len(files)} packed-weight files" if files else ""))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    removed = manage.prune(args.root, max_size=args.max_size, older_than=args.older_than)
    _emit(
        args,
        removed,
        f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove",
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    key = archive.export(args.root, args.key, args.output)
    _emit(args, {"key": key, "file": args.output}, f"exported {key} to {args.output}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    key = archive.import_archive(args.root, args.file)
    _emit(args, {"key": key}, f"imported {key} into {args.root}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    cache = sub.add_parser("cache", help="inspect and manage the compile cache")
    cache.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default: $COMPILE_RUNTIME_CACHE_DIR or ~/.cache/compile_runtime)",
    )
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)

    def add(name: str, func, help: str) -> argparse.ArgumentParser:
        p = cache_sub.add_parser(name, help=help)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        return p

    add("list", cmd_list, "entries with model, dates, size, pieces, hits")
    add("show", cmd_show, "one entry's key factors, pieces and artifacts").add_argument("key")
    p = add("explain", cmd_explain, "why two entries differ, or why a config and model would miss")
    p.add_argument("keys", nargs="*", metavar="KEY")
    p.add_argument("--config", help="CompilationConfig as JSON (with --model)")
    p.add_argument("--model", help="model directory")
    p = add("verify", cmd_verify, "check every checksum")
    p.add_argument("key", nargs="?")
    p.add_argument("--fix", action="store_true", help="quarantine corrupt entries")
    add("clear", cmd_clear, "remove one entry, or all (packed weights too)").add_argument(
        "key", nargs="?"
    )
    p = add("prune", cmd_prune, "remove entries, least recently used first")
    p.add_argument("--max-size", type=parse_size)
    p.add_argument("--older-than", type=parse_age)
    p = add("export", cmd_export, "pack an entry into a .tar.gz (or .tar.zst)")
    p.add_argument("key")
    p.add_argument("-o", "--output", required=True)
    add("import", cmd_import, "install an exported entry after checking it").add_argument("file")

    def resolve_root(args: argparse.Namespace) -> None:
        args.root = check_root(cache_root(args.cache_dir))

    cache.set_defaults(prepare=resolve_root)
