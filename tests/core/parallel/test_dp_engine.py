"""DP attention × EP MoE (dep2 over gloo on 127.0.0.1): the tiny DeepSeek-V4 in fp32 gives a single
process's tokens (logprobs within 1e-5; bitwise with deterministic=true), also with prefix caching, chunked prefill, n-gram and MTP drafts,
preemption, sampling and EPLB rebalances; each rank's attention runs on its own tokens only; the MoE
all-to-all bytes agree between senders and receivers; a rank with no request joins every exchange with
an empty batch; the front end places by load and prefix affinity. One spawned group runs every scenario.

On the 2-core CI host wall-clock scaling says little, so the tests count work (tokens per rank per step)
and bytes instead."""

import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

from inferhal.core.parallel.dp_frontend import RankLoad, place_requests
from inferhal.core.parallel.launch import spawn_from_file

import by_file  # tests/core/parallel (conftest puts it on the path)

WORKERS = by_file.path_of("dp_workers")


def load_workers():
    return by_file.load("dp_workers")


wk = load_workers()
CLI_PROMPTS = wk.PROMPTS[:3]
D = 64  # the tiny model's hidden size: one fp32 row = 256 bytes
MOE_LAYERS = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def refs():
    return {name: wk.reference(name) for name in wk.SCENARIOS}


@pytest.fixture(scope="module")
def dep2(tmp_path_factory):
    out = tmp_path_factory.mktemp("dep2")
    (out / "jobs.jsonl").write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in CLI_PROMPTS))
    spawn_from_file(WORKERS, "dp_suite", 2, str(out), list(wk.SCENARIOS))
    res = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    res[0]["exit"] = (out / "exit0.txt").read_text()
    return res


@pytest.mark.slow
@pytest.mark.parametrize("name", list(wk.SCENARIOS))
def test_dep2_gives_the_single_process_outputs(dep2, refs, name):
    want, _ = refs[name]
    for rank in dep2:
        got = rank[name]["res"]
        assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
        for g, w in zip(got, want):
            assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-5)


@pytest.mark.slow
def test_dep2_with_batch_invariant_ops_gives_the_single_process_logprobs_bitwise(dep2, refs):
    want, _ = refs["deterministic"]
    for rank in dep2:
        assert [(g["tokens"], g["logprobs"]) for g in rank["deterministic"]["res"]] == \
            [(w["tokens"], w["logprobs"]) for w in want]
    assert sum(rank["deterministic"]["preemptions"] for rank in dep2) > 0
    assert all(rank["deterministic"]["drafts"] > 0 for rank in dep2)
    assert sum(g["cached"] for g in dep2[0]["deterministic"]["res"]) > 0


def test_deterministic_runs_with_dp_attention_and_with_replicated_attention():
    from inferhal.core.cli.main import compose

    for layout in ("dep2", "ep2"):
        assert compose(["model=deepseek_v4_tiny", f"parallel={layout}", "deterministic=true"], "generate").deterministic


@pytest.mark.slow
def test_the_features_really_ran_on_every_rank(dep2):
    for rank in dep2:
        feat, pre = rank["features"], rank["preempt"]
        assert feat["drafts"] > 0 and pre["drafts"] > 0  # n-gram drafts verified on each rank
        assert pre["preemptions"] > 0  # 5 blocks a group: each rank preempted and recomputed
        assert max(s[1] for s in feat["log"]) <= 12 < max(len(p) for p in wk.PROMPTS)  # prompts came in chunks
        second = feat["res"][len(wk.PROMPTS):]
        assert [g["cached"] for g in second] == [0, 32, 16, 16]  # prefix hits on the rank that cached them
        assert rank["mtp"]["drafts"] > 0
    # MTP drafting calls the MTP layer's MoE a varying number of times per step: rounds beyond the main
    # layers, served empty by the rank with fewer of them
    rounds = [[s[3].rounds for s in rank["mtp"]["log"]] for rank in dep2]
    assert rounds[0] == rounds[1] and max(rounds[0]) > MOE_LAYERS
    assert sum(s[3].empty_rounds for rank in dep2 for s in rank["mtp"]["log"]) > 0


