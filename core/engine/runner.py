"""The model runner: one :class:`SchedulerOutput` → one forward pass and one sampling call.

It builds the :class:`~inferhal.core.models.base.ForwardBatch` (block tables → slots through
:func:`~inferhal.core.paging.batch.build_attn_batches`, the one place that maps positions to slots),
calls ``model.forward`` with the backend's KV storage, then the backend's ``sample`` op with each
row's own settings and generator. A sequence with draft tokens gets logits at its last known token and at
every draft, and the backend's ``spec.verify`` op decides how many drafts stand (exact for greedy and
sampled rows alike). A step whose every row is greedy, with no logprobs and no drafts, calls the model's
``forward_greedy`` instead when it has one: its tokens come from ``lm_head.argmax``, without logits (when
the backend's ``lm_head.argmax`` is native, or its ``lm_head`` is the reference's too, so that both paths
give the same token).

With ``keep_hidden`` (a drafter that reads the target's hidden states, e.g. MTP) the model's
``forward_and_hidden`` runs instead (or a decode graph returns them, core/engine/graphs.py) and
:attr:`StepResult.hidden` holds the final hidden states of every token of the step, in the order of ``out.seqs``.

Structured outputs: a request with a grammar (``Request.grammar``) gets its row of the token bitmask before
sampling (and one row per draft position before verification, the matcher advanced through the drafts and
rolled back), applied by the backend's ``sample.mask`` op; its matcher then accepts the tokens that stand.
The bitmask depends on the grammars' states and the drafts only, so it is filled on a side thread while the
model's forward runs (the step waits only for what the forward did not hide: ``StepResult.mask_s``).
Such a step always computes logits (no ``forward_greedy``). A grammar that allows no token at all (a dead
end) lets the end-of-sequence token through, so the request stops instead of sampling from nothing; the
runner records it in :attr:`StepResult.grammar_dead_ends` (for a draft position, only where verification
reached it), and the scheduler's stop check finishes the request there with the reason ``grammar_dead_end``.
Sampling, verification and logprobs are :class:`~inferhal.core.sampling.sampler.Sampler`'s; the bitmask is
:class:`~inferhal.core.structured.bitmask.BitmaskFiller`'s.

Asynchronous scheduling: a decode step scheduled while the previous step ran feeds
:data:`~inferhal.core.scheduler.scheduler.PENDING` for the token that step samples; the runner, which
executes steps in order, fills in the token it sampled for that request in its previous step.

Asynchronous scheduling with a drafter (the ``proposer`` the engine gives it): the drafts of a
step depend on the step before, which the host has not seen when it schedules, so the drafter runs here,
on the step thread, in the order of :mod:`inferhal.core.spec.proposer`. The host schedules a decode with
draft *placeholders* (``PENDING`` in ``spec_token_ids``) at positions that assume every draft in flight
stands; before the forward the runner moves each request back by the drafts its previous step rejected,
proposes at most as many drafts as it has placeholders (:meth:`ModelRunner._resolve`), and after
verification prefills the drafter with the step's exact positions. It keeps each request's tokens as it
knows them (the host's copy, taken when the request enters a step, plus what it sampled since);
:attr:`StepResult.drafts` tells the host which drafts it verified, so :meth:`Scheduler.update` rolls
back the placeholders that did not stand. Outputs equal synchronous mode's: the verifier decides every
token, the drafts only how many come per step. With MTP draft graphs (core/spec/mtp_graph.py) the runner makes
the next step's drafts right after verification, in the prefill's replay (:meth:`ModelRunner._next_wants`), and
the next step keeps as many as it has placeholders: the drafts the eager order gives.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from inferhal.core.models.base import CausalLM, ForwardBatch
from inferhal.core.paging.batch import SeqSlice, build_attn_batches
from inferhal.core.paging.spec import KVGroupSpec
from inferhal.core.sampling.sampler import Sampler
from inferhal.core.scheduler.output import ScheduledSeq, SchedulerOutput
from inferhal.core.scheduler.request import Request
from inferhal.core.scheduler.scheduler import PENDING
from inferhal.core.spec.proposer import DraftWant, StepSeq, TargetStep
from inferhal.core.structured.bitmask import BitmaskFiller


@dataclass
class StepResult:
    tokens: dict[str, int | list[int]] = field(default_factory=dict)  # a list: accepted drafts plus one
    logprobs: dict[str, dict[int, float] | list[dict[int, float]]] = field(default_factory=dict)  # likewise
    prepare_s: float = 0.0
    model_s: float = 0.0
    sample_s: float = 0.0
    hidden: Any = None  # [T, ...] the model's final hidden states of the step's tokens (keep_hidden only)
    # requests whose grammar allowed no token -> the emitted token's index (0: the first) where it did not
    grammar_dead_ends: dict[str, int] = field(default_factory=dict)
    mask_s: float = 0.0  # structured outputs: the bitmask's cost the step waited out (fill not hidden + apply)
    fill_s: float = 0.0  # structured outputs: filling the bitmask, on a side thread while the model ran
    drafts: dict[str, list[int]] = field(default_factory=dict)  # placeholders' drafts, as verified (async drafter)


@dataclass
class _Rows:
    """One step's logits rows: the plain rows first (a request each), then each draft length's rows contiguous
    (the last known token and every draft: S + 1 rows verified together)."""

    plain: list[int] = field(default_factory=list)  # token index of each plain row
    plain_reqs: list[Request] = field(default_factory=list)
    spec: dict[int, list[tuple[int, ScheduledSeq]]] = field(default_factory=dict)  # drafts -> (first row, seq)

    def all(self) -> list[int]:
        rows = list(self.plain)
        for n_draft, group in self.spec.items():
            for first, _ in group:
                rows.extend(range(first, first + n_draft + 1))
        return rows


class ModelRunner:
    def __init__(self, model: CausalLM, ops: Any, kv: Any, specs: Sequence[KVGroupSpec], block_size: int,
                 device: torch.device, *, eos_token_ids: Sequence[int] = (), graphs: Any = None,
                 keep_hidden: bool = False, proposer: Any = None, max_model_len: int = 0) -> None:
        """``graphs``: a :class:`~inferhal.core.engine.graphs.DecodeGraphs` replaying decode steps (None: eager);
        ``keep_hidden``: the drafter reads the target's hidden states (MTP); ``proposer``: the drafter, when it
        runs on this step thread (asynchronous scheduling), with ``max_model_len`` capping its drafts;
        ``eos_token_ids``: what a grammar dead end lets through."""
        self.model, self.ops, self.kv = model, ops, kv
        self.specs, self.block_size, self.device = tuple(specs), block_size, device
        self.graphs, self.keep_hidden, self.proposer, self.max_model_len = graphs, keep_hidden, proposer, max_model_len
        self.sampler = Sampler(ops, device)
        self.bitmasks = BitmaskFiller(model.vocab_size, eos_token_ids)
        self._logits = torch.empty(0, model.vocab_size, dtype=torch.float32, device=device)
        # whether all-greedy steps skip the logits: only where lm_head.argmax agrees with this backend's own
        # lm_head: native, or both the reference's (a native head with the reference's argmax is another product)
        fallbacks = set(ops.fallbacks()) if hasattr(ops, "fallbacks") else set()
        self.greedy_head = (hasattr(model, "forward_greedy")
                            and ("lm_head.argmax" not in fallbacks or "lm_head" in fallbacks))
        self._last: dict[str, int] = {}  # each request's last token sampled by the previous step (PENDING)
        self._tokens: dict[str, list[int]] = {}  # each request's tokens as this thread knows them (proposer)
        self._behind: dict[str, int] = {}  # placeholders the previous step scheduled that did not stand
        self._early: dict[str, list[int]] | None = None  # the next step's drafts, made with the prefill (draft graphs)

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """``[rows, V]`` fp32 for the model's logits, one buffer grown to the most rows seen and reused every
        step (fresh 32 MiB logits at 32 rows cost ~12 ms of page faults a step on the CPU). The logits
        live until the next step: sampling and logprobs read them before then."""
        if self._logits.shape[0] < rows:
            self._logits = torch.empty(rows, self.model.vocab_size, dtype=torch.float32, device=self.device)
        return self._logits[:rows]

    def execute(self, out: SchedulerOutput, requests: Mapping[str, Request], free: Sequence[str] = (),
                tokens: Mapping[str, list[int]] | None = None) -> StepResult:
        """Run one step. With an asynchronous drafter: ``free``, the requests the host ended since the last
        step; ``tokens``, the host's tokens of each request in ``out`` that was not in the step before."""
        if self.proposer is None:
            res = self._execute(out, requests)
        else:
            res = self._execute_drafting(out, requests, free, tokens or {})
        self._last = {r: (t[-1] if isinstance(t, list) else t) for r, t in res.tokens.items()}
        return res

    def _execute_drafting(self, out: SchedulerOutput, requests: Mapping[str, Request], free: Sequence[str],
                          tokens: Mapping[str, list[int]]) -> StepResult:
        prop = self.proposer
        self.release(free)
        self._tokens.update(tokens)
        out, placeholders = self._resolve(out, requests)
        res = self._execute(out, requests)
        behind: dict[str, int] = {}
        seqs, row = [], 0
        for s in out.seqs:
            rid, exact = s.request_id, s.num_new
            if rid in placeholders:
                res.drafts[rid] = list(s.spec_token_ids)
            if s.sample:
                got = res.tokens[rid]
                toks = got if isinstance(got, list) else [got]
                exact = s.num_new - len(s.spec_token_ids) + len(toks) - 1  # known tokens + accepted drafts
                if s.spec_token_ids:
                    prop.accept(rid, len(s.spec_token_ids), len(toks) - 1)
                self._tokens[rid].extend(toks)
                behind[rid] = placeholders.get(rid, len(s.spec_token_ids)) - (len(toks) - 1)
            seqs.append(StepSeq(rid, s.num_computed, exact, row, self._tokens[rid], s.block_ids, s.num_new))
            row += s.num_new
        self._behind = behind
        step = TargetStep(tuple(seqs), res.hidden, self.kv)
        graphs = getattr(prop, "graphs", None)
        if graphs is not None and graphs.usable():  # MTP draft graphs: the prefill and the next step's drafts
            self._early = prop.prefill_and_propose(step, self._next_wants(step, requests), self.kv)
        else:
            prop.prefill(step)
        res.hidden = None
        return res

    def _next_wants(self, step: TargetStep, requests: Mapping[str, Request]) -> list[DraftWant]:
        """Drafts for every request of ``step`` that decodes next, as many as its ``max_tokens`` and
        ``max_model_len`` leave, made now (one draft graph replay with the prefill, core/spec/mtp_graph.py)
        where the eager drafter makes them at the next step's start. The same drafts: they depend only on this
        step's tokens and hidden states and on the request's KV, which nothing writes in between (the blocks of
        the chained positions are this step's lookahead); the next step keeps as many as it has placeholders."""
        wants = []
        for s in step.seqs:
            toks = s.token_ids
            if s.start + s.num_exact != len(toks) - 1:
                continue
            wants.append(DraftWant(s.request_id, toks, self._room(requests[s.request_id], toks) - 1, s.block_ids))
        return wants

    def _room(self, r: Request, toks: Sequence[int]) -> int:
        """Tokens request ``r`` may still get, ``toks`` known: its ``max_tokens`` and ``max_model_len`` room."""
        return min(r.params.max_tokens - (len(toks) - r.num_prompt_tokens), self.max_model_len - len(toks))

    def caught_up(self) -> None:
        """No step in flight and the host folded in every one (the engine's ``_fold_in_flight``): the next step
        was scheduled knowing which drafts stood, so it moves no request back."""
        self._behind = {}

    def release(self, request_ids: Sequence[str]) -> None:
        """Free the drafter's state of ended requests (on the step thread, or while no step is in flight)."""
        for rid in request_ids:
            self.proposer.free(rid)
            for known in (self._tokens, self._behind, self._last, self._early or {}):  # (a later request may reuse the id)
                known.pop(rid, None)

    def _resolve(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> tuple[SchedulerOutput, dict[str, int]]:
        """The step as it runs: each request moved back by the drafts its previous step rejected, and its draft
        placeholders replaced by at most that many drafts from the proposer (none past ``max_tokens`` or
        ``max_model_len``); → the step and each request's number of placeholders."""
        placeholders = {s.request_id: len(s.spec_token_ids) for s in out.seqs if PENDING in s.spec_token_ids}
        early, self._early = self._early, None
        wants = []
        for s in out.seqs:
            if s.request_id in placeholders:
                r, toks = requests[s.request_id], self._tokens[s.request_id]
                start = s.num_computed - self._behind.get(s.request_id, 0)
                if start != len(toks) - 1:
                    raise RuntimeError(f"request {s.request_id!r}: a decode at position {start} with {len(toks)} "
                                       f"tokens known to the step thread")
                wants.append(DraftWant(s.request_id, toks, min(placeholders[s.request_id], self._room(r, toks) - 1),
                                       s.block_ids))
        if early is not None:  # made with the previous step's prefill (_next_wants)
            drafts = {w.request_id: early.get(w.request_id, [])[:max(w.limit, 0)] for w in wants}
        else:
            drafts = self.proposer.propose(wants, self.kv) if wants else {}
        seqs = []
        for s in out.seqs:
            shift = self._behind.get(s.request_id, 0)
            if s.request_id in placeholders:
                d = list(drafts.get(s.request_id, ()))[:placeholders[s.request_id]]
                known = s.num_new - placeholders[s.request_id]
                s = dataclasses.replace(s, num_computed=s.num_computed - shift, num_new=known + len(d),
                                        token_ids=list(s.token_ids[:known]) + d, spec_token_ids=tuple(d))
            elif shift:
                s = dataclasses.replace(s, num_computed=s.num_computed - shift)
            seqs.append(s)
        return dataclasses.replace(out, seqs=tuple(seqs), num_scheduled_tokens=sum(s.num_new for s in seqs)), placeholders

    def _execute(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> StepResult:
        res = StepResult()
        if out.is_empty:
            if self.graphs is not None:  # DP ranks: join the step's graph bucket (core/parallel/dp_graphs.py)
                self.graphs.idle()
            return res
        t0 = time.perf_counter()
        batch, rows, greedy = self._prepare(out, requests)
        # structured outputs: the bitmask depends only on each grammar's state and the drafts, not on this step's
        # logits, so it is filled on a side thread while the model runs and applied before sampling
        jobs = self._mask_jobs(rows, requests)
        filling = self.bitmasks.submit(jobs) if jobs else None
        t1 = time.perf_counter()
        logits, greedy = self._forward(batch, greedy, len(out.seqs), res)
        t2 = time.perf_counter()
        res.prepare_s, res.model_s = t1 - t0, t2 - t1
        if greedy:  # the tokens came straight from lm_head.argmax
            for r, tok in zip(rows.plain_reqs, logits.tolist()):
                res.tokens[r.request_id] = int(tok)
            return res
        dead: dict[str, int] = {}  # request -> the first position (0 = its plain row) where its grammar allowed nothing
        if filling is not None:
            bitmask, at_rows, ends, res.fill_s = filling.result()
            self.ops["sample.mask"](logits, bitmask.to(logits.device),
                                    torch.tensor(at_rows, dtype=torch.long, device=logits.device))
            res.mask_s = time.perf_counter() - t2  # the wait for the fill (if the model was quicker) + applying
            for rid, j in ends:
                dead[rid] = min(j, dead.get(rid, j))
        if rows.plain_reqs:
            toks, lps = self.sampler.sample(logits[: len(rows.plain)], rows.plain_reqs)
            res.tokens.update(toks)
            res.logprobs.update(lps)
        at = len(rows.plain)
        for n_draft, group in rows.spec.items():
            span = len(group) * (n_draft + 1)
            toks, lps = self.sampler.verify(logits[at : at + span].view(len(group), n_draft + 1, -1),
                                            [s.spec_token_ids for _, s in group],
                                            [requests[s.request_id] for _, s in group])
            res.tokens.update(toks)
            res.logprobs.update(lps)
            at += span
        for rid, j in dead.items():  # a dead end counts where the emitted tokens reached it (drafts: maybe not)
            got = res.tokens.get(rid)
            if (len(got) if isinstance(got, list) else 1) > j:
                res.grammar_dead_ends[rid] = j
        res.sample_s = time.perf_counter() - t2
        return res

    def _prepare(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> tuple[ForwardBatch, _Rows, bool]:
        """The step's :class:`ForwardBatch`, its logits rows, and whether every row takes its token from
        ``lm_head.argmax`` (all greedy, no logprobs, no drafts, no grammar: no logits at all)."""
        seqs = [SeqSlice(s.num_computed, s.num_new, s.block_ids, s.write_from) for s in out.seqs]
        positions, qsl, attn = build_attn_batches(self.specs, self.block_size, seqs, self.device)
        ids: list[int] = []
        rows = _Rows()
        for s in out.seqs:
            if PENDING in s.token_ids:  # asynchronous scheduling: the token the previous step sampled
                ids.extend(self._last[s.request_id] if t == PENDING else t for t in s.token_ids)
            else:
                ids.extend(s.token_ids)
            if not s.sample:
                continue
            if s.spec_token_ids:
                rows.spec.setdefault(len(s.spec_token_ids), []).append((len(ids) - len(s.spec_token_ids) - 1, s))
            else:
                rows.plain.append(len(ids) - 1)
                rows.plain_reqs.append(requests[s.request_id])
        greedy = (self.greedy_head and bool(rows.plain_reqs) and not rows.spec
                  and all(r.params.temperature <= 0.0 and not r.params.logprobs and r.grammar is None
                          for r in rows.plain_reqs))
        logits_rows = rows.all()
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),  # [T]
            positions=positions,
            query_start_loc=qsl,
            attn=attn,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=self.device),  # [B']
            logits_out=None if greedy else self._logits_buffer(len(logits_rows)),
            extras={"micro_batches": out.micro_batches} if out.micro_batches else {},  # two-batch overlap
            seqs=tuple(seqs),  # the plan on the host: the model's sizes come from it, not from device reads
        )
        return batch, rows, greedy

    @staticmethod
    def _mask_jobs(rows: _Rows, requests: Mapping[str, Request]) -> list:
        """The structured-output bitmask's jobs (:data:`~inferhal.core.structured.bitmask.Job`) of the step's
        requests with a grammar, at their logits rows."""
        jobs, at = [], len(rows.plain)
        for i, r in enumerate(rows.plain_reqs):
            if r.grammar is not None:
                jobs.append((i, r.grammar, (), r.request_id))
        for n_draft, group in rows.spec.items():
            for k, (_, s) in enumerate(group):
                g = requests[s.request_id].grammar
                if g is not None:
                    jobs.append((at + k * (n_draft + 1), g, list(s.spec_token_ids), s.request_id))
            at += len(group) * (n_draft + 1)
        return jobs

    def _forward(self, batch: ForwardBatch, greedy: bool, num_seqs: int, res: StepResult) -> tuple[torch.Tensor, bool]:
        """The model's step: a decode graph replayed where one fits (a uniform step: every sequence with the
        same number of tokens, drafts included), else eager; → the greedy tokens [B'] or the fp32 logits
        [B', V], and which (``greedy`` unless DP ranks agreed on a logits graph, whose greedy rows the sampler
        takes); ``res.hidden`` set for a drafter that reads them (a graph's second output)."""
        plan = None if self.graphs is None else self.graphs.plan(batch, num_seqs, True, greedy)
        if plan is not None:
            size, greedy = plan
            got = self.graphs.run(batch, greedy, size)
            if got is not None:
                if self.keep_hidden:
                    got, res.hidden = got
                return got, greedy  # else eager: the capture failed
        if self.keep_hidden:
            got, res.hidden = self.model.forward_and_hidden(batch, self.kv, greedy=True) if greedy else \
                self.model.forward_and_hidden(batch, self.kv)
            return got, greedy
        return (self.model.forward_greedy(batch, self.kv) if greedy else self.model.forward(batch, self.kv)), greedy
