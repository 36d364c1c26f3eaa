"""Where a command writes is checked before it runs (core/cli/outputs.py), and ``output=`` is refused by the
commands that do not read it."""

from __future__ import annotations

import pytest

from inferhal.core.cli.main import main


@pytest.fixture
def no_load(monkeypatch):
    import inferhal.core.engine.llm as llm

    monkeypatch.setattr(llm.LLM, "from_config", lambda *a, **k: pytest.fail("ran before refusing the output path"))


@pytest.mark.parametrize("argv,needle", [
    (["generate", "output=/proc/no/x.jsonl"], "output='/proc/no/x.jsonl': cannot write there"),
    (["generate", "output=/tmp"], "output='/tmp' is a folder: give a file name"),
    (["bench", "e2e", "bench.output_dir=/proc/no"], "bench.output_dir='/proc/no': cannot write there"),
    (["qualify", "qualify.output_dir=/proc/no"], "qualify.output_dir='/proc/no': cannot write there"),
    (["plan", "kv", "output=/proc/x.json"], "output='/proc/x.json': cannot write there"),
])
def test_an_unwritable_output_is_refused_before_anything_runs(argv, needle, no_load, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferhal: ") and needle in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["serve"], ["qualify"], ["backends"]])
def test_output_is_refused_where_it_is_not_read(command, no_load, capsys, tmp_path):
    assert main([*command, f"output={tmp_path / 'x.json'}"]) == 2
    assert f"is refused by `inferhal {command[0]}`, which does not read it" in capsys.readouterr().err


def test_a_missing_output_folder_is_created(tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "kv.json"
    assert main(["plan", "kv", f"output={out}"]) == 0
    assert out.stat().st_size > 0 and not list(out.parent.glob(".inferhal-write-check-*"))
