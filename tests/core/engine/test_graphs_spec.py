"""Speculative decoding's verification steps replayed from decode graphs (core/engine/graphs.py): a step whose
every sequence carries its last token and ``k`` drafts is captured per (bucket, tokens a sequence, kind), with
the target's hidden states as a second output for the MTP drafter. The tiny DeepSeek-V4 with its fitted MTP
layer and with n-gram drafts, greedy, ``deterministic=true``: graphs on give the eager run's tokens, every draft
the drafter made and its logprobs bit for bit (plain decode steps replay among them). That needs more than equal
inputs: a graph step has no host plan, so DeepSeek-V4's HCA layers index ``max_model_len // 16`` entries (-1
padded) where the eager step indexes its own context's, and the batch-invariant mode's sparse attention sums over
fixed key slices, so trailing masked entries add exact zeros (backends/reference/attention.py:attend_chunked).
The negative control plants a split whose boundary follows the padded width (half of it): the replayed
logprobs then differ. The graph runner is the CPU's stand-in (as tests/core/parallel/graph_workers.py's):
capture records the step and copies of its inputs, each replay copies new inputs into them and runs the step
under core's host-read guard (a read in core or model code raises), and every replay returns the same output
tensors, overwritten. Reference ops on the CPU, and one step on cuda_sm100's kernels in Triton's interpreter:
no device graph is captured here (.ci/device_check does that)."""

from __future__ import annotations

import pytest
import torch

from inferhal import LLM, SamplingParams
from inferhal.core.config.schema import CacheConfig, SchedulerConfig, SpecConfig
from inferhal.core.engine.engine import Engine
from inferhal.core.engine.host_sync import HostSyncGuard
from inferhal.core.engine.llm import compose_config
from inferhal.kernels.runtime import use_interpreter
from tests.core.engine.test_graphs import WithGraphs

# the last test's kernels run in Triton's interpreter, which must be on before anything imports triton: the host-read
# guard's TorchDispatchMode does (torch imports triton with it); at collection, as tests/kernels/conftest.py does
use_interpreter(True)

SIZES = (1, 2, 4, 8)
K = 2
SEEDS = [[7, 150, 33, 9, 61, 4, 88, 120], [42, 43, 44, 45, 12, 99, 5], [20, 21, 22, 181, 64, 3, 17, 170, 2]]
MAX_TOKENS = [13, 10, 7]  # the requests end apart: buckets 4 (a padding sequence), 2 and 1


class GuardedGraphs:
    """The stand-in runner of the module docstring. ``captured``: each capture's (sequences, tokens a
    sequence); ``stale_hidden``: replays refresh only the first output (a graph whose hidden states are not
    one of its outputs), the negative control."""

    def __init__(self, stale_hidden: bool = False) -> None:
        self.stale_hidden, self.captured, self.replays = stale_hidden, [], []

    def capture(self, fn, *example):
        static = [a.clone() for a in example]
        seqs = int(static[2].shape[0]) - 1  # query_start_loc
        key = (seqs, int(static[0].shape[0]) // seqs)
        self.captured.append(key)
        out: list = []

        def replay(*args):
            assert [a.shape for a in args] == [s.shape for s in static], "a replay changed the captured shapes"
            for s, a in zip(static, args):
                s.copy_(a)
            with HostSyncGuard():
                got = fn(*static)
            got = got if isinstance(got, tuple) else (got,)
            if not out:
                out.extend(got)
            else:
                for o, g in zip(out, got[:1] if self.stale_hidden else got):
                    o.copy_(g)
            self.replays.append(key)
            return tuple(out) if len(out) > 1 else out[0]

        return replay


@pytest.fixture(scope="module")
def loaded():
    eng = LLM.from_config(compose_config("deepseek_v4_tiny_mtp", "reference", ["deterministic=true"])).engine
    return eng.loaded, eng.backend


def engine(loaded, method, runner, async_scheduling=False):
    model, backend = loaded
    return Engine(model, WithGraphs(backend, runner, graphs=runner is not None,
                                    **({"graph_batch_sizes": list(SIZES)} if runner is not None else {})),
                  SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=async_scheduling),
                  CacheConfig(num_blocks=64), spec=SpecConfig(method=method, num_speculative_tokens=K * (method != "none")),
                  deterministic=True)