@pytest.mark.slow
def test_prefix_affinity_sends_a_prompt_to_the_rank_that_cached_its_prefix(dep2):
    first, second = dep2[0]["features"]["placements"]
    assert first == [0, 1] * 4  # equal loads: alternate
    # [42, 43] to the lighter rank 0, then each prompt follows its cached prefix (load alone gives 1, 0, 1)
    assert second == [0, first[4], first[5], first[6]] == [0, 0, 1, 0]
    assert dep2[1]["features"]["placements"] == [first, second]


@pytest.mark.slow
def test_each_rank_runs_attention_on_its_own_tokens_only(dep2, refs):
    _, single_tokens = refs["plain"]
    per_rank = [sum(s[1] for s in rank["plain"]["log"]) for rank in dep2]
    assert per_rank == [rank["plain"]["tokens"] for rank in dep2]  # attention rows = own scheduled tokens
    assert sum(per_rank) == single_tokens  # split, not replicated (the EP engine runs single_tokens per rank)
    assert all(0 < n < single_tokens for n in per_rank)
    for rank in dep2:
        for step, attn, seqs, moe in rank["plain"]["log"]:
            assert moe.token_rows == MOE_LAYERS * attn  # the MoE layers saw exactly this rank's tokens
            assert moe.rounds == MOE_LAYERS
            assert moe.headers == 2  # the pass plan: one header per forward, one at the step's end


