"""Two-batch overlap (``parallel.tbo``) under DP attention × EP MoE.

The split (the scheduler's plain data), the micro-batch slicing, the interleaving and the sync fallback
are tested in process; one spawned dep2 group over gloo runs every scenario without and with overlap on
the same ranks: the same tokens (logprobs bit for bit with ``deterministic=true``; within 1e-5 otherwise,
where the reference ops' rounding depends on the batch's size), through chunked prefill, n-gram and MTP
drafts, preemption, prefix hits, sampling, redundant expert replicas and live EPLB rebalances; every rank joins every split
pass, busy, unsplit or idle; and the all-to-alls ran on the communication thread, partly hidden."""

import threading
import time

import pytest
import torch

from inferhal.core.parallel.launch import spawn_from_file
from inferhal.core.models.base import slice_batch, split_batch
from inferhal.core.parallel.tbo import interleave, split_two, submit

import by_file  # tests/core/parallel (conftest puts it on the path)

WORKERS = by_file.path_of("tbo_workers")
MOE_LAYERS = 4


def load_workers():
    return by_file.load("tbo_workers")


wk = load_workers()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ------------------------------------------------------------------ the pieces, in process

def test_the_split_balances_tokens_at_a_sequence_boundary():
    assert split_two([]) == () and split_two([40]) == ()  # too small to split: one batch
    assert split_two([1, 1]) == (1, 1)
    assert split_two([30, 1, 1, 1, 1, 1]) == (1, 5)  # a long prefill alone against the decodes
    assert split_two([1, 1, 1, 1, 30]) == (4, 1)
    assert split_two([4, 4, 4, 4]) == (2, 2)
    assert split_two([3, 1, 2]) == (1, 2)  # 3 | 3
    assert split_two([2, 2, 2]) == (1, 2)  # 2 | 4 and 4 | 2 tie: the earlier cut
    assert split_two([5, 1, 1, 1, 1, 1, 12]) == (6, 1)


def test_the_scheduler_hands_the_split_to_the_runner_as_plain_data():
    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    eng = LLM.from_config(wk.tiny_cfg()).engine
    assert eng.scheduler.micro_batch_split is None  # off unless attach_dp(tbo=True) sets the policy
    eng.scheduler.micro_batch_split = split_two
    seen = []
    real = eng.model.forward_hidden

    def spy(batch, kv):
        seen.append(batch.extras.get("micro_batches"))
        return real(batch, kv)

    eng.model.forward_hidden = spy
    for i, p in enumerate(wk.PROMPTS[:3]):
        eng.add_request(p, SamplingParams(max_tokens=2 + 2 * i, temperature=0.0))
    while eng.has_unfinished():
        eng.step()
    # [5, 13, 1] prompt tokens: 5 | 14; then decodes of 3, then 2 sequences; the last one alone runs as one batch
    assert seen == [(1, 2), (1, 2), (1, 1), (1, 1), None, None]


