"""The persistent compile cache, across real processes, and its CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from compile_runtime.cache import manage

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.slow


def worker(
    cache_dir, config: dict | None = None, check: bool = True, threads: int | None = None
) -> tuple[dict, str]:
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "cache_worker.py"),
            "--cache-dir",
            str(cache_dir),
            "--config",
            json.dumps(config or {}),
        ],
        capture_output=True,
        text=True,
        cwd=HERE,
        env=env,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compile_runtime.cli", *args], capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A cache directory holding one entry, written by a cold run."""
    cache = tmp_path_factory.mktemp("cache")
    cold, _ = worker(cache)
    assert cold["inductor"] == 3 and cold["saved"] == 3 and cold["loaded"] == 0
    return cache, cold


def test_second_process_loads_and_moved_cache_still_hits(warm_cache, tmp_path):
    cache, cold = warm_cache
    warm, _ = worker(cache)
    assert warm["inductor"] == 0 and warm["loaded"] == 3 and warm["hits"] == 3
    assert cold["traces"] == 1 and cold["programs"] == 0
    assert warm["traces"] == 0 and warm["programs"] == 1  # the saved program: no trace at all
    assert warm["output"] == cold["output"]
    moved = tmp_path / "moved"
    shutil.copytree(cache, moved)
    again, _ = worker(moved)
    assert again["inductor"] == 0 and again["output"] == cold["output"]


@pytest.mark.parametrize("first, second", [(1, 2), (2, 1)])
def test_a_start_at_another_thread_count_loads_the_entry(tmp_path, first, second):
    """The thread count follows how busy the machine is at start-up; it is not in the key."""
    cold, _ = worker(tmp_path, threads=first)
    warm, _ = worker(tmp_path, threads=second)
    assert (cold["threads"], warm["threads"]) == (first, second)
    assert cold["inductor"] == 3 and warm["inductor"] == 0 and warm["loaded"] == 3
    torch.testing.assert_close(torch.tensor(warm["output"]), torch.tensor(cold["output"]))
    assert len(manage.key_dirs(str(tmp_path))) == 1


def test_kernels_with_the_thread_count_baked_in_have_it_in_the_key(tmp_path):
    baked = {"inductor_compile_config": {"cpp.dynamic_threads": False}}
    cold, _ = worker(tmp_path, baked, threads=1)
    other, _ = worker(tmp_path, baked, threads=2)
    assert cold["inductor"] == 3 and other["inductor"] == 3
    devices = {
        manage.factors_of(str(tmp_path), k)["device"] for k in manage.key_dirs(str(tmp_path))
    }
    assert len(devices) == 2 and all(d.endswith(("1t", "2t")) for d in devices)


def test_changed_config_misses_and_explain_names_the_field(warm_cache, tmp_path):
    cache = tmp_path / "c"
    shutil.copytree(warm_cache[0], cache)
    changed, _ = worker(cache, {"compile_sizes": [4]})
    assert changed["inductor"] == 6  # 3 pieces x (general + 4): nothing from the old entry
    keys = manage.key_dirs(str(cache))
    assert len(keys) == 2
    old = next(k for k in keys if manage.factors_of(str(cache), k)["config"]["compile_sizes"] == [])
    new = next(k for k in keys if k != old)
    out = cli("cache", "--cache-dir", str(cache), "explain", old, new, "--json")
    assert out.returncode == 0, out.stderr
    diff = json.loads(out.stdout)["differences"]
    assert diff == [{"factor": "config.compile_sizes", "old": [], "new": [4]}]
    table = cli("cache", "--cache-dir", str(cache), "explain", old[:8], new[:8]).stdout
    assert "config.compile_sizes" in table and "[4]" in table