@pytest.mark.slow
def test_all_to_all_bytes_are_per_step_and_agree_between_ranks(dep2):
    for name in ("plain", "features", "preempt"):
        a, b = dep2[0][name]["log"], dep2[1][name]["log"]
        assert len(a) == len(b)
        for (_, _, _, ma), (_, _, _, mb) in zip(a, b):
            # rows rank 0 sent rank 1 in dispatch come back from rank 1 in combine, and the other way round
            assert ma.dispatch_bytes // (D * 4 + 8) == mb.combine_bytes // (D * 4)
            assert mb.dispatch_bytes // (D * 4 + 8) == ma.combine_bytes // (D * 4)
            assert ma.dispatch_bytes % (D * 4 + 8) == 0 and mb.combine_bytes % (D * 4) == 0
    # over the whole run, the rows that crossed ranks are what the planner's all-to-all figure assumes
    # (core/plan/roofline.all_to_all_s: each token-layer row to top_k experts, (ep - 1) / ep of them remote)
    crossed = sum(s[3].dispatch_bytes // (D * 4 + 8) for rank in dep2 for s in rank["plain"]["log"])
    uniform = sum(s[3].token_rows * 2 * (2 - 1) / 2 for rank in dep2 for s in rank["plain"]["log"])
    assert abs(crossed - uniform) <= 0.1 * uniform
    decode = [s[3].a2a_bytes for s in dep2[0]["plain"]["log"][2:]]
    prefill = dep2[0]["plain"]["log"][0][3].a2a_bytes
    assert max(decode) < prefill  # sized by the step's tokens, not a fixed buffer


@pytest.mark.slow
def test_a_rank_without_requests_joins_every_exchange_empty(dep2):
    busy, idle = dep2[0]["lonely"], dep2[1]["lonely"]
    assert idle["own"] == [] and busy["own"] == ["0"]
    assert len(idle["log"]) == len(busy["log"])  # every step, together
    for _, attn, seqs, moe in idle["log"]:
        assert attn == 0 and seqs == 0 and moe.token_rows == 0 and moe.dispatch_bytes == 0
        assert moe.rounds == moe.empty_rounds == MOE_LAYERS and moe.headers == 2


@pytest.mark.slow
def test_eplb_rebalances_under_dp_move_weights_and_change_nothing(dep2):
    got = [rank["plain"]["rebalances"] for rank in dep2]
    assert got[0] and [s for s, _ in got[0]] == [s for s, _ in got[1]]
    assert sum(r for g in got for _, r in g) > 0  # weights crossed ranks
    # live (eplb.layers_per_step=1): planned from step 2 on a thread, then one layer per step, the same on each rank
    assert dep2[0]["plain"]["started"][0] == 2 and dep2[0]["plain"]["moves"] == dep2[1]["plain"]["moves"]
    assert all(len(layers) == 1 for _, layers in dep2[0]["plain"]["moves"])
    assert got[0][0][0] > 3
    # the recorder counts each rank's own routing (top-2: two physical ids per token row) since the last
    # rebalance, and the window load EPLB plans from is the sum over the ranks
    last = got[0][-1][0]
    own = [2 * sum(s[3].token_rows for s in rank["plain"]["log"] if s[0] > last) for rank in dep2]
    assert [rank["plain"]["load"][0] for rank in dep2] == own and min(own) > 0
    assert [rank["plain"]["load"][1] for rank in dep2] == [sum(own)] * 2


@pytest.mark.slow
def test_ranks_given_different_requests_or_left_alone_are_told_so(dep2):
    for rank in dep2:
        assert "the ranks were handed different new requests" in rank["mismatch"]
    # rank 1 exited: rank 0's next collective names itself and where, at once (no hang to a timeout)
    assert dep2[0]["exit"].startswith("rank 0 at placing new requests: another rank did not answer")


@pytest.mark.slow
def test_the_generate_command_on_dep2_ranks_prints_the_single_process_tokens(dep2):
    """Each rank's body of `inferhal generate parallel=dep2 prompts_file=...` (ep_generate.run_rank, the
    spawning itself is the ep2 CLI test's): rank 0 prints every request's row and what each rank did."""
    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    single = LLM.from_config(wk.tiny_cfg())
    outs = single.generate(CLI_PROMPTS, SamplingParams(max_tokens=5, temperature=0.0))
    cli = [rank["cli"] for rank in dep2]
    assert [c["rc"] for c in cli] == [0, 0]
    rows = [json.loads(ln) for ln in cli[0]["stdout"].splitlines() if ln.startswith("{")]
    assert [r["token_ids"] for r in rows] == [list(o.outputs[0].token_ids) for o in outs]
    assert "[3 done, 0 rejected" in cli[0]["stdout"] and cli[1]["stdout"] == ""  # rank 0 alone prints
    work = re.search(r"\[dp2 ranks over (\d+) steps: attention tokens (\d+), (\d+) \(each rank its own requests\); "
                     r"all-to-all bytes sent (\d+), (\d+)\]", cli[0]["stderr"])
    assert work, cli[0]["stderr"]
    steps, a0, a1, b0, b1 = map(int, work.groups())
    assert a0 + a1 == single.engine.stats["tokens"] and min(a0, a1, b0, b1) > 0


@pytest.mark.slow
def test_dep4_over_two_torchrun_agents_on_loopback_gives_the_single_process_tokens(tmp_path):
    """Two "nodes" (torchrun agents, --nnodes 2, static rendezvous on 127.0.0.1), two ranks each."""
    import subprocess
    import sys

    from inferhal.core.engine.llm import LLM
    from inferhal.core.parallel.launch import free_port
    from inferhal.core.sampling.params import SamplingParams

    prompts = wk.PROMPTS[:4]
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    bin_dir = os.path.dirname(sys.executable)
    port = free_port()
    agents = [subprocess.Popen(
        [os.path.join(bin_dir, "torchrun"), "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
         "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.join(bin_dir, "inferhal"), "generate",
         "model=deepseek_v4_tiny", "parallel=dep4", "parallel.launcher=torchrun", f"prompts_file={jobs}",
         "sampling.max_tokens=5", "sampling.temperature=0"],
        cwd="/tmp", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    done = [a.communicate(timeout=300) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], done[0][1][-2000:] + done[1][1][-2000:]
    outs = LLM.from_config(wk.tiny_cfg()).generate(prompts, SamplingParams(max_tokens=5, temperature=0.0))
    rows = [json.loads(ln) for ln in done[0][0].splitlines() if ln.startswith("{")]
    assert [r["token_ids"] for r in rows] == [list(o.outputs[0].token_ids) for o in outs]
    assert "[dp4 ranks over" in done[0][1] and done[1][0] == ""  # global rank 0 (node 0) alone prints


# ------------------------------------------------------------------ the front end's placement, alone

def test_placement_by_load_then_free_kv_then_rank():
    loads = [RankLoad(2, 3, 500), RankLoad(1, 1, 900), RankLoad(1, 1, 950)]
    none = [[0, 0, 0] for _ in range(3)]
    assert place_requests(loads, none, [[], [], []]) == [2, 1, 2]


def test_placement_prefers_a_cached_prefix_within_the_slack():
    loads = [RankLoad(0, 0, 1000), RankLoad(0, 2, 1000), RankLoad(0, 3, 1000)]
    cached = [[0], [3], [3]]  # ranks 1 and 2 hold 3 blocks of the prompt
    assert place_requests(loads, cached, [[b"a", b"b", b"c"]]) == [1]
    assert place_requests(loads, cached, [[b"a", b"b", b"c"]], slack=1) == [0]  # too busy for affinity
    # affinity within one batch: the second prompt shares a block with the first, placed on rank 0
    assert place_requests([RankLoad(0, 0, 1000)] * 2, [[0, 0], [0, 0]], [[b"x", b"y"], [b"x"]]) == [0, 0]


def test_a_model_that_leaves_its_pass_plan_is_named():
    from inferhal.backends.reference.comm import SingleProcessCommunicator
    from inferhal.backends.reference.ops import OPS
    from inferhal.core.backend import ParallelLayout
    from inferhal.core.eplb.placement import Placement
    from inferhal.core.ops.params import ExpertsParams
    from inferhal.core.parallel.dp_moe import DPExperts
    from inferhal.core.parallel.sync import RankDivergenceError

    g = torch.Generator().manual_seed(0)
    full = [(torch.randn(4, 16, 8, generator=g), torch.randn(4, 8, 8, generator=g)) for _ in range(3)]
    runner = DPExperts(OPS, SingleProcessCommunicator(ParallelLayout()), Placement.identity(3, 4), full,
                       ExpertsParams(), torch.float32, pass_layers=(0, 1, 2))
    x, w, ids = torch.randn(5, 8, generator=g), torch.rand(5, 2, generator=g), torch.tensor([[0, 1]] * 5)
    runner(0, x, w, ids)
    with pytest.raises(RankDivergenceError, match="MoE layer 2 called inside a pass whose next layer is 1"):
        runner(2, x, w, ids)
    runner(0, x, w, ids)
    with pytest.raises(RankDivergenceError, match=r"step 1 ended inside a pass with MoE layers \[1, 2\] left"):
        runner.drain(1, False)
    assert runner.drain(1, False) is False  # the plan was dropped: the next step starts clean


def test_one_dp_rank_in_process_streams_aborts_and_forgets(refs):
    """The front end over a world of one: streaming, aborting a queued and a placed request."""
    from inferhal.core.backend import ParallelLayout
    from inferhal.core.sampling.params import SamplingParams

    llm, hook = wk.dp_llm(ParallelLayout(), [])
    want = [w["tokens"] for w in refs["lonely"][0]]
    streamed = [o.new_token_ids for o in llm.stream([wk.PROMPTS[1]], wk.params("greedy", 0))]
    assert [t for new in streamed for t in new] == want[0] and len(streamed) == len(want[0])
    front = llm.engine
    a = front.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    assert front.abort([a]) == [] and not front.pending and not front.has_unfinished()  # queued: just dropped
    b = front.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    front.step()
    assert front.owner == {b: 0} and front.has_unfinished()
    out = front.abort([b])
    assert [o.outputs[0].finish_reason for o in out] == ["abort"]
    assert hook.log[-1].attn_tokens == 3 and hook.log[-1].moe.headers == 2


def test_attach_dp_refuses_asynchronous_scheduling():
    from inferhal.core.engine.llm import LLM
    from inferhal.core.errors import UserError
    from inferhal.core.parallel.dp_engine import attach_dp

    llm = LLM.from_config(wk.tiny_cfg(["scheduler.async_scheduling=true"]))
    comm = SimpleNamespace(layout=SimpleNamespace(world_size=2, rank=0))
    with pytest.raises(UserError, match="scheduler.async_scheduling=true does not run with data-parallel"):
        attach_dp(llm.engine, comm, llm.config.eplb)