def prompts(method):
    """MTP: the seeds (its drafter always drafts ``K``). n-gram: each request's prompt holds every token of the
    vocabulary once, so every decode step finds the last token earlier with ``K`` tokens after it, and most
    verification steps are uniform."""
    if method == "mtp":
        return SEEDS
    return [s + torch.randperm(192, generator=torch.Generator().manual_seed(i)).tolist() for i, s in enumerate(SEEDS)]


def run(loaded, prompts, method, runner, async_scheduling=False, pads=None):
    """Greedy over ``prompts`` (every other request with logprobs): each request's tokens and logprobs, each
    drafter call's drafts by (request, tokens known), the engine's step log (sequences, tokens), the engine.
    ``pads``: a list that gets each padded step's (sequences, tokens a sequence, the graph's arguments)."""
    eng = engine(loaded, method, runner, async_scheduling)
    if pads is not None:
        graphs, pad = eng.runner.graphs, eng.runner.graphs._pad

        def logged_pad(batch, size, q=1):
            args = pad(batch, size, q)
            pads.append((int(batch.query_start_loc.shape[0]) - 1, q, args))
            return args

        graphs._pad = logged_pad
    drafts, propose = {}, eng.proposer.propose

    def logged(wants, kv=None):
        got = propose(wants, kv)
        for w in wants:
            drafts[(w.request_id, len(w.token_ids))] = list(got.get(w.request_id, ()))
        return got

    eng.proposer.propose = logged
    if hasattr(eng.proposer, "prefill_and_propose"):  # MTP: a draft graph's drafts skip propose
        fused = eng.proposer.prefill_and_propose

        def logged_fused(step, wants, kv=None):
            got = fused(step, wants, kv)
            for w in wants or ():
                drafts[(w.request_id, len(w.token_ids))] = list(got.get(w.request_id, ()))
            return got

        eng.proposer.prefill_and_propose = logged_fused
    ids = [eng.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2 * (i % 2)))
           for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]
    done, steps = {}, []
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
        steps.append((eng.last_step["num_seqs"], eng.last_step["num_tokens"]))
    name = {r: i for i, r in enumerate(ids)}
    outs = [(done[r].token_ids, done[r].logprobs) for r in ids]
    return outs, {(name[r], n): d for (r, n), d in drafts.items()}, steps, eng


@pytest.fixture(scope="module")
def eager(loaded):
    """The eager run of (method, async_scheduling), each once."""
    done = {}

    def get(method, async_scheduling=False):
        if (method, async_scheduling) not in done:
            done[method, async_scheduling] = run(loaded, prompts(method), method, None, async_scheduling)
        return done[method, async_scheduling]

    return get


