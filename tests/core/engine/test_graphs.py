"""Decode steps through the backend's graph runner (core/engine/graphs.py), with a fake runner on the CPU
that behaves as a CUDA graph does: the inputs are copied into buffers fixed at capture, and every replay
returns the same output tensor. The real capture is device-only (.ci/device_check)."""

from __future__ import annotations

import pytest
import torch

from inferhal import LLM, SamplingParams
from inferhal.core.config.schema import BackendConfig, CacheConfig, SchedulerConfig, SpecConfig
from inferhal.core.engine.engine import Engine
from inferhal.core.engine.graphs import GraphCaptureWarning
from inferhal.core.engine.llm import compose_config
from inferhal.core.errors import UserError

BASE = [(7 * i + 3) % 190 + 1 for i in range(48)]
PROMPTS = [BASE[:5], BASE[:37], BASE[3:20], BASE[:48], [42, 43], BASE[:40] + [9, 9, 9], BASE[:32] + [11] * 10,
           BASE[10:14], BASE[20:31]]


class FakeGraphs:
    """Captures by running once on its own copies of the example inputs; a replay copies the new inputs
    in, runs again and writes the result into the output of the capture (the tensor every replay returns)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.captured, self.replays = fail, [], 0

    def capture(self, fn, *example):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        static = [a.clone() for a in example]
        out = fn(*static)
        self.captured.append(int(static[0].shape[0]))

        def replay(*args):
            assert [a.shape for a in args] == [s.shape for s in static], "a replay changed the captured shapes"
            for s, a in zip(static, args):
                s.copy_(a)
            out.copy_(fn(*static))
            self.replays += 1
            return out

        return replay


class WithGraphs:
    """An ActiveBackend whose graph runner is ``runner`` (and whose config is ``config``)."""

    def __init__(self, be, runner, **config):
        self._be, self._runner = be, runner
        self.config = BackendConfig(**{**vars(be.config), **config})

    def __getattr__(self, name):
        return getattr(self._be, name)

    def graph_runner(self):
        return self._runner


@pytest.fixture(scope="module")
def tiny():
    return LLM.from_config(compose_config("deepseek_v4_tiny", "reference")).engine


def engine(tiny, runner, **config):
    config.setdefault("graphs", runner is not None)
    return Engine(tiny.loaded, WithGraphs(tiny.backend, runner, **config),
                  SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32), CacheConfig(num_blocks=10))


def generate(eng, params):
    ids = [eng.add_request(p, params[i % len(params)]) for i, p in enumerate(PROMPTS)]
    done, steps = {}, []
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps.append((eng.last_step["num_seqs"], eng.last_step["num_tokens"]))
    return [done[i] for i in ids], steps


PARAMS = {
    "greedy": [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)],
    "sampled": [SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True, logprobs=2) for i in range(3)],
}


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_replayed_decode_steps_give_the_eager_tokens(tiny, kind):
    want, _ = generate(engine(tiny, None), PARAMS[kind])
    fake = FakeGraphs()
    eng = engine(tiny, fake, graph_batch_sizes=[1, 2, 4, 8])
    got, steps = generate(eng, PARAMS[kind])
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for p, q in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert p.keys() == q.keys() and all(abs(p[t] - q[t]) < 1e-5 for t in p)
    decodes = [n for n, t in steps if n == t]
    assert sum(o.num_preemptions for o in got) > 0 and sum(o.num_cached_tokens for o in got) > 0
    # every pure decode step replayed from its bucket's graph, each bucket captured once; mixed steps ran eagerly
    assert fake.replays == eng.runner.graphs.num_replays == len(decodes) > 0
    buckets = {next(b for b in (1, 2, 4, 8) if b >= n) for n in decodes}
    assert sorted(fake.captured) == sorted(buckets) and len(buckets) > 1
    assert len(decodes) < len(steps)
    eng.kv_manager.check()


def test_padding_rows_write_no_kv_and_read_allocated_blocks(tiny):
    """A 3-row decode padded to 8: the padding rows' slots are all -1 and their tables are row 0's."""
    fake = FakeGraphs()
    eng = engine(tiny, fake, graph_batch_sizes=[8])
    seen = []
    real = eng.runner.graphs._pad

    def pad(batch, size, q=1):
        args = real(batch, size, q)
        seen.append((int(batch.input_ids.shape[0]), args))
        return args

    eng.runner.graphs._pad = pad
    for p in PROMPTS[:3]:
        eng.add_request(p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert seen and fake.captured == [8]
    for n, args in seen:
        per_group = args[4:]
        for g in range(len(eng.specs)):
            lens, table, slots = per_group[3 * g: 3 * g + 3]
            assert bool((slots[n:] == -1).all())
            assert torch.equal(table[n:], table[:1].expand(8 - n, -1)) and torch.equal(lens[n:], lens[:1].expand(8 - n))


def test_a_failed_capture_turns_graphs_off_and_the_step_runs_eagerly(tiny):
    want, _ = generate(engine(tiny, None), PARAMS["greedy"])
    eng = engine(tiny, FakeGraphs(fail=True))
    with pytest.warns(GraphCaptureWarning, match="backend.graphs: graphs off .* stream is capturing"):
        got, _ = generate(eng, PARAMS["greedy"])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert "stream is capturing" in eng.runner.graphs.disabled and eng.runner.graphs.num_replays == 0


def test_graphs_off_run_eagerly_and_bad_settings_are_refused(tiny):
    assert engine(tiny, FakeGraphs(), graphs=False).runner.graphs is None
    assert tiny.runner.graphs is None  # off by default
    # true where the backend captures nothing (the CPU backends, an interpreter): refused, naming the field
    with pytest.raises(UserError, match=r"backend.graphs=true: backend 'reference' captures no graphs at level"):
        engine(tiny, None, graphs=True)
    with pytest.raises(UserError, match=r"backend.graphs=true"):
        LLM.from_config(compose_config("deepseek_v4_tiny", "reference", ["backend.graphs=true"]))
    for bad in ([], [0, 4], ["x"]):
        with pytest.raises(UserError, match="backend.graph_batch_sizes"):
            engine(tiny, FakeGraphs(), graph_batch_sizes=bad)
    # an MTP drafter: its steps replay with the hidden states as an output (test_graphs_spec.py), not refused
    g = Engine(tiny.loaded, WithGraphs(tiny.backend, FakeGraphs(), graphs=True), cache=CacheConfig(num_blocks=10),
               spec=SpecConfig(method="mtp", num_speculative_tokens=2)).runner.graphs
    assert g.hidden and g.widths == (1, 3)
    # buckets without graphs would do nothing: refused
    with pytest.raises(UserError, match="backend.graph_batch_sizes is read only with backend.graphs=true"):
        engine(tiny, FakeGraphs(), graphs=False, graph_batch_sizes=[1, 2])


class Peers:
    """DP ranks' agreement (core/parallel/dp_graphs.py) as a stand-in: every step replays ``agreed``."""

    def __init__(self, agreed):
        self.agreed, self.votes, self.done_calls = agreed, [], 0

    def agree(self, rows, greedy, q=1):
        self.votes.append((rows, greedy))
        return self.agreed

    def done(self):
        self.done_calls += 1


