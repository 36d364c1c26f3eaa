"""The tiny DeepSeek-V4 run as EP ranks (gloo on 127.0.0.1): greedy tokens equal the single-process run
before and after a rebalance that moves expert weights between ranks; a diverging rank is reported."""

import ast
import os
import subprocess
import sys

import pytest
import torch

from inferhal.core.parallel.launch import free_port, spawn_from_file

import by_file  # tests/core/parallel (conftest puts it on the path)

WORKERS = by_file.path_of("engine_workers")


def load_workers():
    return by_file.load("engine_workers")


@pytest.fixture(scope="module")
def tiny_llm():
    from inferhal.core.engine.llm import LLM

    return LLM.from_config(load_workers().tiny_cfg())


@pytest.fixture(scope="module")
def reference_tokens(tiny_llm):
    return load_workers().greedy(tiny_llm)


def test_one_rank_ep_with_a_rebalance_equals_the_plain_model(reference_tokens):
    """The EP path in-process (world_size 1): runner, hook, on-demand rebalance with redundant slots."""
    from inferhal.core.backend import ParallelLayout
    from inferhal.core.engine.llm import LLM
    from inferhal.core.parallel.ep_engine import attach_ep

    wk = load_workers()
    # EPLB is refused without parallel.ep > 1 in the config; this rank attaches itself as a world of one
    cfg = wk.tiny_cfg(["parallel=ep2", "eplb=default", "eplb.step_interval=0", "eplb.num_redundant_experts=3",
                       "eplb.layers_per_step=0"])
    llm = LLM.from_config(cfg)
    ep = attach_ep(llm.engine, llm.engine.backend.communicator(ParallelLayout()), cfg.eplb)
    assert not any(k.endswith("mlp.experts.gate_up_proj") for k in llm.engine.model.weights)  # dropped
    ep.request_rebalance()
    assert wk.greedy(llm) == reference_tokens
    assert [r.step for r in ep.rebalances] == [1]
    new = ep.rebalances[0].new
    assert not torch.equal(new.phy2log, ep.rebalances[0].old.phy2log) and int(new.logcnt.max()) > 1
    assert wk.greedy(llm) == reference_tokens  # entirely under the new placement (replicas in use)


def test_attach_ep_rejects_slots_that_do_not_divide_among_ranks():
    from types import SimpleNamespace

    from inferhal.core.engine.llm import LLM
    from inferhal.core.errors import UserError
    from inferhal.core.parallel.ep_engine import attach_ep

    cfg = load_workers().tiny_cfg(["parallel=ep2", "eplb=default", "eplb.num_redundant_experts=1"])
    llm = LLM.from_config(cfg)
    comm = SimpleNamespace(layout=SimpleNamespace(world_size=2, rank=0))
    with pytest.raises(UserError, match="9 physical expert slots .* do not divide among parallel.ep=2"):
        attach_ep(llm.engine, comm, cfg.eplb)


def test_cli_token_id_prompts_without_a_tokenizer(tiny_llm, reference_tokens, tmp_path):
    import io
    import json

    from omegaconf import OmegaConf

    from inferhal.core.cli.generate import generate

    wk = load_workers()
    cfg = wk.tiny_cfg([f"prompt_ids={wk.PROMPTS[0]}", f"sampling.max_tokens={wk.MAX_TOKENS}",
                       "sampling.temperature=0"])
    out = io.StringIO()
    assert generate(cfg, tiny_llm, out) == 0
    assert out.getvalue().splitlines()[0].split() == [str(t) for t in reference_tokens[0]]
    jobs = tmp_path / "p.jsonl"
    jobs.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in wk.PROMPTS) + "\n"
                    + json.dumps({"prompt_token_ids": "1 2"}) + "\n")
    OmegaConf.update(cfg, "prompts_file", str(jobs))
    out = io.StringIO()
    assert generate(cfg, tiny_llm, out) == 1  # the last line is rejected, the others run
    rows = [json.loads(ln) for ln in out.getvalue().splitlines() if ln.startswith("{")]
    assert [r["token_ids"] for r in rows[:3]] == reference_tokens
    assert "prompt_token_ids" in rows[3]["error"]
    OmegaConf.update(cfg, "prompts_file", None)
    OmegaConf.update(cfg, "prompt_ids", None)
    with pytest.raises(Exception, match="prompt_ids=\\[1,2,3\\]"):
        generate(cfg, tiny_llm, io.StringIO())