@pytest.mark.parametrize("method,async_scheduling", [("mtp", False), ("mtp", True), ("ngram", False)])
def test_verification_steps_replay_with_the_eager_tokens_logprobs_and_drafts(loaded, eager, method, async_scheduling):
    want_outs, want_drafts, _, _ = eager(method, async_scheduling)
    fake, pads = GuardedGraphs(), []
    outs, drafts, steps, eng = run(loaded, prompts(method), method, fake, async_scheduling, pads)
    assert outs == want_outs and any(lp for _, lp in outs)  # tokens and logprobs, bit for bit
    if async_scheduling:  # the step thread's calls with no room for drafts (limit 0) depend on its timing
        drafts, want_drafts = ({k: d for k, d in x.items() if d} for x in (drafts, want_drafts))
    assert drafts == want_drafts and sum(len(d) for d in drafts.values()) > 0
    graphs = eng.runner.graphs
    # MTP: its draft steps after a uniform step replay too (core/spec/mtp_graph.py: the same runner, under the
    # guard), each (bucket, q, k) captured once; asynchronous: the step thread drafts right after verification
    # (core/engine/runner.py), and the drafts equal the eager order's (its start-of-step proposals)
    drafter = getattr(eng.proposer, "graphs", None)
    assert (drafter is not None) == (method == "mtp")
    d_caps, d_reps, d_keys = (0, 0, set()) if drafter is None else \
        (drafter.num_captures, drafter.num_replays, {(b, q) for b, q, _ in drafter._replays})
    assert drafter is None or (d_reps > 0 and drafter.disabled is None and d_caps == len(drafter._replays))
    # verification steps (every sequence: 1 + K tokens) replayed, each (bucket, q, kind) captured once
    assert len(fake.replays) == graphs.num_replays + d_reps and sum(q == 1 + K for _, q in fake.replays) > 0
    assert any(q == 1 for _, q in fake.replays)  # plain decode steps too
    assert len(fake.captured) == graphs.num_captures + d_caps and graphs.num_captures == len(graphs._replays)
    assert {(b, q) for b, q, _ in graphs._replays} | d_keys == set(fake.replays) == set(fake.captured)
    # steps whose sequences carry different token counts (prompt chunks, drafts cut short) ran eagerly
    assert graphs.num_replays < len(steps)
    assert graphs.hidden is (method == "mtp") and graphs.disabled is None
    # padding sequences (a 3-sequence step in bucket 4): the first sequence's q tokens at its positions, its
    # lengths and block tables, every slot -1
    padded = [(n, q, args) for n, q, args in pads if q > 1 and n < int(args[2].shape[0]) - 1]
    assert padded
    for n, q, (ids, pos, qsl, rows, *per_group) in padded:
        size = int(qsl.shape[0]) - 1
        assert qsl.tolist() == list(range(0, q * size + 1, q)) and rows.tolist() == list(range(q * size))
        assert torch.equal(pos[n * q:].view(-1, q), pos[:q].expand(size - n, q))
        assert torch.equal(ids[n * q:].view(-1, q), ids[:q].expand(size - n, q))
        for g in range(len(eng.specs)):
            lens, table, slots = per_group[3 * g: 3 * g + 3]
            assert bool((slots[n * q:] == -1).all()) and slots.shape == (q * size,)
            assert torch.equal(table[n:], table[:1].expand(size - n, -1)) and torch.equal(lens[n:], lens[:1].expand(size - n))
    eng.kv_manager.check()


def test_stale_hidden_states_change_the_mtp_drafts(loaded, eager):
    """The negative control: a graph whose hidden states are the capture's, not the replay's, gives the same
    tokens (the verifier decides them) but other drafts, which the test above would catch."""
    want_outs, want_drafts, _, _ = eager("mtp")
    fake = GuardedGraphs(stale_hidden=True)
    outs, drafts, _, _ = run(loaded, prompts("mtp"), "mtp", fake)
    assert fake.replays and [o[0] for o in outs] == [o[0] for o in want_outs]
    assert drafts != want_drafts


