"""User mistakes end every subcommand with a message and exit status 2, never a traceback: an unavailable
or misspelled backend, empty prompts, a prompt too long (on a line of its own, not glued to an echo)."""

from __future__ import annotations

import pytest

from inferhal.core.cli.main import main
from inferhal.core.config.schema import BackendConfig
from inferhal.core.registry import BackendRegistry

#: every subcommand (with its words); the ones that select a backend run nothing before selecting it
SELECTING = [["generate"], ["bench", "e2e"], ["bench", "engine"], ["bench", "ops"], ["bench", "greedy_head"],
             ["qualify"]]
NOT_SELECTING = [["bench", "eplb"], ["backends"], ["config"], ["plan", "kv"], ["kernels", "compile", "target=sm_100a"]]


def _unavailable(name: str) -> bool:
    reg = BackendRegistry.discover()
    return name in reg.records and not reg.probe(name, BackendConfig(name=name)).available


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Commands that write reports or results write them here."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _clean_failure(capsys, needle: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("inferhal: ") and needle in err, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("backend", ["ascend950", "cuda_sm100", "cpu_amx"])
@pytest.mark.parametrize("words", SELECTING, ids=" ".join)
def test_an_unavailable_backend_is_a_clean_failure(words, backend, in_tmp, capsys):
    if not _unavailable(backend):
        pytest.skip(f"{backend} is available on this host")
    out = [f"qualify.output_dir={in_tmp}"] if words == ["qualify"] else []  # a field the others do not read
    assert main([*words, f"backend={backend}", *out]) == 2
    _clean_failure(capsys, f"backend {backend!r} is unavailable")


@pytest.mark.parametrize("words", SELECTING + NOT_SELECTING, ids=" ".join)
def test_a_misspelled_backend_is_a_clean_failure(words, in_tmp, capsys):
    assert main([*words, "backend=cuda_sm1OO"]) == 2
    _clean_failure(capsys, "Did you mean backend=cuda_sm100?")


@pytest.mark.parametrize("arg,needle", [
    ("prompt=", "prompt is empty"),
    ("prompt_ids=[]", "prompt_ids is empty"),
    ("messages=[]", "messages is empty"),
    ("prompts_file=", "prompts_file is empty"),
    ("sampling.logprobs=2", "sampling.logprobs=2: the streamed output shows text only"),
])
def test_empty_input_is_refused_before_the_model_loads(arg, needle, capsys, monkeypatch):
    from inferhal.core.models import registry

    monkeypatch.setattr(registry, "load_model", lambda *a, **k: pytest.fail("loaded a model for a refused input"))
    assert main(["generate", arg]) == 2
    _clean_failure(capsys, needle)


def test_a_prompt_too_long_fails_on_a_line_of_its_own(capsys):
    assert main(["generate", "model=deepseek_v4_tiny", "prompt_ids=[1,2,3,4,5,6,7,8,9]", "model.max_model_len=8"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing streamed before the error
    assert captured.err.startswith("inferhal: prompt 0: ") and "does not fit max_model_len=8" in captured.err


def test_an_unknown_replay_mode_is_a_clean_failure(capsys):
    assert main(["generate", "model=deepseek_v4_tiny", "prompt_ids=[1]", "scheduler.sliding_replay=bogus"]) == 2
    _clean_failure(capsys, "scheduler.sliding_replay must be one of")


@pytest.mark.parametrize("args,needle", [
    (["generate", "cache.block_size=0"], "cache.block_size must be >= 1, got 0"),
    (["plan", "kv", "cache.block_size=-16"], "cache.block_size must be >= 1, got -16"),
    (["generate", "model.max_model_len=0"], "model.max_model_len must be >= 2"),
])
def test_sizes_out_of_range_are_clean_failures(args, needle, capsys):
    prompt = ["prompt_ids=[1]"] if args[0] == "generate" else []  # plan kv reads no prompt
    assert main([*args, "model=deepseek_v4_tiny", *prompt]) == 2
    _clean_failure(capsys, needle)