def test_a_micro_batch_is_the_batch_the_runner_builds_for_its_sequences_alone():
    from inferhal.core.engine.llm import LLM
    from inferhal.core.models.base import ForwardBatch
    from inferhal.core.paging.batch import SeqSlice, build_attn_batches

    eng = LLM.from_config(wk.tiny_cfg()).engine
    specs, bs = eng.kv_manager.specs, eng.kv_manager.block_size
    seqs = [SeqSlice(0, 21, {s.name: [0, 1] for s in specs}), SeqSlice(16, 3, {s.name: [2, 3] for s in specs}),
            SeqSlice(35, 1, {s.name: [4, 5, 6] for s in specs})]
    ids = torch.arange(25)

    def batch_of(ss, tokens):
        pos, qsl, attn = build_attn_batches(specs, bs, ss, "cpu")
        return ForwardBatch(tokens, pos, qsl, attn, torch.tensor([len(tokens) - 1]))

    whole = batch_of(seqs, ids)
    a, b = split_batch(whole, (1, 2))
    for part, ss, tok in ((a, seqs[:1], ids[:21]), (b, seqs[1:], ids[21:])):
        want = batch_of(ss, tok)
        assert torch.equal(part.input_ids, want.input_ids) and torch.equal(part.positions, want.positions)
        assert torch.equal(part.query_start_loc, want.query_start_loc) and part.logits_indices.numel() == 0
        for g, wa in want.attn.items():
            pa = part.attn[g]
            for f in ("query_start_loc", "seq_lens", "positions", "slot_mapping"):
                assert torch.equal(getattr(pa, f), getattr(wa, f)), (g, f)
            w = wa.block_table.shape[1]
            assert torch.equal(pa.block_table[:, :w], wa.block_table) and bool((pa.block_table[:, w:] == -1).all())
    assert torch.equal(slice_batch(whole, 0, 3).input_ids, ids)
    with pytest.raises(ValueError, match="do not cover"):
        split_batch(whole, (1, 1))


def test_interleave_runs_the_tasks_round_robin_and_closes_them_on_error():
    log = []

    def task(name, n):
        for i in range(n):
            log.append(f"{name}{i}")
            yield
        return name

    assert interleave([task("a", 3), task("b", 2)]) == ["a", "b"]
    assert log == ["a0", "b0", "a1", "b1", "a2"]
    closed = []

    def other():
        try:
            while True:
                yield
        finally:
            closed.append(True)

    def failing():
        yield
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        interleave([failing(), other()])
    assert closed == [True]


def test_submit_runs_on_the_communicators_thread_or_at_once():
    from concurrent.futures import ThreadPoolExecutor

    class Threaded:
        pool = ThreadPoolExecutor(1, thread_name_prefix="comm")

        def run_async(self, fn, *args):
            return self.pool.submit(fn, *args)

    name = lambda: threading.current_thread().name  # noqa: E731
    assert submit(Threaded(), name).result().startswith("comm")
    assert submit(object(), name).result() == threading.current_thread().name  # the sync fallback

    def bad():
        raise RuntimeError("peer gone")

    fut = submit(object(), bad)
    assert fut.done() and isinstance(fut.exception(), RuntimeError)


class SlowComm:
    """One rank whose all-to-all takes 2 ms (sleeping, as a wire would: the GIL is free), run on a
    communication thread."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        from inferhal.backends.reference.comm import SingleProcessCommunicator
        from inferhal.core.backend import ParallelLayout

        self.inner = SingleProcessCommunicator(ParallelLayout())
        self.layout = self.inner.layout
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="slow-comm")
        self.threads = set()

    def all_to_all(self, chunks):
        self.threads.add(threading.current_thread().name)
        time.sleep(0.002)
        return self.inner.all_to_all(chunks)

    def all_gather(self, x):
        return self.inner.all_gather(x)

    def run_async(self, fn, *args):
        return self.pool.submit(fn, *args)


def test_one_rank_split_in_two_gives_the_same_tokens_and_hides_collective_time():
    """A world of one through the whole engine, split steps and all: with batch-invariant ops the same
    logprobs bit for bit; the all-to-alls ran on the communication thread and part of their time passed
    while the forward's thread computed the other micro-batch (a synchronous run hides nothing)."""
    from inferhal.core.backend import ParallelLayout

    over, prompts, kind = ["deterministic=true"], wk.PROMPTS[:4], "greedy"
    res, logs = {}, {}
    for tbo in (False, True):
        llm, hook = wk.dp_llm(ParallelLayout(), over, tbo)
        if tbo:
            comm = SlowComm()
            hook.comm = hook.runner.comm = comm
        res[tbo], logs[tbo] = wk.run(llm, prompts, kind), [s.moe for s in hook.log]
    assert res[True] == res[False]
    assert sum(m.split_passes for m in logs[True]) > 0 and sum(m.split_passes for m in logs[False]) == 0
    assert comm.threads and all(t.startswith("slow-comm") for t in comm.threads)
    a2a, wait = sum(m.a2a_s for m in logs[True]), sum(m.wait_s for m in logs[True])
    assert a2a > 0.002 * 3 * MOE_LAYERS and wait < a2a  # collective time passed outside the waits: hidden
    plain = logs[False]
    assert all(m.wait_s >= m.a2a_s for m in plain)  # without overlap every second of it is waited out