def test_an_idle_dp_ranks_padding_step_replays_the_agreed_graph_and_writes_no_kv(tiny):
    """A rank that scheduled nothing joins the agreement and, when its peers replay a graph, runs one padding
    sequence (block 0's first entries read, nothing written) copied to the bucket through that graph: of one
    token, or of ``q`` when its peers verify drafts (a logits graph of ``q`` tokens a sequence)."""
    fake = FakeGraphs()
    eng = engine(tiny, fake, graph_batch_sizes=[1, 2, 4])
    for p in PROMPTS[:2]:
        eng.add_request(p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    graphs = eng.runner.graphs
    kv = [buf.clone() for buf, _ in eng.kv_storage.groups.values()]
    graphs.peers = Peers((4, True, 1))
    captured = list(fake.captured)
    eng.step()  # nothing scheduled
    assert graphs.peers.votes == [(0, True)] and fake.captured == captured + [4] and graphs.num_replays > 0
    assert graphs.peers.done_calls == 1  # the MoE exchanges of the rest of the step run in rounds again
    graphs.peers = Peers((2, False, 3))  # the peers verify 2 drafts a sequence
    eng.step()
    assert fake.captured == captured + [4, 2 * 3] and (2, 3, False) in graphs._replays
    assert all(torch.equal(a, buf) for a, (buf, _) in zip(kv, eng.kv_storage.groups.values()))
    graphs.peers = Peers(None)  # the peers run eagerly: nothing runs here
    eng.step()
    assert fake.captured == captured + [4, 6] and graphs.peers.votes == [(0, True)]


def test_a_failed_capture_on_a_dp_rank_raises_instead_of_running_eagerly(tiny):
    """Its peers' steps exchange at the bucket's shapes: this rank cannot fall back alone."""
    eng = engine(tiny, FakeGraphs(fail=True), graph_batch_sizes=[4])
    eng.runner.graphs.peers = Peers((4, True, 1))
    with pytest.raises(RuntimeError, match=r"backend.graphs: capturing a 4-row decode step failed: .* a DP rank "
                                           r"cannot run this step eagerly .* set backend.graphs=false"):
        eng.step()  # nothing scheduled: the padding-only step's capture fails


def test_the_padding_row_runs_on_the_kernels_without_a_host_read_and_writes_nothing():
    """An idle DP rank's padding row (position 0, block 0's first entry, every slot -1) through the tiny V4's
    greedy step on cuda_sm100's kernels (Triton's interpreter), under the guard with backend reads fatal; the
    KV pool, filled with a finite byte pattern first, is unchanged."""
    from inferhal.core.engine.graphs import DecodeGraphs
    from inferhal.core.engine.host_sync import HostSyncGuard

    eng = LLM("deepseek_v4_tiny", backend="cuda_sm100",
              overrides=["backend.interpret=true", "backend.strict=true", "cache.num_blocks=4"]).engine
    for buf, _ in eng.kv_storage.groups.values():
        buf.fill_(0x3C)  # 0.0115 as fp32 and bf16, 1.5 as e4m3: finite, and not what a write would leave
    kv = [buf.clone() for buf, _ in eng.kv_storage.groups.values()]
    graphs = DecodeGraphs(None, eng.model, eng.specs, eng.kv_manager.block_size, eng.max_model_len, [2],
                          eng.kv_storage)
    args = graphs._pad(graphs._padding_batch(), 2)  # on the host, before the step (as DecodeGraphs.run does)
    with HostSyncGuard(backend_fatal=True):
        tokens = graphs._step_fn(True)(*args)
    assert tokens.shape == (2,) and torch.equal(tokens[0], tokens[1])
    assert all(torch.equal(a, buf) for a, (buf, _) in zip(kv, eng.kv_storage.groups.values()))
