"""One DP rank's front end under ``inferhal serve`` (``parallel.dp > 1``): :class:`~.dp_engine.DPEngine` with
the serving placement (:mod:`.dp_balance`, ``parallel.dp_balance``) and the rank's own counters.

The server's front process hands every rank the same new requests in the same order (core/server/dp_rank.py);
at the next step the ranks all-gather a header per rank (the number of new requests and a checksum of them,
its :class:`~.dp_balance.TokenLoad`, and per new request the leading prompt blocks its prefix cache holds: an
exact look-up in its pools, nothing allocated) and all run :func:`~.dp_balance.place` on it. A request
checked here and placed on another rank is discarded here.

:meth:`ServeDPEngine.gauges` is what the front shows per rank in ``/metrics`` (``dp_rank`` label): running,
waiting, KV use, its load in tokens, and counters over its own finished requests (prompt tokens, prefix-cache
hits, generated tokens) and its scheduler (preemptions, drafts).
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import torch

from inferhal.core.paging.hashing import extend_block_hashes
from inferhal.core.parallel.dp_balance import TokenLoad, place
from inferhal.core.parallel.dp_engine import DPEngine, DPRank, _same_len
from inferhal.core.parallel.sync import RankDivergenceError, collective, gather_objects


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
        self.counts = {"prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0, "finished": 0,
                       "prefix_placed": 0, "attn_tokens": 0}

    def abort(self, request_ids: Sequence[str]) -> list[Any]:
        outs = super().abort(request_ids)
        for rid in request_ids:
            self.owner.pop(rid, None)
        return outs

    def step(self) -> list[Any]:
        """Place new requests, run this rank's step and return every rank's outputs of the step."""
        if self.pending:
            self._place()
        mine = self.engine.step()
        self.counts["attn_tokens"] += int(self.engine.last_step.get("num_tokens", 0))
        for o in mine:
            self.counts["generation_tokens"] += len(o.new_token_ids)
            if o.finished:
                self.counts["finished"] += 1
                self.counts["prompt_tokens"] += len(o.prompt_token_ids)
                self.counts["cached_tokens"] += int(o.num_cached_tokens)
        got = [o for outs_r in gather_objects(self.comm, mine, f"the outputs of step {self.rank.step}") for o in outs_r]
        for o in got:
            if o.finished:
                self.owner.pop(o.request_id, None)
        return got

    def _place(self) -> None:
        eng, comm = self.engine, self.comm
        n, me = comm.layout.world_size, comm.layout.rank
        bs = eng.kv_manager.block_size
        hashes = [extend_block_hashes([], r.prompt_token_ids, bs, tuple(r.extra_keys)) for r in self.pending]
        cached = [self._cached_blocks(h, r.num_prompt_tokens) for h, r in zip(hashes, self.pending)]
        crc = zlib.crc32(repr([(r.request_id, r.prompt_token_ids) for r in self.pending]).encode())
        ld = token_load(eng)
        mine = torch.tensor([len(self.pending), crc, ld.waiting, ld.running, ld.prefill_tokens, ld.kv_tokens, *cached],
                            dtype=torch.long)
        got = [mine] if n == 1 else collective(comm, "placing new requests", comm.all_gather, mine) \
            if _same_len(comm, mine) else None
        if got is None or any(int(g[1]) != crc for g in got):
            raise RankDivergenceError(f"DP rank {me}: the ranks were handed different new requests")
        loads = [TokenLoad(*(int(v) for v in g[2:6])) for g in got]
        blocks = [[int(v) for v in g[6:]] for g in got]
        ranks = place(self.policy, loads, blocks, hashes, [r.num_prompt_tokens for r in self.pending], self.margin,
                      self.num_placed)
        self.num_placed += len(ranks)
        for i, (req, r) in enumerate(zip(self.pending, ranks)):
            self.owner[req.request_id] = r
            if r == me:
                self.counts["prefix_placed"] += int(blocks[r][i] > 0)
                eng.add(req)
            else:
                eng.discard(req.request_id)  # made here only to be checked: it runs on another rank
        self.placements.append(ranks)
        self.pending = []

    def gauges(self) -> dict:
        """This rank's state for the front's ``/metrics`` and ``/health`` (plain data)."""
        eng = self.engine
        s, kv = eng.scheduler, eng.kv_manager
        free = kv.num_free_blocks()
        ld = token_load(eng)
        return {"running": ld.running, "waiting": ld.waiting, "prefill_tokens": ld.prefill_tokens,
                "kv_tokens": ld.kv_tokens, "kv_usage": float(kv.usage()),
                "kv_blocks": int(sum(nb - free[g] for g, nb in kv.num_blocks.items())), "kv_requests": len(kv.reqs),
                "preemptions": int(s.num_preemptions), "drafts": int(s.num_draft_tokens),
                "accepted": int(s.num_accepted_tokens), "steps": int(self.rank.step), **self.counts}