def test_a_micro_batch_that_leaves_the_pass_plan_is_named():
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
                       ExpertsParams(), torch.float32, pass_layers=(0, 1, 2), tbo=True)
    x, w, ids = torch.randn(5, 8, generator=g), torch.rand(5, 2, generator=g), torch.tensor([[0, 1]] * 5)

    def forward(layers):
        y = None
        for l in layers:
            y = yield l, x, w, ids
        return y

    ya, yb = runner.run_two(forward([0, 1, 2]), forward([0, 1, 2]), 5)
    assert torch.equal(ya, yb) and torch.equal(ya, [runner(l, x, w, ids) for l in (0, 1, 2)][-1])
    assert runner.traffic.split_passes == 1 and runner.traffic.rounds == 2 * 3 + 3
    runner.drain(1, False)
    with pytest.raises(RankDivergenceError, match="MoE layer 2 called inside a split pass whose next layer is 1"):
        runner.run_two(forward([0, 1, 2]), forward([0, 2]), 5)
    with pytest.raises(RankDivergenceError, match=r"a split forward ended with MoE layers \[2\] left"):
        runner.run_two(forward([0, 1]), forward([0, 1]), 5)
    assert not runner._inflight and runner.drain(2, False) is False  # nothing left behind


def test_tbo_is_refused_outside_dp_attention_with_the_field_named():
    from inferhal.core.cli.main import compose
    from inferhal.core.config.errors import ConfigError

    assert compose(["model=deepseek_v4_tiny", "parallel=dep2", "parallel.tbo=true"], "generate").parallel.tbo
    for layout in ("single", "ep2"):
        with pytest.raises(ConfigError, match=r"parallel.tbo=True is refused with parallel.dp=1, parallel.ep=\d: "
                                              r"two-batch overlap .* data-parallel attention"):
            compose(["model=deepseek_v4_tiny", f"parallel={layout}", "parallel.tbo=true"], "generate")


# ------------------------------------------------------------------ dep2 over gloo, one spawned group

@pytest.fixture(scope="module")
def dep2(tmp_path_factory):
    out = tmp_path_factory.mktemp("tbo")
    spawn_from_file(WORKERS, "tbo_suite", 2, str(out), list(wk.SCENARIOS))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(wk.SCENARIOS))
def test_overlap_gives_the_same_outputs(dep2, name):
    for rank in dep2:
        off, on = rank[(name, False)]["res"], rank[(name, True)]["res"]
        assert [r["tokens"] for r in on] == [r["tokens"] for r in off]
        assert [(r["cached"], r["drafts"], r["preemptions"]) for r in on] == \
            [(r["cached"], r["drafts"], r["preemptions"]) for r in off]
        if name == "deterministic":  # batch-invariant ops: bit for bit
            assert [r["logprobs"] for r in on] == [r["logprobs"] for r in off]
        for a, b in zip(on, off):
            assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    assert dep2[0][(name, True)]["res"] == dep2[1][(name, True)]["res"]  # every rank sees every output


@pytest.mark.slow
def test_the_scenarios_really_split_preempted_and_drafted(dep2):
    for rank in dep2:
        for name in wk.SCENARIOS:
            splits = rank[(name, True)]["splits"]
            assert all(m == split_two(n) for n, m in splits)  # the scheduler's split, as the pure function says
            assert all(m == () for _, m in rank[(name, False)]["splits"])
        assert rank[("deterministic", True)]["preemptions"] > 0
        assert rank[("mixed", True)]["rebalances"]  # live EPLB moved weights between split steps
        assert sum(r["drafts"] for r in rank[("mtp", True)]["res"]) > 0
    assert any(m for rank in dep2 for n, m in rank[("mixed", True)]["splits"] if max(n) > 1)  # prefill steps too


