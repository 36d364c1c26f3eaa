"""One DP rank's front end under ``inferhal serve`` (``parallel.dp > 1``): :class:`~.dp_engine.DPEngine` with
the serving placement (:mod:`.dp_balance`, ``parallel.dp_balance``) and the rank's own counters.

The server's front process hands every rank the same new requests in the same order (core/server/dp_rank.py);
at the next step the ranks all-gather, as :class:`~.dp_engine.DPEngine` does, a checksum of the new requests,
each rank's :class:`~.dp_balance.TokenLoad` and, per new request, the leading prompt blocks its prefix cache
holds (an exact look-up in its pools, nothing allocated), and all run :func:`~.dp_balance.place` on it, with the
requests' session keys (``Request.session``) and the rank's :class:`~.dp_balance.Sessions` table, which therefore
stays equal on every rank.

:meth:`ServeDPEngine.gauges` is what the front shows per rank in ``/metrics`` (``dp_rank`` label): running,
waiting, KV use, its load in tokens, and counters over its own requests (prompt tokens and prefix-cache hits of
the finished ones, generated tokens, attention tokens, requests placed on it for a prefix it held), its
scheduler (preemptions, drafts) and, with EPLB (``eplb=default``), the rows it routed to each physical expert
slot over EPLB's window (``expert_rows[layer][slot]``), from which the front sums the load each rank's experts
carry.
"""

from __future__ import annotations

from typing import Any

from inferhal.core.parallel.dp_balance import Sessions, TokenLoad, place
from inferhal.core.parallel.dp_engine import DPEngine, DPRank


def token_load(engine: Any) -> TokenLoad:
    """This rank's load: its queue and batch, prompt tokens not computed yet, tokens with KV computed."""
    s = engine.scheduler
    reqs = [*s.waiting, *s.running]
    prefill = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in reqs)
    return TokenLoad(len(s.waiting), len(s.running), prefill, sum(r.num_computed_tokens for r in s.running))


class ServeDPEngine(DPEngine):
    """A DP rank's front end placing by ``policy`` (:data:`~.dp_balance.POLICIES`) with ``margin`` tokens
    (``tokens_cache``). ``placements`` (per placement, the rank of each request) as in :class:`DPEngine`."""

    def __init__(self, engine: Any, rank: DPRank, policy: str = "tokens_cache", margin: int = 2048) -> None:
        super().__init__(engine, rank)
        self.policy, self.margin = policy, int(margin)
        self.num_placed = 0  # requests placed over the server's life (round_robin's position)
        self.sessions = Sessions()  # session key -> its rank (tokens_cache), alike on every rank
        self.counts = {"prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0, "finished": 0,
                       "prefix_placed": 0, "session_placed": 0, "attn_tokens": 0}

    def _stepped(self, outs: list[Any]) -> None:
        c = self.counts
        c["attn_tokens"] += int(self.engine.last_step.get("num_tokens", 0))
        for o in outs:
            c["generation_tokens"] += len(o.new_token_ids)
            if o.finished:
                c["finished"] += 1
                c["prompt_tokens"] += len(o.prompt_token_ids)
                c["cached_tokens"] += int(o.num_cached_tokens)

    def _load(self) -> list[int]:
        ld = token_load(self.engine)
        return [ld.waiting, ld.running, ld.prefill_tokens, ld.kv_tokens]

    def _choose(self, loads: list[list[int]], cached: list[list[int]], hashes: list[list[bytes]]) -> list[int]:
        keys = [r.session for r in self.pending]
        known = [self.sessions.get(k) if k else None for k in keys]  # each key's rank before this placement
        ranks = place(self.policy, [TokenLoad(*ld) for ld in loads], cached, hashes,
                      [r.num_prompt_tokens for r in self.pending], self.margin, self.num_placed,
                      keys=keys, sessions=self.sessions)
        self.num_placed += len(ranks)
        me = self.comm.layout.rank
        self.counts["prefix_placed"] += sum(1 for i, r in enumerate(ranks) if r == me and cached[r][i] > 0)
        self.counts["session_placed"] += sum(1 for r, was in zip(ranks, known) if r == me and was == r)
        return ranks

    def gauges(self) -> dict:
        """This rank's state for the front's ``/metrics`` and ``/health`` (plain data)."""
        eng = self.engine
        s, kv = eng.scheduler, eng.kv_manager
        free = kv.num_free_blocks()
        ld = token_load(eng)
        g = {"running": ld.running, "waiting": ld.waiting, "prefill_tokens": ld.prefill_tokens,
             "kv_tokens": ld.kv_tokens, "kv_usage": float(kv.usage()),
             "kv_blocks": int(sum(nb - free[g] for g, nb in kv.num_blocks.items())), "kv_requests": len(kv.reqs),
             "preemptions": int(s.num_preemptions), "drafts": int(s.num_draft_tokens),
             "accepted": int(s.num_accepted_tokens), "steps": int(self.rank.step), **self.counts}
        ctl = self.rank.controller
        if ctl is not None:  # EPLB: the rows this rank routed to each physical expert slot over the window, [L][R]
            g["expert_rows"] = ctl.recorder.local_load().tolist()
        return g
