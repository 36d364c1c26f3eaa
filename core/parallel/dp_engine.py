"""One engine as one rank of DP attention × EP MoE (``parallel.dp = parallel.ep > 1``, e.g. ``dep2``).

Each rank owns its requests, its scheduler and its KV pool: attention, norms, mHC, the shared expert and
the LM head run on its own tokens only. The routed experts are sharded over the same ranks and reached
through :class:`~.dp_moe.DPExperts` (``moe.dispatch``/``moe.combine`` all-to-all of this rank's rows,
sized per step; a rank with no work joins every exchange with an empty batch).

Pieces:

- :class:`DPRank`, the engine step hook (:func:`attach_dp` installs it): ends every step on all ranks
  together (:meth:`DPExperts.drain`: the ranks that ran no forward, or fewer MoE layers, serve the
  others' exchanges until everyone is idle; the step counters are compared there), logs this rank's
  attention tokens and MoE traffic of the step (:class:`StepLog`), and ends the EPLB step (collective;
  the recorder counts this rank's own routing, the window load is all-reduced).
- :class:`DPEngine`, the front end, with the engine's request API (``make_request``, ``add``,
  ``add_request``, ``step``, ``abort``, ``has_unfinished``), so :class:`~inferhal.core.engine.llm.LLM`
  and ``inferhal generate`` drive it unchanged. Every rank is handed the same requests in the same order;
  at the next step the ranks exchange their loads and prefix-cache hits and all place the new requests
  the same way (:func:`~.dp_frontend.place_requests`); each rank keeps its own. After each step the
  ranks' outputs are all-gathered, so every rank sees every request's output (and all stop together).

Outputs equal a single process's: each request's tokens depend only on its own rows (the ops are per
row; the experts' rows travel and come back). Sampled requests without a seed get the seed a single
process would derive from their arrival (:meth:`DPEngine.add`), so they draw the same numbers.
Refused here: ``scheduler.async_scheduling`` (its step thread would run MoE exchanges while the host
thread drains). With ``backend.graphs=true`` the ranks replay decode steps at one bucket per step
(:mod:`.dp_graphs`).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence

import torch

from inferhal.core.eplb.controller import EplbController
from inferhal.core.eplb.placement import Placement
from inferhal.core.errors import UserError
from inferhal.core.paging.hashing import extend_block_hashes
from inferhal.core.parallel.dp_frontend import RankLoad, place_requests
from inferhal.core.parallel.dp_graphs import GraphPeers, check_graphs
from inferhal.core.parallel.dp_moe import DPExperts, MoeTraffic
from inferhal.core.parallel.ep_engine import check_expert_slots, eplb_controller, rebalancer
from inferhal.core.parallel.rebalance import Rebalance, Rebalancer
from inferhal.core.parallel.sync import RankDivergenceError, collective, gather_objects
from inferhal.core.parallel.tbo import split_two

NEEDS = ("routed_expert_weights", "use_expert_runner", "experts_p", "dtype")


@dataclass
class StepLog:
    """What one rank did in one step: its own scheduled tokens (the rows its attention, norms, mHC and
    dense parts ran on), its sequences, and its MoE rounds and all-to-all bytes."""

    step: int
    attn_tokens: int
    seqs: int
    moe: MoeTraffic


@dataclass
class DPRank:
    """The per-step hook of one DP/EP rank (installed by :func:`attach_dp`)."""

    comm: Any
    runner: DPExperts
    controller: Optional[EplbController]
    step: int = 0
    busy: bool = False  # after a step: whether any rank still has unfinished requests
    log: deque = field(default_factory=lambda: deque(maxlen=100_000))  # StepLog per step
    rebalancer: Optional[Rebalancer] = None

    def __call__(self, engine: Any) -> None:
        self.step += 1
        last = engine.last_step
        self.busy = self.runner.drain(self.step, engine.has_unfinished())
        self.log.append(StepLog(self.step, int(last["num_tokens"]), int(last["num_seqs"]), self.runner.end_step()))
        if self.rebalancer is not None:
            self.rebalancer(self.step)

    @property
    def rebalances(self) -> list[Rebalance]:
        return self.rebalancer.rebalances if self.rebalancer is not None else []

    def request_rebalance(self) -> None:
        """Rebalance at the end of the next step (every rank must request it at the same step)."""
        if self.controller is None:
            raise UserError("a rebalance needs EPLB: set eplb=default (eplb.enabled=true)")
        self.controller.trigger.request()


def attach_dp(engine: Any, comm: Any, eplb: Any, tbo: bool = False) -> DPRank:
    """Make ``engine`` one DP/EP rank of ``comm`` (DP size = EP size = ``comm.layout.world_size``): build
    its :class:`DPExperts`, hand it to the model (which drops its full routed-expert tensors) and append the
    :class:`DPRank` hook to ``engine.step_hooks``. Wrap the engine in :class:`DPEngine` to feed it. With
    ``tbo`` (``parallel.tbo``) the scheduler splits each step in two micro-batches
    (:func:`~.tbo.split_two`) and the runner overlaps one's all-to-all with the other's compute."""
    model = engine.model
    if not all(hasattr(model, a) for a in NEEDS):
        raise UserError(f"model {type(model).__name__} does not support expert parallelism (parallel.ep > 1)")
    if engine.executor.asynchronous:
        raise UserError("scheduler.async_scheduling=true does not run with data-parallel attention "
                        "(parallel.dp > 1) yet; use scheduler.async_scheduling=false")
    n = int(comm.layout.world_size)
    full = model.routed_expert_weights()
    num_layers, num_experts = len(full), int(full[0][0].shape[0])
    check_expert_slots(num_experts, eplb, n)
    graphs = getattr(engine.runner, "graphs", None)  # backend.graphs=true: a bucket per step on all ranks
    check_graphs(graphs is not None, bool(eplb.enabled))
    ctl = eplb_controller(eplb, num_layers, num_experts, n)
    placement = ctl.placement if ctl is not None else Placement.identity(num_layers, num_experts)
    # a forward of the main stack calls MoE layers 0 .. L-1 in order (MTP layers L.. are passes of their own)
    main = int(model.num_moe_layers) - int(getattr(model, "num_mtp_layers", 0)) if hasattr(model, "num_moe_layers") else 0
    runner = DPExperts(engine.backend.ops, comm, placement, full, model.experts_p, model.dtype, engine.device,
                       recorder=ctl.recorder if ctl is not None else None, pass_layers=range(main), tbo=tbo)
    if graphs is not None:
        graphs.peers = GraphPeers(comm, graphs, runner)
    if tbo:
        engine.scheduler.micro_batch_split = split_two
    del full
    model.use_expert_runner(runner)
    hook = DPRank(comm, runner, ctl, rebalancer=rebalancer(ctl, runner, comm, eplb))
    engine.step_hooks.append(hook)
    return hook


class DPEngine:
    """One DP rank's engine behind the engine's request API (see the module docstring). Attributes it
    does not define (``stats``, ``tokenizer``, ``eos_token_ids``, ...) are the rank's own engine's."""

    def __init__(self, engine: Any, rank: DPRank) -> None:
        self.engine, self.rank, self.comm = engine, rank, rank.comm
        self.pending: list[Any] = []  # requests added since the last step, not placed yet (same on every rank)
        self.owner: dict[str, int] = {}  # request id -> the DP rank serving it, until it finishes
        self.placements: list[list[int]] = []  # per placement, the rank of each request (in arrival order)
        self.num_added = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    @property
    def stream_text(self) -> bool:
        return self.engine.stream_text

    @stream_text.setter
    def stream_text(self, on: bool) -> None:
        self.engine.stream_text = on

    # ------------------------------------------------------------------ requests

    def make_request(self, prompt: Any, params: Any = None, request_id: Optional[str] = None,
                     extra_keys: tuple[Hashable, ...] = ()) -> Any:
        return self.engine.make_request(prompt, params, request_id, extra_keys)

    def add_request(self, prompt: Any, params: Any = None, request_id: Optional[str] = None,
                    extra_keys: tuple[Hashable, ...] = ()) -> str:
        return self.add(self.make_request(prompt, params, request_id, extra_keys))

    def add(self, req: Any) -> str:
        """Queue ``req`` for placement at the next step (every rank must add the same requests in the same
        order). A sampled request without a seed gets the one a single process would give it."""
        p = req.params
        if p.temperature > 0 and p.seed is None and not self.engine.deterministic:
            req.params = dataclasses.replace(p, seed=self.engine.seed * 1_000_003 + self.num_added)
        self.num_added += 1
        self.pending.append(req)
        return req.request_id

    def abort(self, request_ids: Sequence[str]) -> list[Any]:
        """Abort requests on this rank (no collective: this runs on error paths too)."""
        ids = set(request_ids)
        self.pending = [r for r in self.pending if r.request_id not in ids]
        me = self.comm.layout.rank
        mine = [i for i in ids if self.owner.get(i) == me]
        for i in ids:
            self.owner.pop(i, None)
        return self.engine.abort(mine)

    def has_unfinished(self) -> bool:
        """Whether any rank has a request left (as of the last step), or new requests wait for placement."""
        return bool(self.pending) or self.rank.busy

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[Any]:
        """Place new requests, run this rank's step (its hook ends the step on all ranks together) and
        return every rank's outputs of the step."""
        if self.pending:
            self._place()
        outs = self.engine.step()
        self._stepped(outs)
        got = [o for outs_r in gather_objects(self.comm, outs, f"the outputs of step {self.rank.step}") for o in outs_r]
        for o in got:
            if o.finished:
                self.owner.pop(o.request_id, None)
        return got

    def _place(self) -> None:
        eng, comm = self.engine, self.comm
        n, me = comm.layout.world_size, comm.layout.rank
        kv = eng.kv_manager
        hashes = [extend_block_hashes([], r.prompt_token_ids, kv.block_size, tuple(r.extra_keys)) for r in self.pending]
        cached = [self._cached_blocks(h, r.num_prompt_tokens) for h, r in zip(hashes, self.pending)]
        crc = zlib.crc32(repr([(r.request_id, r.prompt_token_ids) for r in self.pending]).encode())
        load = self._load()
        mine = torch.tensor([len(self.pending), crc, *load, *cached], dtype=torch.long)
        got = [mine] if n == 1 else collective(comm, "placing new requests", comm.all_gather, mine) \
            if _same_len(comm, mine) else None
        if got is None or any(int(g[1]) != crc for g in got):
            raise RankDivergenceError(f"DP rank {me}: the ranks were handed different new requests (each rank "
                                      f"must add the same requests in the same order)")
        k = 2 + len(load)
        ranks = self._choose([[int(v) for v in g[2:k]] for g in got], [[int(v) for v in g[k:]] for g in got], hashes)
        for req, r in zip(self.pending, ranks):
            self.owner[req.request_id] = r
            if r == me:
                eng.add(req)
            else:
                eng.discard(req.request_id)  # made here only to be checked: it runs on another rank
        self.placements.append(ranks)
        self.pending = []

    def _stepped(self, outs: list[Any]) -> None:
        """This rank's own outputs of the step it just ran (before the ranks exchange them)."""

    def _load(self) -> list[int]:
        """This rank's load as integers, all-gathered at placement: waiting, running, free KV in permille."""
        sched, kv = self.engine.scheduler, self.engine.kv_manager
        return [len(sched.waiting), len(sched.running), round(1000 * (1.0 - kv.usage()))]

    def _choose(self, loads: list[list[int]], cached: list[list[int]], hashes: list[list[bytes]]) -> list[int]:
        """The rank of each new request from every rank's :meth:`_load` and ``cached[rank][request]`` leading
        prompt blocks (:func:`~.dp_frontend.place_requests`)."""
        return place_requests([RankLoad(*ld) for ld in loads], cached, hashes)

    def _cached_blocks(self, hashes: Sequence[bytes], num_prompt_tokens: int) -> int:
        """Leading prompt blocks this rank's prefix cache holds in every full/compressed KV group (a pure
        look-up: nothing is allocated or touched)."""
        kv = self.engine.kv_manager
        if not kv.enable_caching:
            return 0
        specs = [s for s in kv.specs if s.kind != "sliding"] or list(kv.specs)
        k, most = 0, min(len(hashes), (num_prompt_tokens - 1) // kv.block_size)
        while k < most and all(kv.pools[s.name].get_cached_block(s.name, hashes[k]) is not None for s in specs):
            k += 1
        return k


def _same_len(comm: Any, mine: torch.Tensor) -> bool:
    """Whether every rank brings a header of this length (the number of new requests), before the
    all-gather that needs equal lengths."""
    lens = collective(comm, "placing new requests", comm.all_gather, torch.tensor([mine.numel()], dtype=torch.long))
    return len({int(v) for v in lens}) == 1
