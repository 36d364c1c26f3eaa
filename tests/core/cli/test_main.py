"""The inferhal command: subcommands, overrides, errors and multirun."""

from __future__ import annotations

import pytest

from inferhal.core.cli.main import commands, main, split_argv


def test_split_argv():
    assert split_argv(["plan", "kv", "model=x", "-m"]) == (["plan", "kv"], ["model=x"], ["-m"])


def test_commands_include_the_foundation_set():
    assert {"backends", "config", "generate"} <= set(commands())


def test_config_prints_the_composed_config(capsys):
    assert main(["config", "backend=cuda_sm100", "backend.interpret=true"]) == 0
    out = capsys.readouterr().out
    assert "name: cuda_sm100" in out and "interpret: true" in out


@pytest.mark.parametrize("argv,needle", [
    (["config", "backend=nope"], "unknown option 'nope' for config group 'backend'"),
    (["config", "scheduler.max_num_seqs=abc"], "scheduler.max_num_seqs"),
    (["confg"], "Did you mean 'config'?"),
    (["config", "--frobnicate"], "unknown flag"),
    (["kernels", "compile"], "target= is required (cuda_sm100: sm_100a"),
    (["plan", "kv", "model.max_model_len=0"], "model.max_model_len must be >= 2"),
    (["plan", "model.max_model_len=-5"], "model.max_model_len must be >= 2"),
])
def test_bad_input_exits_non_zero_with_a_clear_message(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_backends_table_lists_every_backend_with_reason(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "cuda_sm100", "ascend950"):
        assert name in out
    assert "available" in out and "unavailable" in out and "torch_npu is not installed" in out
    assert "fallback" in out  # the coverage matrix


def test_multirun_sweeps(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "-m", "scheduler.max_num_seqs=8,16"]) == 0
    out = capsys.readouterr().out
    assert "max_num_seqs: 8" in out and "max_num_seqs: 16" in out


def test_multirun_validates_before_sweeping(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "-m", "backend=reference,nope"]) == 2
