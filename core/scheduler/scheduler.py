"""Token-budget continuous batching with chunked prefill, prefix-cache hits and preemption by recompute.

Each :meth:`Scheduler.schedule` builds one step under ``max_num_batched_tokens`` and ``max_num_seqs``:

1. Running requests that are decoding (one token to compute), in admission order, then running
   requests in the middle of a chunked prefill. When the pool has no block for one of them, a victim
   is preempted by recompute (FCFS: the most recently admitted; priority: the largest
   ``(priority, arrival)``) until it fits, or the request preempts itself.
2. Waiting requests (FCFS: arrival order; priority: ``(priority, arrival)``), only in a step with no
   preemption. Each first takes its longest prefix-cache hit (those tokens are not computed) or, when
   resuming a sliding-only model, starts at its bounded replay point (:mod:`inferhal.core.paging.replay`).

A decoding request may carry draft tokens (``Request.spec_token_ids``, set by the engine's drafter): they
are scheduled after its decode token when the budget allows, and dropped before anyone is preempted for
room. A drafter that writes state past the step (MTP's chained drafts) sets ``num_lookahead_tokens``: a step
that reaches a request's last known token also allocates that many positions after it (given up first when
the pool is short); one whose state at a position reads the next token sets ``trim_prefix_hit``: a prefix
hit gives up its last block. :meth:`Scheduler.update` takes the accepted drafts plus one token, rolls ``num_computed_tokens``
back over the rejected ones (their KV slots are simply written again), and stops at the first stopping
token among them. With asynchronous scheduling and a drafter (``num_placeholder_drafts``) the drafts are not
known when the next step is scheduled: a decode gets that many ``PENDING`` placeholders instead, at
positions that assume every draft in flight stands (``num_pending`` counts them as tokens,
``num_pending_drafts`` as possibly too far, so sliding windows keep their blocks back to the lower
start); the runner proposes the drafts, and ``update`` rolls back the placeholders that did not stand.

:meth:`Scheduler.update` applies sampled tokens, ends requests where its
:class:`~inferhal.core.scheduler.stopping.StopChecker` says (a grammar dead end, EOS unless ``ignore_eos``, a stop
token or string, ``max_tokens``, ``max_model_len``: the one place a request's end is decided from its tokens) and
registers newly full blocks in the prefix cache.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from typing import Any, Iterable, Mapping, Optional, Sequence

from inferhal.core.config.schema import SchedulerConfig
from inferhal.core.errors import UserError
from inferhal.core.paging.kv_manager import KVCacheManager
from inferhal.core.paging.replay import replay_span, replay_start
from inferhal.core.scheduler.output import ScheduledSeq, SchedulerOutput
from inferhal.core.scheduler.request import Request, Status
from inferhal.core.scheduler.stopping import StopChecker

POLICIES = ("fcfs", "priority")
PENDING = -1  # a token id not known yet: the one the step in flight samples (the runner fills it in)


class RequestError(UserError, ValueError):
    """One request cannot be served as given (too long, does not fit the KV pool); the message says why."""


class NoRoomNow(RequestError):
    """The request fits this engine, but not beside what runs now (:meth:`Scheduler.adopt`): try again later."""


def check_length(req: Request, max_model_len: int, chunked_prefill: bool, max_num_batched_tokens: int) -> int:
    """Raise :class:`RequestError` when ``req``'s prompt can never run under these limits; → the tokens it
    may hold at its end (prompt + ``max_tokens``, at most ``max_model_len``)."""
    n = req.num_prompt_tokens
    if n == 0:
        raise RequestError(f"request {req.request_id!r}: the prompt is empty")
    if n >= max_model_len:
        raise RequestError(
            f"request {req.request_id!r}: prompt of {n} tokens does not fit max_model_len={max_model_len} "
            f"(at most {max_model_len - 1} prompt tokens, leaving room for one generated token)")
    if not chunked_prefill and n > max_num_batched_tokens:
        raise RequestError(
            f"request {req.request_id!r}: prompt of {n} tokens exceeds scheduler.max_num_batched_tokens="
            f"{max_num_batched_tokens} and chunked_prefill is off")
    return min(n + req.params.max_tokens, max_model_len)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, max_model_len: int, *,
                 stop: Optional[StopChecker] = None, num_lookahead_tokens: int = 0, trim_prefix_hit: bool = False,
                 num_placeholder_drafts: int = 0, spec_off_at: Optional[int] = None) -> None:
        """``stop``: when requests end (default: without stop strings, for a model without a tokenizer); the
        rest come from the engine's drafter (see the module docstring): ``num_lookahead_tokens`` positions
        allocated past a step's last known token, ``trim_prefix_hit`` (a prefix hit gives up its last block),
        and under asynchronous scheduling ``num_placeholder_drafts`` per decode unless ``spec_off_at`` or more
        requests run."""
        if cfg.policy not in POLICIES:
            raise UserError(f"scheduler.policy must be one of {POLICIES}, got {cfg.policy!r}")
        if cfg.max_num_seqs < 1 or cfg.max_num_batched_tokens < 1:
            raise UserError("scheduler.max_num_seqs and scheduler.max_num_batched_tokens must be >= 1")
        self.cfg = cfg
        self.kv = kv
        self.max_model_len = max_model_len
        self.priority = cfg.policy == "priority"
        self.span = replay_span(kv.specs, cfg.sliding_replay)
        self._all_sliding = all(s.kind == "sliding" for s in kv.specs)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self._wkeys: list[tuple[int, int]] = []  # priority policy: sorted keys parallel to waiting
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # drafts verified so far, all requests
        self.num_accepted_tokens = 0  # of which accepted
        self.drafted_at: list[int] = []  # [i]: steps that verified a draft at position i (0-based)
        self.accepted_at: list[int] = []  # [i]: of which accepted it
        self.stop = stop or StopChecker(max_model_len)
        self.num_lookahead_tokens, self.trim_prefix_hit = int(num_lookahead_tokens), bool(trim_prefix_hit)
        # two-batch overlap (set by parallel/dp_engine.attach_dp under parallel.tbo): tokens per scheduled
        # sequence -> sequences per micro-batch (SchedulerOutput.micro_batches)
        self.micro_batch_split: Any = None
        # asynchronous scheduling with a drafter: decodes get up to this many draft placeholders (PENDING),
        # which the runner fills in with the drafts it proposes after the step in flight (0: the host's drafts)
        self.num_placeholder_drafts = int(num_placeholder_drafts)
        self.spec_off_at = spec_off_at  # no placeholders while this many requests or more run
        self._arrivals = 0

    # ------------------------------------------------------------------ requests in and out

    def check_request(self, req: Request) -> None:
        """Raise :class:`RequestError` when ``req`` can never run; changes nothing."""
        total = check_length(req, self.max_model_len, self.cfg.chunked_prefill, self.cfg.max_num_batched_tokens)
        short = self.kv_short(total)
        if short:
            raise RequestError(
                f"request {req.request_id!r}: {total} tokens need "
                + ", ".join(f"{need} blocks of KV group {g!r} (its pool has {have})" for g, (need, have) in short.items())
                + "; raise cache.kv_cache_bytes (or cache.num_blocks) or lower max_tokens")
        if req.request_id in self.requests:
            raise RequestError(f"request id {req.request_id!r} is already in use")

    def kv_short(self, total: int) -> dict[str, tuple[int, int]]:
        """KV groups whose whole pool is too small for a request of ``total`` tokens: group → (blocks it
        needs, blocks the pool has); empty when it fits an idle pool."""
        need = self.kv.max_blocks_one_step(total, self.cfg.max_num_batched_tokens)
        have = self.kv.num_blocks
        return {g: (n, have[g]) for g, n in need.items() if n > have[g]}

    def adopt(self, req: Request, num_computed: int) -> None:
        """Take ``req`` as running with positions ``[0, num_computed)`` already computed elsewhere (a
        disaggregated prefill, core/disagg): its blocks are allocated here (a sliding group's window only) for
        the caller to fill, and its next step decodes. Raises :class:`RequestError` (nothing changed) when it
        cannot run here or the pool has no room now."""
        self.check_request(req)
        if len(self.running) >= self.cfg.max_num_seqs:
            raise NoRoomNow(f"request {req.request_id!r}: scheduler.max_num_seqs={self.cfg.max_num_seqs} "
                               f"requests are running; try again after one finishes")
        if not self.kv.allocate(req.request_id, num_computed, 0):
            self.kv.free(req.request_id)
            raise NoRoomNow(f"request {req.request_id!r}: the KV pool has no room for its {num_computed} "
                               f"transferred positions now")
        req.arrival = self._arrivals
        self._arrivals += 1
        req.num_computed_tokens = num_computed
        req.status = Status.RUNNING
        self.requests[req.request_id] = req
        self.running.append(req)
        self.kv.cache_blocks(req.request_id, req.all_token_ids, num_computed)

    def add_request(self, req: Request) -> None:
        self.check_request(req)
        req.arrival = self._arrivals
        self._arrivals += 1
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def _key(self, req: Request) -> tuple[int, int]:
        return (req.priority, req.arrival) if self.priority else (0, req.arrival)

    def _push_waiting(self, req: Request, front: bool = False) -> None:
        req.status = Status.PREEMPTED if req.num_preemptions else Status.WAITING
        if not self.priority:
            (self.waiting.appendleft if front else self.waiting.append)(req)
            return
        k = self._key(req)
        i = bisect.bisect(self._wkeys, k)
        self._wkeys.insert(i, k)
        self.waiting.insert(i, req)

    def _pop_waiting(self) -> Request:
        if self.priority:
            self._wkeys.pop(0)
        return self.waiting.popleft()

    def _remove_waiting(self, req: Request) -> None:
        i = self.waiting.index(req)
        del self.waiting[i]
        if self.priority:
            del self._wkeys[i]

    def finish(self, request_ids: Iterable[str], reason: str) -> list[Request]:
        """Finish requests at any moment (``abort``, or ``stop`` for a stop string) and free their KV."""
        done = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status is Status.RUNNING:
                self.running.remove(req)
            else:
                self._remove_waiting(req)
            self._finish(req, reason)
            done.append(req)
        return done

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        return self.finish(request_ids, "abort")

    def _finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.kv.free(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.spec_token_ids = []
        self.kv.reset_blocks(req.request_id)
        req.preempted_at = req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(req, front=True)

    def _victim(self) -> Request:
        if self.priority:
            return max(self.running, key=self._key)
        return self.running[-1]

    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        budget = self.cfg.max_num_batched_tokens
        cap = self.cfg.long_prefill_token_threshold
        planned: dict[str, int] = {}  # request id -> num_new, in scheduling order
        preempted: list[str] = []
        decodes = [r for r in self.running if r.num_tokens + r.num_pending - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens + r.num_pending - r.num_computed_tokens > 1]
        decode_set = set(decodes)
        if self.num_placeholder_drafts and not (self.spec_off_at and len(self.running) >= self.spec_off_at):
            for req in decodes:
                req.spec_token_ids = [PENDING] * self._draft_room(req)
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            n = min(req.num_tokens + req.num_pending - req.num_computed_tokens, budget)
            if cap > 0:
                n = min(n, cap)
            # drafts ride along with a decode token while the budget (and the long-prefill cap) allow
            room = min(budget, cap) if cap > 0 else budget
            req.spec_token_ids = req.spec_token_ids[:room - 1] if req in decode_set else []
            n += len(req.spec_token_ids)
            ahead = self._lookahead(req, req.num_computed_tokens, n)
            # drafts in flight (placeholders) may not stand: the windows must still reach back from the lower start
            back = req.num_pending_drafts
            while not self.kv.allocate(req.request_id, req.num_computed_tokens - back, back + n + ahead):
                if ahead:  # the drafter's lookahead goes first, then the drafts
                    ahead = 0
                    continue
                if req.spec_token_ids:  # drafts are given up before anyone is preempted
                    n -= len(req.spec_token_ids)
                    req.spec_token_ids = []
                    continue
                victim = self._victim()
                if victim.request_id in planned:
                    budget += planned.pop(victim.request_id)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                planned[req.request_id] = n
                budget -= n
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
                req = self.waiting[0]
                if not self._admit(req, budget, cap, planned):
                    break
                self._pop_waiting()
                req.status = Status.RUNNING
                self.running.append(req)
                budget -= planned[req.request_id]
        seqs = []
        total = 0
        for rid, n in planned.items():
            req = self.requests[rid]
            c = req.num_computed_tokens
            drafts = tuple(req.spec_token_ids)
            known = n - len(drafts)
            ids = req.all_token_ids[c:c + known]
            ids += [PENDING] * (known - len(ids))  # the token the step in flight samples (asynchronous mode)
            blocks = self.kv.block_ids(rid)
            if self.cfg.async_scheduling:  # the tables change while this step runs: the step keeps its own
                blocks = {g: list(b) for g, b in blocks.items()}
            sample = c + known == req.num_tokens + req.num_pending
            seqs.append(ScheduledSeq(rid, c, n, ids + list(drafts), blocks, sample, drafts, req.write_from))
            req.num_computed_tokens = c + n  # rejected drafts are rolled back in update()
            req.num_pending += sample * (1 + len(drafts))  # at most: every draft accepted, plus one
            req.num_pending_drafts += sample * len(drafts)
            total += n
        micro = self.micro_batch_split([s.num_new for s in seqs]) if self.micro_batch_split else ()
        return SchedulerOutput(tuple(seqs), total, tuple(preempted), len(self.running), len(self.waiting),
                               {"schedule_s": time.perf_counter() - t0}, tuple(micro))

    def _draft_room(self, req: Request) -> int:
        """Draft placeholders for ``req``'s next decode: ``num_placeholder_drafts``, but no position past
        ``max_model_len`` even if every draft in flight stands (``num_pending`` counts them all), so the
        verifier's own token always fits. ``max_tokens`` is the runner's to apply: it knows the exact count."""
        left = self.max_model_len - req.num_tokens - req.num_pending
        return max(0, min(self.num_placeholder_drafts, left - 1))

    def _lookahead(self, req: Request, start: int, n: int) -> int:
        """Positions to allocate past a step of ``n`` tokens from ``start``: the drafter's lookahead when the
        step reaches the request's last known token (drafts follow), never past ``max_model_len``."""
        end = start + n
        if not self.num_lookahead_tokens or end - len(req.spec_token_ids) < req.num_tokens + req.num_pending:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - end))

    def _admit(self, req: Request, budget: int, cap: int, planned: dict[str, int]) -> bool:
        hit = self.kv.find_prefix_hit(req.request_id, req.all_token_ids, req.extra_keys, self.span)
        if self.trim_prefix_hit and hit.num_tokens:  # the drafter's entry at the hit's last position read
            hit = self.kv.find_prefix_hit(req.request_id, req.all_token_ids[:hit.num_tokens], req.extra_keys,
                                          self.span)  # a token the new request may not share
        start = hit.start
        replayed, write_from = 0, 0
        if hit.replay_from is not None:  # a hybrid model: cached full/compressed KV, windows rebuilt from start
            write_from = hit.num_tokens
            replayed = write_from - start
        elif req.num_preemptions and self.span is not None and self._all_sliding:
            rs = replay_start(req.preempted_at, self.span)
            if rs > start:
                start, hit, replayed = rs, None, req.preempted_at - rs
        n = req.num_tokens - start
        if not self.cfg.chunked_prefill and n > budget:
            return False
        n = min(n, budget)
        if cap > 0:
            n = min(n, cap)
        ahead = self._lookahead(req, start, n)
        if not self.kv.allocate(req.request_id, start, n + ahead, hit) and (
                not ahead or not self.kv.allocate(req.request_id, start, n, hit)):
            return False
        if not req.num_preemptions:
            req.num_cached_tokens = start
        req.write_from = write_from
        if replayed:  # KV below the resume point is rebuilt only where the window reads it: never cached
            exact = self.cfg.sliding_replay == "exact"
            upto = write_from or req.preempted_at
            self.kv.skip_caching_below(req.request_id, -(-upto // self.kv.block_size) if exact else 1 << 62)
        req.num_replayed_tokens += replayed
        req.num_computed_tokens = start
        planned[req.request_id] = n
        return True

    def update(self, out: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]],
               drafts: Optional[Mapping[str, Sequence[int]]] = None,
               dead_ends: Optional[Mapping[str, int]] = None) -> list[Request]:
        """Apply one executed step (``sampled``: a token per sampled request, or for one with drafts its accepted
        drafts plus one; ``drafts``: the drafts the runner put in place of a step's placeholders, by request;
        ``dead_ends``: requests whose grammar allowed no token, at which of their emitted tokens), ending each
        request where :attr:`stop` says; → the requests that received tokens, finished ones included."""
        dead_ends = dead_ends or {}
        changed = []
        finished = False
        for seq in out.seqs:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue  # finished or aborted while the step ran
            running = req.status is Status.RUNNING  # else preempted while the step ran (asynchronous mode)
            if running:
                req.spec_token_ids = []
            if seq.sample:
                req.num_pending -= 1 + len(seq.spec_token_ids)
                req.num_pending_drafts -= len(seq.spec_token_ids)
                got = sampled[seq.request_id]
                toks = [int(t) for t in got] if isinstance(got, (list, tuple)) else [int(got)]
                accepted = len(toks) - 1  # drafts that matched; the last token is the verifier's own
                used = list(seq.spec_token_ids)
                if PENDING in used:  # placeholders: the runner says which drafts (at most that many) it verified
                    used = list((drafts or {}).get(seq.request_id, ()))
                    if len(used) > len(seq.spec_token_ids):
                        raise ValueError(f"request {seq.request_id!r}: {len(used)} drafts in "
                                         f"{len(seq.spec_token_ids)} placeholders")
                if accepted > len(used) or used[:accepted] != toks[:accepted]:
                    raise ValueError(f"request {seq.request_id!r}: tokens {toks} are not an accepted prefix of the "
                                     f"drafts {used} plus one")
                if running:  # the placeholders (or drafts) that did not stand
                    req.num_computed_tokens -= len(seq.spec_token_ids) - accepted
                self._count_drafts(req, len(used), accepted)
                changed.append(req)
                reason = None
                for i, tok in enumerate(toks):
                    req.all_token_ids.append(tok)
                    reason = self.stop.reason(req, dead=dead_ends.get(seq.request_id) == i)
                    if reason:
                        break
                if reason:
                    self.requests.pop(req.request_id)
                    if not running:
                        self._remove_waiting(req)
                    self._finish(req, reason)
                    finished = True
                    continue
            if running:  # (asynchronous mode: num_computed may count a step in flight; it runs before any reader)
                self.kv.cache_blocks(req.request_id, req.all_token_ids, min(req.num_computed_tokens, req.num_tokens))
        if finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return changed

    def _count_drafts(self, req: Request, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted
