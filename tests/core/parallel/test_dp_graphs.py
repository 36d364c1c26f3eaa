"""Decode graphs over EP ranks (core/parallel/dp_graphs.py, #46 item 3): under DP attention the ranks agree on
one bucket (and one graph: greedy or logits) per step and an idle rank runs a padding-only step through it;
under replicated attention (ep2) every rank pads its shard to as many rows; both so that the padded
exchange's equal-split all-to-all has one shape on every rank.

The spawned tests (dep2, dep2 with two-batch overlap, dep2 with MTP drafts, and ep2 over gloo, ``graph_workers.py``)
replay decode steps, speculative verification steps and MTP's draft steps through a CPU graph runner that records a
capture and runs each replay on the captured buffers under core's host-read guard, fatal for core, model and the
kernels' EP ops (Triton's interpreter): CPU reference / interpreter evidence, no GPU."""

from types import SimpleNamespace

import pytest
import torch

from inferhal.core.backend import ParallelLayout
from inferhal.core.cli.main import compose
from inferhal.core.engine.graphs import DecodeGraphs
from inferhal.core.errors import UserError
from inferhal.core.parallel.dp_graphs import EAGER, ELIGIBLE, IDLE, GraphPeers
from inferhal.core.parallel.ep_generate import check_ranks
from inferhal.core.parallel.ep_moe import EPExperts
from inferhal.core.parallel.launch import spawn_from_file

import by_file  # tests/core/parallel (conftest puts it on the path)

wk = by_file.load("graph_workers")
MOE_LAYERS, D, K = 4, 64, 2  # the tiny model's: one fp32 row = 256 bytes


class Votes:
    """Rank 0's communicator in a group whose other ranks vote ``others``."""

    def __init__(self, *others):
        self.layout = ParallelLayout(world_size=len(others) + 1)
        self.others = others

    def all_gather(self, x):
        return [x, *(torch.tensor(o, dtype=torch.long) for o in self.others)]


class Experts:
    pass_layers = range(MOE_LAYERS)

    def __init__(self):
        self.steps = []

    def graph_step(self, rows, own):
        self.steps.append((rows, own))


@pytest.mark.parametrize("mine,others,want", [
    ((3, True), [(ELIGIBLE, 1, 1, 1)], (4, True, 1)),  # uneven rows: the largest's bucket
    ((0, True), [(ELIGIBLE, 3, 1, 1)], (4, True, 1)),  # an idle rank pads to its peer's bucket
    ((2, True), [(ELIGIBLE, 1, 0, 1)], (2, False, 1)),  # a peer samples: the logits graph for all
    ((2, True), [(EAGER, 0, 1, 0)], None),  # a peer's step is not eligible (a prompt chunk): nobody replays
    ((None, True), [(ELIGIBLE, 1, 1, 1)], None),  # nor when this rank's is not
    ((0, True), [(IDLE, 0, 1, 0)], None),  # nobody has work
    ((1, True), [(ELIGIBLE, 5, 1, 1), (IDLE, 0, 1, 0)], (8, True, 1)),
    # speculative verification steps (q tokens a sequence): the same q everywhere replays that q's graph
    ((3, False, 3), [(ELIGIBLE, 1, 0, 3)], (4, False, 3)),
    ((0, True), [(ELIGIBLE, 2, 0, 3)], (2, False, 3)),  # an idle rank pads q-token sequences
    ((1, False, 3), [(IDLE, 0, 1, 0), (ELIGIBLE, 5, 0, 3)], (8, False, 3)),
    ((2, False, 3), [(ELIGIBLE, 2, 1, 1)], None),  # drafts here, a plain decode there: all eager
    ((2, False, 3), [(ELIGIBLE, 2, 0, 2)], None),  # fewer drafts there: all eager
])
def test_the_ranks_agree_on_one_graph_per_step(mine, others, want):
    graphs, experts = DecodeGraphs(None, None, (), 16, 64, [1, 2, 4, 8], None), Experts()
    peers = GraphPeers(Votes(*others), graphs, experts)
    assert peers.agree(*mine) == want
    # the expert runner is told each MoE call's token rows (bucket x q at every main layer) and its own
    assert experts.steps == ([] if want is None else [([want[0] * want[2]] * MOE_LAYERS,
                                                       [mine[0] * want[2]] * MOE_LAYERS)])
    assert peers.stepped == (want is not None)