def holders(phy2log, n):
    """{(layer, expert): set of ranks holding a replica}."""
    s = phy2log.shape[1] // n
    out = {}
    for l in range(phy2log.shape[0]):
        for p, e in enumerate(phy2log[l].tolist()):
            out.setdefault((l, e), set()).add(p // s)
    return out


def check_run(out, n, reference_tokens, want_rebalance_steps):
    res = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]
    for r in res:
        assert r["during"] == reference_tokens
        assert r["after"] == reference_tokens
    steps = [s for s, *_ in res[0]["rebalances"]]
    assert steps == want_rebalance_steps
    for st, old, new, _ in res[0]["rebalances"]:
        for r in res[1:]:  # every rank applied the same plan at the same step
            assert any(s == st and torch.equal(nw, new) for s, _, nw, _ in r["rebalances"])
    _, old, new, _ = res[0]["rebalances"][0]
    before, after = holders(old, n), holders(new, n)
    assert any(before[k] != after[k] for k in before), "no expert changed rank"
    assert sum(r["rebalances"][0][3] for r in res) > 0  # weights really crossed ranks
    assert all(torch.equal(r["placement"], res[0]["placement"]) for r in res)
    return res


@pytest.mark.slow
def test_ep2_equals_single_process_across_a_rebalance_and_reports_divergence(tmp_path, reference_tokens):
    # on-demand rebalance at step 3 (prefill + 2 decode steps), 2 redundant slots (10 slots over 2 ranks)
    spawn_from_file(WORKERS, "engine_suite", 2, str(tmp_path),
                    ["eplb.step_interval=0", "eplb.num_redundant_experts=2", "eplb.layers_per_step=0"], 3, True)
    check_run(tmp_path, 2, reference_tokens, [3])
    msgs = [ast.literal_eval((tmp_path / f"rank{r}.txt").read_text()) for r in range(2)]
    assert "EP ranks diverged in step count (rank 0: step 1, rank 1: step 2)" in msgs[0]["skip"]
    assert "diverged" in msgs[1]["skip"]
    assert "rank 0 at step 2: another EP rank did not reach this step" in msgs[0]["exit"]
    assert msgs[1]["exit"] == "raised: rank 1 fails before reaching step 2"


@pytest.mark.slow
def test_ep2_live_rebalance_plans_in_the_background_and_moves_one_layer_per_step(tmp_path, reference_tokens):
    # eplb.layers_per_step=1 (the default): requested at step 3, planned on a thread, then one MoE layer per step
    spawn_from_file(WORKERS, "engine_suite", 2, str(tmp_path),
                    ["eplb.step_interval=0", "eplb.num_redundant_experts=2", "eplb.layers_per_step=1"], 3, False)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in res:
        assert r["during"] == reference_tokens and r["after"] == reference_tokens
    assert res[0]["started"] == res[1]["started"] == [3]
    assert res[0]["moves"] == res[1]["moves"]  # every rank moved the same layers at the same steps
    (_, old, new, _), = res[0]["rebalances"]
    changed = [l for l in range(new.shape[0]) if not torch.equal(old[l], new[l])]
    moves = res[0]["moves"]
    assert len(changed) > 1 and [m[1] for m in moves] == [(l,) for l in changed]  # one layer a step, in order
    steps = [m[0] for m in moves]
    assert steps[0] > 3 and steps == list(range(steps[0], steps[0] + len(changed)))  # consecutive step ends
    assert res[0]["rebalances"][0][0] == steps[-1]  # recorded when its last layer moved
    assert sum(r["rebalances"][0][3] for r in res) > 0  # weights really crossed ranks
    assert all(torch.equal(r["placement"], new) for r in res)


