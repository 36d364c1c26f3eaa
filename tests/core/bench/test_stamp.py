"""Every benchmark's JSON says which commit, host and date produced it (core/bench/stamp.py), so
docs/perf/README.md can index a result by its own fields."""

from __future__ import annotations

import ast
import datetime
import json
import os
import pathlib
import subprocess

from omegaconf import OmegaConf

from inferhal.core.bench import stamp as stamp_mod
from inferhal.core.bench import write_json

BENCH = pathlib.Path(stamp_mod.__file__).resolve().parent


def test_the_stamp_names_this_checkouts_commit_the_date_the_command_and_the_host():
    s = stamp_mod.stamp(["/venv/bin/inferhal", "bench", "e2e", "model=gemma3_270m", "bench.concurrency=[1, 8]"])
    head = subprocess.run(["git", "-C", str(stamp_mod.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout (an installed wheel has none: "unknown (...)")
        assert s["commit"].removesuffix("+dirty") == head.stdout.strip()
    else:
        assert s["commit"].startswith("unknown")
    when = datetime.datetime.fromisoformat(s["date"])
    assert when.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 60
    assert s["command"] == "inferhal bench e2e model=gemma3_270m 'bench.concurrency=[1, 8]'"
    assert s["host"]["logical_cpus"] == os.cpu_count() and s["host"]["cpu"]
    assert isinstance(s["host"]["virtual_machine"], bool) and s["torch"] and s["python"]
    json.dumps(s)  # plain data


def test_cpu_ids_reads_the_first_cpus_vendor_family_and_model(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                 "model name\t: AMD EPYC\n\nprocessor\t: 1\nvendor_id\t: Other\n")
    assert stamp_mod.cpu_ids(str(p)) == "vendor_id AuthenticAMD cpu family 25 model 17"
    assert stamp_mod.cpu_ids(str(tmp_path / "missing")) == ""


def test_write_json_stamps_a_dict_result_and_keeps_a_stamp_it_was_given(tmp_path):
    cfg = OmegaConf.create({"output": None, "bench": {"output_dir": str(tmp_path)}})
    got = json.loads(pathlib.Path(write_json(cfg, "r.json", {"rows": [1]})).read_text())
    assert got["rows"] == [1] and set(got["stamp"]) >= {"commit", "date", "command", "host"}
    kept = json.loads(pathlib.Path(write_json(cfg, "s.json", {"stamp": {"commit": "abc"}})).read_text())
    assert kept == {"stamp": {"commit": "abc"}}


def _calls(tree: ast.AST) -> set[str]:
    return {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}


def test_every_bench_that_writes_its_result_stamps_it():
    """A bench module with a ``run`` writes its result through ``write_json`` (which stamps it) or puts
    ``stamp()`` into what it writes itself."""
    unstamped = []
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text())
        if not any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body):
            continue
        calls = _calls(tree)
        if ({"dump", "dumps", "write_text"} & calls) and not ({"write_json", "stamp"} & calls):
            unstamped.append(path.name)
    assert not unstamped, (f"{unstamped} write a result without a stamp: write it with "
                           f"inferhal.core.bench.write_json, or add \"stamp\": stamp() "
                           f"(from inferhal.core.bench.stamp import stamp) to the dict it writes")