def test_processes_starting_together_end_with_one_good_entry(tmp_path):
    cache = tmp_path / "fleet"
    cmd = [sys.executable, os.path.join(HERE, "cache_worker.py"), "--cache-dir", str(cache)]
    procs = [
        subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert len(manage.list_entries(str(cache))) == 1
    assert all(r["ok"] for r in manage.verify(str(cache)))
    assert worker(cache)[0]["inductor"] == 0


def _artifacts(cache) -> list[str]:
    (key,) = manage.key_dirs(str(cache))
    entry = manage.list_entries(str(cache))[0]
    return [os.path.join(cache, key, r["artifact"]) for r in entry.artifacts.values()]


def _corrupt(paths: list[str]) -> None:
    truncate, flip, delete = paths[:3]
    with open(truncate, "r+b") as f:
        f.truncate(os.path.getsize(truncate) // 2)
    with open(flip, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.unlink(delete)


def test_corruption_is_detected_quarantined_and_recompiled(warm_cache, tmp_path):
    cache = tmp_path / "c"
    shutil.copytree(warm_cache[0], cache)
    _corrupt(_artifacts(cache))
    report = cli("cache", "--cache-dir", str(cache), "verify", "--json")
    assert report.returncode == 1
    problems = json.loads(report.stdout)[0]["problems"]
    assert len(problems) == 3 and any("missing" in p for p in problems)
    assert any("bytes" in p for p in problems) and any("sha256" in p for p in problems)

    result, stderr = worker(cache)
    assert result["output"] == warm_cache[1]["output"] and result["inductor"] == 3
    assert stderr.count("is damaged") == 1 and "moved it to" in stderr
    assert "rm -rf" not in stderr
    assert os.listdir(cache / "quarantine")
    assert all(r["ok"] for r in manage.verify(str(cache)))

    _corrupt(_artifacts(cache))
    fixed = cli("cache", "--cache-dir", str(cache), "verify", "--fix")
    assert fixed.returncode == 0 and "quarantined" not in fixed.stderr
    assert "0 ok, 1 corrupt" in fixed.stdout
    assert manage.list_entries(str(cache)) == []  # moved aside, not deleted
    assert len(os.listdir(cache / "quarantine")) == 2


def test_export_import_into_empty_cache_hits(warm_cache, tmp_path):
    cache = warm_cache[0]
    (key,) = manage.key_dirs(str(cache))
    archive = tmp_path / "entry.tar.gz"
    out = cli("cache", "--cache-dir", str(cache), "export", key, "-o", str(archive))
    assert out.returncode == 0, out.stderr
    fresh = tmp_path / "fresh"
    out = cli("cache", "--cache-dir", str(fresh), "import", str(archive), "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == {"key": key}
    assert worker(fresh)[0]["inductor"] == 0
    # A damaged archive is refused and installs nothing.
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(archive.read_bytes()[:200])
    empty = tmp_path / "empty"
    out = cli("cache", "--cache-dir", str(empty), "import", str(bad))
    assert out.returncode == 2 and manage.key_dirs(str(empty)) == []


def test_cli_list_show_prune_clear(warm_cache, tmp_path):
    cache = tmp_path / "c"
    shutil.copytree(warm_cache[0], cache)
    (key,) = manage.key_dirs(str(cache))
    listed = cli("cache", "--cache-dir", str(cache), "list")
    assert listed.returncode == 0 and key in listed.stdout and "ToyModel" in listed.stdout
    rows = json.loads(cli("cache", "--cache-dir", str(cache), "list", "--json").stdout)
    assert rows[0]["key"] == key and rows[0]["num_pieces"] == 3 and rows[0]["size_bytes"] > 0
    shown = cli("cache", "--cache-dir", str(cache), "show", key[:6])
    assert "key factors:" in shown.stdout and "computation_graph.py" in shown.stdout
    data = json.loads(cli("cache", "--cache-dir", str(cache), "show", key, "--json").stdout)
    assert data["factors"]["versions"]["torch"] and os.path.exists(data["entries"][0]["graph"])
    assert cli(
        "cache", "--cache-dir", str(cache), "prune", "--older-than", "30d"
    ).stdout.startswith("nothing")
    assert key in cli("cache", "--cache-dir", str(cache), "prune", "--max-size", "1K").stdout
    assert manage.key_dirs(str(cache)) == []
    shutil.copytree(warm_cache[0], cache, dirs_exist_ok=True)
    assert "removed 1 entry" in cli("cache", "--cache-dir", str(cache), "clear").stdout


@pytest.mark.parametrize(
    "args",
    [
        ["cache", "show"],
        ["cache", "show", "nosuchkey"],
        ["cache", "prune"],
        ["cache", "prune", "--max-size", "lots"],
        ["cache", "explain", "onlyone"],
        ["cache", "export", "k", "-o", "out.zip"],
        ["cache", "frobnicate"],
    ],
)
def test_cli_bad_arguments_exit_2(args, tmp_path):
    out = cli(args[0], "--cache-dir", str(tmp_path), *args[1:])
    assert out.returncode == 2 and out.stderr


def test_explain_model_says_hit_or_names_the_changed_field(model_dirs, tmp_path):
    """`explain --model` traces without compiling; keys do not depend on the working directory."""
    model_dir = model_dirs("llama")
    cache = str(tmp_path / "c")
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "compile_runtime.cli",
            "generate",
            "--model",
            model_dir,
            "--prompt",
            "hello",
            "--max-tokens",
            "2",
            "-O",
            json.dumps({"cache_dir": cache}),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    hit = subprocess.run(
        [
            sys.executable,
            "-m",
            "compile_runtime.cli",
            "cache",
            "--cache-dir",
            cache,
            "explain",
            "--model",
            model_dir,
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert hit.returncode == 0, hit.stderr[-2000:]
    assert json.loads(hit.stdout)["hit"] is True
    miss = cli(
        "cache",
        "--cache-dir",
        cache,
        "explain",
        "--model",
        model_dir,
        "--config",
        '{"compile_sizes": [8]}',
    )
    assert miss.returncode == 0 and miss.stdout.startswith("would miss")
    assert "config.compile_sizes" in miss.stdout