@pytest.mark.parametrize("mine,others,want", [
    ((3, 3), [(ELIGIBLE, 1, 1, 3)], (4, 3)),  # both draft after verifying 3 tokens a sequence
    ((0, 1), [(ELIGIBLE, 2, 1, 3)], (2, 3)),  # a rank with no drafts to make pads to its peer's bucket
    ((2, 1), [(ELIGIBLE, 1, 1, 1)], (2, 1)),  # after plain decode steps: the prefill is one row a sequence
    ((None, 1), [(ELIGIBLE, 1, 1, 3)], None),  # a rank that drafts eagerly (e.g. drafting paused): all eager
    ((2, 3), [(ELIGIBLE, 1, 1, 1)], None),  # different rows a sequence: all eager
    ((0, 1), [(IDLE, 0, 1, 0)], None),  # nobody drafts
])
def test_after_a_graph_step_the_ranks_agree_on_one_draft_graph(mine, others, want):
    """MTP's draft graph (core/spec/mtp_graph.py): a second vote of the step, whose forward's MoE calls are the
    prefill's bucket x q rows, then a bucket's rows for each chained draft (k = 3: two)."""
    graphs, experts = DecodeGraphs(None, None, (), 16, 64, [1, 2, 4, 8], None), Experts()
    peers = GraphPeers(Votes(*others), graphs, experts)
    with pytest.raises(RuntimeError, match="not a graph step on every rank"):  # the ranks may be in MoE rounds
        peers.agree_draft(*mine, 3)
    peers.stepped = True
    assert peers.agree_draft(*mine, 3) == want
    if want is None:
        assert experts.steps == [] and peers.draft_log == []
    else:
        size, q = want
        own = mine[0]
        assert experts.steps == [([size * q, size, size], [own * q, own, own])]
        assert peers.draft_log == [([own] + [o[1] for o in others], size, q)]


def test_graphs_with_eplb_are_refused_by_name():
    cfg = compose(["model=deepseek_v4_tiny", "parallel=dep2", "backend.graphs=true", "eplb=default"], "generate")
    with pytest.raises(UserError, match=r"backend.graphs=true with eplb.enabled=true .*core/eplb/recorder.py"):
        check_ranks(cfg)
    cfg = compose(["model=deepseek_v4_tiny", "parallel=dep2", "backend.graphs=true"], "generate")
    assert check_ranks(cfg) == 2
    with pytest.raises(UserError, match="pass_layers"):
        GraphPeers(Votes(), None, SimpleNamespace(pass_layers=()))


class OneLayer(EPExperts):
    """Rank ``rank`` of 2 with one layer of 4 experts, ops that record what it dispatches, and an all-gather of
    its own rows twice."""

    def __init__(self, rank):
        comm = SimpleNamespace(layout=ParallelLayout(world_size=2, rank=rank), all_gather=lambda t: [t, t])
        self.sent = []
        ops = {"moe.dispatch": self._dispatch, "moe.experts": lambda x, *a: x,
               "moe.combine": lambda y, w, handle, *a: y[: handle]}
        from inferhal.core.eplb.placement import Placement
        from inferhal.core.ops.params import ExpertsParams

        w = torch.zeros(4, 2, 3)
        super().__init__(ops, comm, Placement.identity(1, 4), [(w, w)], ExpertsParams())

    def _dispatch(self, xs, phys, comm, p):
        self.sent.append(phys.clone())
        return SimpleNamespace(x=xs, local_ids=phys[:, 0], handle=xs.shape[0])


