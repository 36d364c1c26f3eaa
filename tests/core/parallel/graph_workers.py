"""Rank bodies of the decode-graph tests under dep2 and ep2 (loaded by file in each spawned process), and the
CPU's stand-in for a device graph runner.

:class:`RecordingGraphs` does what a CUDA graph does to a step, as far as the CPU can: ``capture`` records the step
function and copies of its example tensors (the captured buffers) and runs nothing (on a device the capture records
kernels without running them); each replay copies the new inputs into those buffers (same shapes, new values), runs
the function on them under core's host-read guard, and returns its output tensors (the first replay's, overwritten
by each later one: the logits or tokens, and with MTP the hidden states). The guard (:func:`ep_reads_fatal`) raises
at a read in core or model code and at a read in the EP ops, the cuda_sm100 kernels' ``moe.dispatch`` /
``moe.combine`` (Triton's interpreter) bound with ``backend.options.ep_exchange``, where ``auto`` is ``padded``
(what the kernels' ``auto`` picks while a CUDA graph is being captured). Outside a replay (the eager steps, which
the other dep2 tests cover) the EP ops are the reference's, whose exact exchange the kernels' ``auto`` matches
there; the other ops are always the reference backend's stand-ins (a device graph captures a device backend's ops,
whose own reads tests/backends/cuda_sm100/test_host_reads.py checks), and their reads are counted. Unlike a device,
a replay runs the step's Python again; the code under test keeps the host's work for a graph step outside it
(core/parallel/dp_graphs.py), which these tests check by the counters.
"""

import collections
import os

import torch

from inferhal.core.engine.host_sync import HostSyncError, HostSyncGuard

LONG = [(5 * i + 2) % 190 + 1 for i in range(30)]  # chunked over 2 steps (16 tokens a step): not eligible
PROMPTS = [LONG, [7, 150, 33, 9], [42, 43, 44], [20, 21, 22], [9, 9, 4], [60, 61]]
# dep2 places 0, 2, 4 on rank 0 and 1, 3, 5 on rank 1: decodes of 3 and 3 rows, 3 and 1, 3 and 0, 1 and 0;
# request 1 samples (seeded): the ranks agree on a logits graph while it decodes
MAX_TOKENS = [8, 4, 6, 2, 5, 2]
SAMPLED = 1
SIZES = [1, 2, 4]
EP_OPS = ("moe.dispatch", "moe.combine")
# speculative decoding under dep2 (greedy): requests 0 and 2 on rank 0, 1 on rank 1. MTP drafts 2 (limits
# permitting), so decodes verify 3 tokens a sequence on both ranks, then on rank 0 alone (rank 1 idle), and near
# a request's max_tokens fewer (q differs between the ranks, or within rank 0's batch: eager)
SPEC = ["spec=mtp", "spec.num_speculative_tokens=2", "spec.disable_by_batch_size=0"]
SPEC_PROMPTS, SPEC_MAX_TOKENS = [[11, 12, 13], [90, 91], [150, 151, 152, 153]], [8, 4, 7]


class _KernelReadsFatal(collections.Counter):
    """The guard's count of a backend's reads (``"what at path:line function"``), which raises for a place
    under kernels/ instead of counting it."""

    def __setitem__(self, key, value):
        if " at kernels/" in key:
            raise HostSyncError(f"host synchronisation in a step: {key}")
        super().__setitem__(key, value)


def ep_reads_fatal() -> HostSyncGuard:
    """core's guard, raising at a read in core or model code (as always) and in the kernels' EP ops; the
    reference's stand-in ops' reads are counted."""
    guard = HostSyncGuard()
    guard.backend_reads = _KernelReadsFatal()
    return guard