@pytest.mark.slow
@pytest.mark.parametrize("name", list(wk.SCENARIOS))
def test_every_rank_joins_every_split_pass_in_the_same_order(dep2, name):
    a, b = (rank[(name, True)]["log"] for rank in dep2)
    assert len(a) == len(b)
    for (_, attn_a, _, ma), (_, attn_b, _, mb) in zip(a, b):
        assert ma.split_passes == mb.split_passes and ma.rounds == mb.rounds
        assert ma.token_rows >= MOE_LAYERS * attn_a and mb.token_rows >= MOE_LAYERS * attn_b  # (+ MTP layers)
        # rows rank 0 sent rank 1 in dispatch come back from rank 1 in combine, and the other way round
        assert ma.dispatch_bytes // (64 * 4 + 8) == mb.combine_bytes // (64 * 4)
    off = [rank[(name, False)]["log"] for rank in dep2]
    assert sum(s[3].split_passes for s in a) > 0 and sum(s[3].split_passes for s in off[0]) == 0
    # the same rows went through the experts with and without the split
    assert [sum(s[3].token_rows for s in rank[(name, True)]["log"]) for rank in dep2] == \
        [sum(s[3].token_rows for s in log) for log in off]


@pytest.mark.slow
def test_an_unsplit_and_an_idle_rank_join_split_passes(dep2):
    busy, other = dep2[0][("uneven", True)]["log"], dep2[1][("uneven", True)]["log"]
    splits0 = dep2[0][("uneven", True)]["splits"]
    splits1 = dep2[1][("uneven", True)]["splits"]
    steps = list(zip(busy, other, splits0, splits1))
    # rank 1 with one sequence (no split of its own) in a pass rank 0 split: its batch beside an empty one
    unsplit = [(b, o) for b, o, s0, s1 in steps if s0[1] and s1[0] and not s1[1]]
    assert unsplit and all(o[3].split_passes == 1 and 0 < o[3].empty_rounds < o[3].rounds for _, o in unsplit)
    # rank 1 done: it serves rank 0's split passes with two empty micro-batches a layer
    idle = [(b, o) for b, o, s0, s1 in steps if s0[1] and not s1[0]]
    assert idle and all(o[1] == 0 and o[3].rounds == o[3].empty_rounds == 2 * MOE_LAYERS for _, o in idle)
    # one header per forward, split or not (B needs none: the pass plan covers both), one at the step's end
    assert all(s[3].headers == 2 for log in (busy, other) for s in log)


@pytest.mark.slow
def test_the_all_to_alls_ran_on_the_communication_thread_and_some_of_it_was_hidden(dep2):
    for rank in dep2:
        for name in wk.SCENARIOS:
            # an exchange is three all-to-alls (dispatch: rows and slot ids; combine); EPLB's weight transfers
            # between steps ("mixed") run on the main thread in both modes
            for tbo in (False, True):
                calls = 3 * sum(s[3].rounds for s in rank[(name, tbo)]["log"])
                threads = rank[(name, tbo)]["threads"]
                main = threads.get("MainThread", 0) - (0 if tbo else calls)  # EPLB's
                assert set(threads) - {"MainThread"} == ({"inferhal-comm_0"} if tbo else set())
                assert threads.get("inferhal-comm_0", 0) == (calls if tbo else 0)
                assert main >= 0 and (main > 0) == (name == "mixed")
        on = [s[3] for name in wk.SCENARIOS for s in rank[(name, True)]["log"]]
        assert sum(m.wait_s for m in on) < sum(m.a2a_s for m in on)