@pytest.mark.slow
def test_ep4_periodic_rebalances_equal_single_process(tmp_path, reference_tokens):
    # eplb=default every 2 steps (2 runs x 6 steps: rebalances at 2, 4, ..., 12), 4 redundant slots
    spawn_from_file(WORKERS, "engine_suite", 4, str(tmp_path),
                    ["eplb.step_interval=2", "eplb.num_redundant_experts=4", "eplb.policy=greedy",
                     "eplb.layers_per_step=0"], 0, False)
    res = check_run(tmp_path, 4, reference_tokens, [2, 4, 6, 8, 10, 12])
    assert res[0]["num_steps"] == 12


def _cli(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    exe = os.path.join(os.path.dirname(sys.executable), "inferhal")
    p = subprocess.run([exe, "generate", "model=deepseek_v4_tiny", "prompt_ids=[1,2,3,4,5]",
                        "sampling.max_tokens=6", "sampling.temperature=0", *args],
                       cwd="/tmp", env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


@pytest.mark.slow
def test_cli_parallel_ep2_prints_the_single_process_tokens(reference_tokens):
    # reference_tokens is the single-process run of the same engine (the CLI without parallel= prints it)
    ep2 = _cli("parallel=ep2", f"parallel.master_port={free_port()}", "eplb=default", "eplb.step_interval=2",
               "eplb.num_redundant_experts=2")
    assert ep2[0].split() == [str(t) for t in reference_tokens[0]]
    assert len(ep2) == 2 and ep2[1].startswith("[6 tokens in ")  # rank 0 alone prints


@pytest.mark.slow
def test_cli_under_torchrun_prints_the_single_process_tokens(reference_tokens):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    exe = os.path.join(os.path.dirname(sys.executable), "inferhal")
    p = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), exe, "generate",
                        "model=deepseek_v4_tiny", "prompt_ids=[1,2,3,4,5]", "sampling.max_tokens=6",
                        "sampling.temperature=0", "parallel=ep2", "parallel.launcher=torchrun"],
                       cwd="/tmp", env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == [str(t) for t in reference_tokens[0]]
    assert len(lines) == 2  # rank 0 alone prints


def test_torchrun_launcher_without_torchrun_environment_is_a_user_error(monkeypatch):
    from inferhal.core.errors import UserError
    from inferhal.core.cli.generate import generate
    from inferhal.core.parallel.ep_generate import generate_parallel

    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    cfg = load_workers().tiny_cfg(["parallel=ep2", "parallel.launcher=torchrun", "prompt_ids=[1,2]"])
    with pytest.raises(UserError, match="parallel.launcher=torchrun but RANK/WORLD_SIZE are not set"):
        generate_parallel(cfg, generate)


def test_eplb_drift_reaches_the_policy_and_a_bad_value_is_named():
    from types import SimpleNamespace

    from inferhal.core.errors import UserError
    from inferhal.core.parallel.ep_engine import eplb_controller

    eplb = SimpleNamespace(enabled=True, policy="inferhal", drift=0.0, num_redundant_experts=4, num_groups=2,
                           num_nodes=1, window_size=4, step_interval=4)
    assert eplb_controller(eplb, 2, 8, 4).policy.keywords == {"drift": 0.0}
    eplb.drift = -1
    with pytest.raises(UserError, match=r"eplb.drift=-1: drift must be a number in \[0, 10\)"):
        eplb_controller(eplb, 2, 8, 4)
    eplb.policy = "greedy"  # the baseline has no drift knob
    assert eplb_controller(eplb, 2, 8, 4).policy.__name__ == "rebalance_greedy"


@pytest.mark.slow
def test_ep2_with_batch_invariant_ops_gives_the_single_process_logprobs_bitwise(tmp_path):
    """deterministic=true on plain EP (replicated attention, sharded experts): the single process's tokens and
    logprobs bit for bit, through preemption, chunked prefill, n-gram drafts, prefix hits and sampling."""
    want, _ = by_file.load("dp_workers").reference("deterministic")
    spawn_from_file(WORKERS, "deterministic_suite", 2, str(tmp_path))
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        for run in got.values():
            assert [(g["tokens"], g["logprobs"]) for g in run["res"]] == [(w["tokens"], w["logprobs"]) for w in want]
            assert run["drafts"] > 0
        assert got["preempt"]["preemptions"] > 0
        assert sum(g["cached"] for g in got["prefix"]["res"]) > 0