class RecordingGraphs:
    """The graph runner of the module docstring; ``captured``: each capture's rows; ``reads``: the counted
    reads of every replay."""

    def __init__(self) -> None:
        self.captured: list[int] = []  # token rows
        self.keys: list[tuple[int, int]] = []  # (sequences, tokens a sequence) of each capture
        self.replays = 0
        self.replaying = False  # the CPU's "a graph is being captured"
        self.reads: dict[str, int] = {}

    def capture(self, fn, *example):
        static = [a.clone() for a in example]
        self.captured.append(int(static[0].shape[0]))
        seqs = int(static[2].shape[0]) - 1  # query_start_loc
        self.keys.append((seqs, int(static[0].shape[0]) // seqs))
        out: list[torch.Tensor] = []

        def replay(*args):
            assert [a.shape for a in args] == [s.shape for s in static], "a replay changed the captured shapes"
            for s, a in zip(static, args):
                s.copy_(a)
            guard = ep_reads_fatal()
            self.replaying = True
            try:
                with guard:
                    got = fn(*static)
            finally:
                self.replaying = False
            for k, n in guard.backend_reads.items():
                self.reads[k] = self.reads.get(k, 0) + n
            got = got if isinstance(got, tuple) else (got,)  # with MTP: (logits, hidden states)
            if not out:
                out.extend(got)
            else:
                for o, g in zip(out, got):
                    o.copy_(g)
            self.replays += 1
            return tuple(out) if len(out) > 1 else out[0]

        return replay


class MixedOps:
    """An op table whose ``over`` entries replace ``base``'s."""

    def __init__(self, base, over) -> None:
        self._base, self._over = base, over

    def __getitem__(self, op_id):
        return self._over[op_id] if op_id in self._over else self._base[op_id]

    def __getattr__(self, name):
        return getattr(self._base, name)


class GraphBackend:
    """The reference backend with ``runner`` as its graph runner (``backend.graphs=true``, buckets
    :data:`SIZES`) and the kernels' EP ops bound with ``backend.options.ep_exchange=exchange``."""

    def __init__(self, be, runner, exchange: str) -> None:
        from inferhal.core.config.schema import BackendConfig
        from inferhal.core.registry import BackendRegistry

        self._be, self._runner = be, runner
        self.config = BackendConfig(**{**vars(be.config), "graphs": True, "graph_batch_sizes": SIZES})
        ep = BackendRegistry.discover().select(BackendConfig(name="cuda_sm100", interpret=True,
                                                             options={"ep_exchange": exchange})).ops
        kw = {"moe.dispatch": {"exchange": "padded"} if exchange == "auto" else {}, "moe.combine": {}}

        def inside(op_id):  # the kernels' op in a replay (auto: padded, as under a capture), the reference's outside
            return lambda *a, **k: ep[op_id](*a, **kw[op_id], **k) if runner.replaying else be.ops[op_id](*a, **k)

        self.ops = MixedOps(be.ops, {k: inside(k) for k in EP_OPS})

    def __getattr__(self, name):
        return getattr(self._be, name)

    def graph_runner(self):
        return self._runner


def tiny_cfg(overrides=()):
    from inferhal.core.engine.llm import compose_config

    return compose_config("deepseek_v4_tiny", "reference",
                          overrides=["cache.num_blocks=64", "scheduler.max_num_batched_tokens=16", *overrides])


def params(spec: bool = False):
    from inferhal.core.sampling.params import SamplingParams

    if spec:
        return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in SPEC_MAX_TOKENS]
    return [SamplingParams(max_tokens=m, temperature=0.8 if i == SAMPLED else 0.0, top_k=20, seed=7, ignore_eos=True)
            for i, m in enumerate(MAX_TOKENS)]


def graph_llm(layout, exchange: str, layout_name: str, tbo: bool = False, overrides=()):
    """An LLM whose engine is rank ``layout.rank`` of ``layout_name`` (dep2 or ep2) with graphs on (and
    ``parallel.tbo``, and config ``overrides``)."""
    from inferhal.core.engine.llm import LLM
    from inferhal.core.registry import BackendRegistry
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.parallel.dp_engine import DPEngine, attach_dp
    from inferhal.core.parallel.ep_engine import attach_ep

    cfg = tiny_cfg(overrides)
    runner = RecordingGraphs()
    be = GraphBackend(BackendRegistry.discover().select(BackendConfig()), runner, exchange)
    llm = LLM.from_config(cfg, active_backend=be)
    comm = be.communicator(layout)
    if layout_name == "dep2":
        hook = attach_dp(llm.engine, comm, cfg.eplb, tbo=tbo)
        llm.engine = DPEngine(llm.engine, hook)
    else:
        hook = attach_ep(llm.engine, comm, cfg.eplb)
    return llm, hook, runner


def run(llm, prompts=PROMPTS, sampling=None):
    """The prompts to completion; → tokens per request and, per engine step, (scheduled seqs, scheduled
    tokens, graph replays so far)."""
    eng = getattr(llm.engine, "engine", llm.engine)
    ids = [llm.engine.add_request(p, sp) for p, sp in zip(prompts, sampling or params())]
    done, steps = {}, []
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        steps.append((eng.last_step["num_seqs"], eng.last_step["num_tokens"], eng.runner.graphs.num_replays))
    return [done[k] for k in ids], steps


def graph_suite(layout, out_dir):
    """dep2 with the padded exchange (and with two-batch overlap, and with MTP drafts), its negative control with
    the exact one, and ep2; saves each rank's tokens, step log, captures, votes and MoE counters."""
    torch.set_num_threads(1)
    me, got = layout.rank, {}
    llm, hook, runner = graph_llm(layout, "auto", "dep2")
    toks, steps = run(llm)
    got["dep2"] = {"tokens": toks, "steps": steps, "captured": runner.captured, "replays": runner.replays,
                   "reads": runner.reads, "votes": llm.engine.engine.runner.graphs.peers.log,
                   "moe": [(s.attn_tokens, s.seqs, s.moe) for s in hook.log], "placements": llm.engine.placements}
    llm, hook, runner = graph_llm(layout, "auto", "dep2", tbo=True)  # eager steps split in two, graph steps not
    toks, steps = run(llm)
    got["tbo"] = {"tokens": toks, "replays": runner.replays,
                  "split": [(s.moe.graph_rows, s.moe.split_passes) for s in hook.log]}
    llm, hook, runner = graph_llm(layout, "auto", "dep2", overrides=SPEC)  # verification steps of 1 + K tokens
    toks, steps = run(llm, SPEC_PROMPTS, params(spec=True))
    eng = llm.engine.engine
    drafts = eng.drafting.proposer.graphs
    got["spec"] = {"tokens": toks, "steps": steps, "keys": runner.keys, "replays": runner.replays,
                   "reads": runner.reads, "votes": eng.runner.graphs.peers.log,
                   "draft_votes": eng.runner.graphs.peers.draft_log, "draft_replays": drafts.num_replays,
                   "draft_captures": drafts.num_captures, "moe": [(s.attn_tokens, s.seqs, s.moe) for s in hook.log]}
    llm, hook, runner = graph_llm(layout, "exact", "dep2")
    try:  # a prompt each, then a decode step of one row each
        run(llm, PROMPTS[1:3], params()[2:4])
        got["exact"] = "no error"
    except HostSyncError as exc:
        got["exact"] = str(exc)
    llm, hook, runner = graph_llm(layout, "auto", "ep2")
    toks, steps = run(llm)
    got["ep2"] = {"tokens": toks, "steps": steps, "captured": runner.captured, "replays": runner.replays}
    torch.save(got, os.path.join(out_dir, f"rank{me}.pt"))

