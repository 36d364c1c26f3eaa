"""``inferhal generate`` over EP ranks refuses, before any process starts or any weight loads, everything
the config alone shows a rank would refuse: the layout, an unavailable backend, a dense model, expert
slots that do not divide among the ranks."""

from __future__ import annotations

import time

import pytest

from inferhal.core.cli.main import compose, main
from inferhal.core.errors import UserError
from inferhal.core.cli.generate import generate
from inferhal.core.parallel.ep_generate import check_before_spawn, generate_parallel


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if a rank process starts or a model loads."""
    import torch.multiprocessing as mp

    from inferhal.core.models import registry

    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(mp, "start_processes", lambda *a, **k: pytest.fail("spawned rank processes"))
    monkeypatch.setattr(registry, "load_model", lambda *a, **k: pytest.fail("loaded a model"))


def test_the_ascend_prefill_layout_is_refused_at_once_by_the_cli(no_spawn, capsys):
    t0 = time.perf_counter()
    assert main(["generate", "parallel=ascend_dsv4_prefill_dp4tp4", "model=deepseek_v4_tiny", "prompt_ids=[1,2]"]) == 2
    assert time.perf_counter() - t0 < 30  # was: 64 processes started on a 2-core host, then refused (> 5 min)
    err = capsys.readouterr().err
    assert "parallel.tp=4 is refused" in err and "parallel.role='prefill'" in err and "Traceback" not in err


@pytest.mark.parametrize("overrides,needle", [
    # composed without the config check: what launch itself refuses (a layout built by hand or by a tool)
    (["parallel=ascend_dsv4_prefill_dp4tp4"], "parallel.tp=4: tensor parallelism is not supported yet"),
    (["parallel=dep8", "parallel.ep=4"], "parallel.dp=8 with parallel.ep=4: data-parallel attention runs one "
                                         "attention rank per EP rank"),
    (["parallel=ep2", "parallel.role=decode"], "parallel.role='decode'"),
])
def test_generate_parallel_checks_the_layout_before_spawning(no_spawn, overrides, needle):
    cfg = compose(["model=deepseek_v4_tiny", "prompt_ids=[1,2]", *overrides], "generate", check=False)
    with pytest.raises(UserError, match=needle):
        generate_parallel(cfg, generate)


@pytest.mark.parametrize("overrides,needle", [
    (["model=gemma3_270m"], "model 'gemma3_270m' \\(family gemma3\\) is dense: parallel.ep=2"),
    (["model=deepseek_v4_tiny", "backend=cuda_sm100"], "backend 'cuda_sm100' is unavailable"),
    (["model=deepseek_v4_tiny", "parallel.ep=3"], "8 physical expert slots \\(routed experts\\) do not divide among "
                                                  "parallel.ep=3"),
    (["model=deepseek_v4_tiny", "eplb=default", "eplb.num_redundant_experts=1"], "9 physical expert slots"),
    (["model=deepseek_v4_tiny", "spec=ngram", "spec.num_speculative_tokens=0"], "spec.num_speculative_tokens >= 1"),
])
def test_what_every_rank_would_refuse_is_refused_before_spawning(no_spawn, overrides, needle, capsys):
    cfg = compose(["parallel=ep2", "prompt_ids=[1,2]", *overrides], "generate")
    with pytest.raises(UserError, match=needle):
        check_before_spawn(cfg)
    assert main(["generate", "parallel=ep2", "prompt_ids=[1,2]", *overrides]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("overrides,needle", [
    (["prompt_ids=[1,2]"], "parallel.dp=2 but the job has 1 prompt: 1 DP rank would get no request"),
    (["parallel=dep4", "prompts_file=JOBS"], "parallel.dp=4 but the job has 3 prompts: 1 DP rank would get"),
    (["parallel=dep8", "prompts_file=JOBS"], "parallel.dp=8 but the job has 3 prompts: 5 DP ranks would get"),
    (["prompts_file=JOBS", "parallel.ep=3", "parallel.dp=3"], "8 physical expert slots \\(routed experts\\) do not "
                                                              "divide among parallel.ep=3"),
    (["prompts_file=JOBS", "scheduler.async_scheduling=true"], "scheduler.async_scheduling=true does not run with "
                                                               "data-parallel attention \\(parallel.dp=2\\)"),
    (["prompts_file=/nonexistent.jsonl"], "prompts_file='/nonexistent.jsonl': No such file"),
    (["prompts_file=JOBS", "parallel.master_addr="], "parallel.master_addr is empty: the 2 ranks need a rendezvous"),
])
def test_a_dp_layout_is_refused_before_spawning_with_the_numbers(no_spawn, overrides, needle, tmp_path, capsys):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt_token_ids": [1, 2]}\n\n{"prompt_token_ids": [3]}\n{"prompt_token_ids": [4]}\n')
    overrides = [o.replace("JOBS", str(jobs)) for o in overrides]
    args = ["model=deepseek_v4_tiny", "parallel=dep2", *overrides]
    with pytest.raises(UserError, match=needle):
        check_before_spawn(compose(args, "generate"))
    assert main(["generate", *args]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_the_shipped_dep_layouts_pass_the_checks(no_spawn, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(f'{{"prompt_token_ids": [{i + 1}]}}\n' for i in range(8)))
    for name, world in (("dep2", 2), ("dep4", 4), ("dep8", 8)):
        cfg = compose(["model=deepseek_v4_tiny", f"parallel={name}", f"prompts_file={jobs}"], "generate")
        assert (int(cfg.parallel.dp), int(cfg.parallel.ep)) == (world, world)
        assert check_before_spawn(cfg) == world


def test_a_runnable_layout_passes_the_checks(no_spawn):
    cfg = compose(["model=deepseek_v4_tiny", "parallel=ep2", "eplb=default", "eplb.num_redundant_experts=2"], "generate")
    assert check_before_spawn(cfg) == 2


@pytest.mark.parametrize("name,needle", [
    ("ascend_dsv4_ep16", "backend 'ascend950' is unavailable"),  # runs where torch_npu and CANN are
    ("ascend_dsv4_colocated_dp4tp4", "parallel.tp=4 is refused"),
    ("ascend_dsv4_decode_dp8tp2", "parallel.tp=2 is refused"),
    ("ascend_dsv4_prefill_dp4tp4", "parallel.tp=4 is refused"),
])
def test_the_ascend_layouts_run_or_are_refused_before_spawning(no_spawn, name, needle, capsys):
    assert main(["generate", f"parallel={name}", "backend=ascend950", "model=deepseek_v4_flash", "prompt_ids=[1,2]"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("exchange", ["auto", "exact", "padded"])
def test_a_padded_ep_exchange_is_refused_under_dp_before_spawning(no_spawn, exchange, tmp_path, capsys):
    """DP ranks' eager steps dispatch different row counts: padded's equal-split all-to-all cannot carry them
    (gloo aborted). Refused by name before any rank of generate or serve starts; auto (padded only in captured graph steps) and
    exact start; padded with replicated attention (every rank the same rows) starts too."""
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [3]}\n')
    args = ["model=deepseek_v4_tiny", "backend=cuda_sm100", "backend.interpret=true",
            f"+backend.options.ep_exchange={exchange}", f"prompts_file={jobs}"]
    if exchange != "padded":
        assert check_before_spawn(compose([*args, "parallel=dep2"], "generate")) == 2
    else:
        with pytest.raises(UserError, match=r"backend.options.ep_exchange=padded does not run with data-parallel "
                                            r"attention \(parallel.dp=2\).*leave backend.options.ep_exchange=auto"):
            check_before_spawn(compose([*args, "parallel=dep2"], "generate"))
        assert main(["generate", *args, "parallel=dep2"]) == 2
        assert "ep_exchange=padded" in capsys.readouterr().err
        from inferhal.core.server.serve import check_dp  # `inferhal serve` meets it before its ranks start too

        with pytest.raises(UserError, match=r"backend.options.ep_exchange=padded does not run"):
            check_dp(compose([*args[:-1], "parallel=dep2"], "serve"))
    assert check_before_spawn(compose([*args, "parallel=ep2"], "generate")) == 2