@pytest.mark.parametrize("t", [1, 3, 4])
def test_every_ep_rank_dispatches_as_many_rows(t):
    """A short or empty shard is padded with rows routed nowhere: the padded exchange's capacity, rows x
    top_k, is the same on both ranks (a captured step of 1 or 3 rows over 2 ranks)."""
    x, ids = torch.randn(t, 3), torch.tensor([[0, 1]] * t)
    rows = []
    for rank in (0, 1):
        ep = OneLayer(rank)
        ep(0, x, torch.ones(t, 2), ids)
        (phys,) = ep.sent
        rows.append(phys.shape[0])
        real = min(max(t - rank * (-(-t // 2)), 0), -(-t // 2))
        assert bool((phys[real:] == -1).all()) and bool((phys[:real] >= 0).all())
    assert rows == [-(-t // 2)] * 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("graphs")
    spawn_from_file(by_file.path_of("graph_workers"), "graph_suite", 2, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def singles():
    """The prompts, and the speculative run's prompts (greedy: a drafter changes no token), in one plain
    process, eagerly (the reference backend, no graphs, no drafter)."""
    from inferhal.core.engine.llm import LLM

    outs = LLM.from_config(wk.tiny_cfg()).generate(wk.PROMPTS + wk.SPEC_PROMPTS, wk.params() + wk.params(spec=True))
    toks = [list(o.outputs[0].token_ids) for o in outs]
    return toks[: len(wk.PROMPTS)], toks[len(wk.PROMPTS):]


@pytest.fixture(scope="module")
def single(singles):
    return singles[0]


def bucket(n):
    return min(b for b in wk.SIZES if b >= n)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dep2", "ep2"])
def test_replayed_steps_give_the_single_process_tokens(ranks, single, layout):
    for rank in ranks:
        assert rank[layout]["tokens"] == single
    assert ranks[0][layout]["captured"] == ranks[1][layout]["captured"]  # the same graphs, in the same order


@pytest.mark.slow
def test_ep2_replays_every_pure_decode_step_at_its_bucket(ranks):
    for rank in ranks:
        got = rank["ep2"]
        steps = [(n, t, k > prev) for (n, t, k), prev in zip(got["steps"], [0] + [s[2] for s in got["steps"]])]
        # every pure decode a bucket holds replayed, nothing else (prompt chunks, a 6-row decode past bucket 4)
        assert [hit for _, _, hit in steps] == [n == t <= max(wk.SIZES) for n, t, _ in steps]
        replayed = [n for n, _, hit in steps if hit]
        assert got["replays"] == len(replayed) and 1 in replayed  # a 1-row step: rank 1's shard all padding
        # each bucket captured once per graph: greedy, and logits while the sampled request decoded
        assert sorted(set(got["captured"])) == sorted({bucket(n) for n in replayed})
        assert len(got["captured"]) == len(set(got["captured"])) + 1


@pytest.mark.slow
def test_dep2_ranks_replay_one_bucket_per_step_at_uneven_batches(ranks):
    votes = ranks[0]["dep2"]["votes"]
    assert ranks[1]["dep2"]["votes"] == votes  # every rank agreed on the same steps, buckets and kind
    counts = [c for c, _, _, _ in votes]
    assert [3, 1] in counts and [3, 0] in counts and [1, 0] in counts  # uneven, and a rank with no request
    assert all(size == bucket(max(c)) and q == 1 for c, size, _, q in votes)
    used = {(s, g) for _, s, g, _ in votes}
    assert (4, False) in used and (4, True) in used  # a logits graph for all while rank 1's request sampled
    eager_decodes = 0
    for rank in ranks:
        got = rank["dep2"]
        # one capture per graph used, each replayed at every agreed step (an idle rank's padding steps too)
        assert sorted(got["captured"]) == sorted(s for s, _ in used) and got["replays"] == len(votes)
        # a pure decode on one rank while the other ran a prompt chunk: no rank replayed that step
        eager_decodes += sum(0 < n == t and k == prev
                             for (n, t, k), prev in zip(got["steps"], [0] + [s[2] for s in got["steps"]]))
        # inside the steps: no read in core, model or the kernels' EP ops; the reference's stand-ins counted
        assert got["reads"] and all(" at backends/reference/" in k for k in got["reads"])
    assert eager_decodes > 0


@pytest.mark.slow
def test_graph_steps_count_the_padded_exchange_without_a_header(ranks):
    votes = ranks[0]["dep2"]["votes"]
    for r, rank in enumerate(ranks):
        graph = [(attn, moe) for attn, _, moe in rank["dep2"]["moe"] if moe.graph_rows]
        assert [m.graph_rows for _, m in graph] == [s for _, s, _, _ in votes]
        for (attn, moe), (counts, size, _, _) in zip(graph, votes):
            assert attn == counts[r] and moe.headers == 1  # the step's end only
            assert moe.rounds == MOE_LAYERS and moe.token_rows == MOE_LAYERS * counts[r]
            assert moe.empty_rounds == (0 if counts[r] else MOE_LAYERS)
            assert moe.dispatch_bytes == MOE_LAYERS * size * K * (D * 4 + 8)
            assert moe.combine_bytes == MOE_LAYERS * size * K * D * 4


@pytest.mark.slow
def test_with_two_batch_overlap_the_eager_steps_split_and_the_graph_steps_do_not(ranks, single):
    for rank in ranks:
        got = rank["tbo"]
        assert got["tokens"] == single and got["replays"] == len(ranks[0]["dep2"]["votes"])
        assert any(split for rows, split in got["split"] if not rows)  # an eager step ran as two micro-batches
        assert all(split == 0 for rows, split in got["split"] if rows)  # a graph step as one


@pytest.mark.slow
def test_the_exact_exchange_fails_the_guarded_step(ranks):
    """Negative control: backend.options.ep_exchange=exact reads its split sizes on the host."""
    for rank in ranks:
        assert rank["exact"].startswith("host synchronisation in a step: ")
        assert " at kernels/moe_ep.py:" in rank["exact"] and "moe_dispatch" in rank["exact"]


@pytest.mark.slow
def test_dep2_replays_verification_steps_when_every_rank_has_the_same_q(ranks, singles):
    """MTP drafts 2 a sequence under dep2: the ranks vote their tokens a sequence, so a step where every rank
    with work verifies 3 tokens a sequence replays one (bucket, 3) graph on both, an idle rank's padding
    sequence of 3 tokens included; a step where the ranks' q differ (a request near max_tokens drafts fewer)
    runs eagerly on both. The tokens are the single process's."""
    votes = ranks[0]["spec"]["votes"]
    assert ranks[1]["spec"]["votes"] == votes
    assert ([2, 1], 2, False, 3) in votes and ([2, 0], 2, False, 3) in votes  # both verify; rank 1 idle
    draft_votes = ranks[0]["spec"]["draft_votes"]
    steps = [rank["spec"]["steps"] for rank in ranks]
    for rank in ranks:
        got = rank["spec"]
        assert got["tokens"] == singles[1]
        # one capture per (bucket, q, kind) used and per draft graph (bucket, q), each replayed at every agreed step
        assert set(got["keys"]) == {(s, q) for _, s, _, q in votes} | {(s, q) for _, s, q in draft_votes}
        assert len(got["keys"]) == len({(s, g, q) for _, s, g, q in votes}) + len({(s, q) for _, s, q in draft_votes})
        assert got["replays"] == len(votes) + len(draft_votes)
        assert got["reads"] and all(" at backends/reference/" in k for k in got["reads"])
        graph = [moe for _, _, moe in got["moe"] if moe.graph_rows]
        assert [m.graph_rows for m in graph] == [s * q for _, s, _, q in votes]  # token rows: bucket x q
    # a decode on each rank, 3 tokens a sequence on rank 0 and fewer on rank 1: eager on both
    differ = [i for i, ((n0, t0, _), (n1, t1, _)) in enumerate(zip(*steps))
              if i and t0 == 3 * n0 and n1 and t1 % n1 == 0 and t1 != 3 * n1]
    assert differ and all(steps[r][i][2] == steps[r][i - 1][2] for r in (0, 1) for i in differ)


@pytest.mark.slow
def test_dep2_replays_the_mtp_drafts_after_a_graph_step(ranks):
    """After a graph step the ranks vote again, on MTP's draft graph (core/spec/mtp_graph.py): both replay one
    (bucket, q) draft graph, a rank with nothing to draft a padding-only one, and its MoE calls (the prefill's
    bucket x q rows, then a bucket's rows for the chained draft) exchange without a header, as the step's."""
    draft_votes = ranks[0]["spec"]["draft_votes"]
    assert ranks[1]["spec"]["draft_votes"] == draft_votes
    assert ([2, 1], 2, 3) in draft_votes and ([2, 0], 2, 3) in draft_votes  # both draft; rank 1 pads
    k = 2  # drafts a sequence: the prefill's MoE call and one chained draft's
    for rank in ranks:
        got = rank["spec"]
        assert got["draft_replays"] == len(draft_votes) and got["draft_captures"] == len({(s, q) for _, s, q in
                                                                                          draft_votes})
        drafted = [moe for _, _, moe in got["moe"] if moe.draft_graph_rows]
        assert [m.draft_graph_rows for m in drafted] == [s * q + s * (k - 1) for _, s, q in draft_votes]
        assert all(m.headers == 1 and m.rounds == MOE_LAYERS + k for m in drafted)  # the step's end only