def test_a_split_that_follows_the_padded_width_changes_the_replayed_logprobs(loaded, monkeypatch):
    """The negative control of the bitwise comparison above: sparse attention's slices cut at half of the
    row's width (a split-KV whose boundary moves with -1 padding, what the mode forbids), eager and replayed
    alike; the graph's wider HCA rows then round otherwise and the logprobs differ (the tokens need not)."""
    from inferhal.backends.reference import attention, deepseek

    monkeypatch.setattr(deepseek, "attend_chunked", lambda q, k, v, mask, p, sinks: attention.attend_chunked(
        q, k, v, mask, p, sinks, chunk=-(-k.shape[1] // 2)))
    want_outs, _, _, _ = run(loaded, prompts("mtp"), "mtp", None)
    fake = GuardedGraphs()
    outs, _, _, _ = run(loaded, prompts("mtp"), "mtp", fake)
    assert fake.replays and [lp for _, lp in outs] != [lp for _, lp in want_outs]


@pytest.mark.slow
def test_a_verification_step_runs_on_the_kernels_without_a_host_read():
    """A 3-token verification step (the last token and 2 drafts) of one sequence padded to a 2-sequence bucket,
    through the tiny V4's logits-and-hidden step on cuda_sm100's kernels (Triton's interpreter) under the guard
    with backend reads fatal: the real sequence's logits and hidden states equal the eager step's (with the
    host's plan) bit for bit, and the padding sequence's equal them too (the same tokens at the same places)."""
    from inferhal.core.engine.graphs import DecodeGraphs
    from inferhal.core.models.base import ForwardBatch
    from inferhal.core.paging.batch import SeqSlice, build_attn_batches

    eng = LLM("deepseek_v4_tiny_mtp", backend="cuda_sm100", overrides=[
        "backend.interpret=true", "backend.strict=true", "cache.num_blocks=4", "spec=mtp",
        f"spec.num_speculative_tokens={K}"]).engine
    for buf, _ in eng.kv_storage.groups.values():
        buf.fill_(0x3C)  # a finite byte pattern as the earlier positions' KV (0.0115 as fp32 and bf16)
    kvm = eng.kv_manager
    assert kvm.allocate("a", 0, 24)
    plan = [SeqSlice(21, 1 + K, kvm.block_ids("a"))]
    pos, qsl, attn = build_attn_batches(eng.specs, kvm.block_size, plan)
    batch = ForwardBatch(torch.tensor([5, 9, 11]), pos, qsl, attn, torch.arange(1 + K), seqs=tuple(plan))
    graphs = DecodeGraphs(None, eng.model, eng.specs, kvm.block_size, eng.max_model_len, [2], eng.kv_storage,
                          num_drafts=K, hidden=True)
    assert graphs.uniform(batch, 1) == 1 + K
    args = graphs._pad(batch, 2, 1 + K)  # on the host, before the step (as DecodeGraphs.run does)
    with HostSyncGuard(backend_fatal=True):
        logits, hidden = graphs._step_fn(False)(*args)
    want, want_hidden = eng.model.forward_and_hidden(batch, eng.kv_storage)  # rewrites the same KV entries
    assert logits.shape == (2 * (1 + K), 192) and bool(torch.isfinite(logits).all())
    assert torch.equal(logits[:1 + K], want) and torch.equal(hidden[:1 + K], want_hidden)
    assert torch.equal(logits[1 + K:], want) and torch.equal(hidden[1 + K:], want_hidden)


def test_an_mtp_draft_step_runs_on_the_kernels_without_a_host_read():
    """The MTP drafter's prefill over 3 rows of a sequence (2 exact) and its chained step
    (core/spec/mtp_graph.py), through cuda_sm100's kernels (Triton's interpreter) under the guard with backend
    reads fatal: the eager drafter's drafts, and the KV pool bit for bit as the eager drafter leaves it."""
    from tests.core.spec.test_mtp_graph import graphs, kv_state, setup

    eng = LLM("deepseek_v4_tiny_mtp", backend="cuda_sm100", overrides=[
        "backend.interpret=true", "backend.strict=true", "cache.num_blocks=8", "spec=mtp",
        f"spec.num_speculative_tokens={K}"]).engine
    step, wants = setup(eng, [2], [5])
    eng.proposer.prefill(step)
    want, want_kv = eng.proposer.propose(wants, eng.kv_storage), kv_state(eng)
    g = graphs(eng, None)
    step, wants = setup(eng, [2], [5])
    q, keep = g.plan(step, wants)
    args = g.inputs(step, q, keep, 1)  # on the host, before the step (as MtpDraftGraphs.draft does)
    with HostSyncGuard(backend_fatal=True):
        drafts = g.step_fn()(*args)
    assert drafts.tolist() == [want["r0"]] and keep == [K]
    assert all(torch.equal(a, b) for a, b in zip(kv_state(eng), want_kv))
