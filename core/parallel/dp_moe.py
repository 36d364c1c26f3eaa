"""Routed experts under DP attention × EP MoE: each rank brings only its own tokens.

Under data-parallel attention every rank runs its own batch, so ranks reach a MoE layer with different
token counts, and some with none. One call of a MoE layer on the ranks is a **round**:

1. every rank all-gathers a small header ``[active, layer, step, unfinished]``: an *active* rank is inside
   a forward at ``layer``; an idle one has finished its step's forwards (or had none);
2. when some rank is active, the round runs the layer announced by the lowest active rank: the ranks at
   that layer send their own tokens through ``moe.dispatch`` (sized per step: only the rows routed to
   each rank travel), every rank runs its local expert slots of that layer on what it received
   (``moe.experts``), and ``moe.combine`` brings the results home; every other rank joins the same
   all-to-alls with an empty batch, so nobody hangs;
3. an active rank whose layer was not chosen joins with an empty batch and announces again; an idle rank
   keeps joining rounds (:meth:`DPExperts.drain`) until a round finds every rank idle, which ends the step
   for all of them together and compares their step counters.

Ranks inside the same forward pass reach the same layers in the same order, so normally every round
serves every active rank; the lowest-rank rule only matters when ranks run different numbers of passes
in a step (one rank's extra pass is served while the others drain), and it always makes progress.

**Pass plan** (``pass_layers``, the MoE layers a model's forward calls, in order, once each: layers
``0 .. L-1`` of DeepSeek-V4's main stack): a round that runs ``pass_layers[0]`` starts a pass, so every
rank knows the next ``len(pass_layers) - 1`` rounds without a header; the ranks that brought tokens to
the first layer bring them to the rest, every other rank joins those rounds empty. One header per forward
instead of one per layer. A rank of the pass whose next call is another layer, or that ends its step
mid-pass, broke the model's side of the plan and raises (its peers then fail at their next exchange).

Counters (per step, reset by :meth:`DPExperts.end_step`): rounds, rounds this rank joined empty, headers
exchanged, token rows it routed, and the all-to-all payload bytes it sent: dispatch rows to other ranks (``D`` values
plus one int64 slot id each) and combine rows returned to other ranks (``D`` values each); rows a rank
sends to itself and the small size exchanges are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from inferhal.core.eplb.placement import Placement
from inferhal.core.ops.params import ExpertsParams
from inferhal.core.parallel.ep_moe import EPExperts, to_physical
from inferhal.core.parallel.sync import RankDivergenceError, collective


@dataclass
class MoeTraffic:
    """One rank's MoE work and traffic in one step."""

    rounds: int = 0  # MoE layer calls this rank took part in
    empty_rounds: int = 0  # of which with no token of its own
    headers: int = 0  # round headers all-gathered (rounds of a planned pass need none, the step's end does)
    token_rows: int = 0  # (token, layer) rows it routed
    dispatch_bytes: int = 0  # payload it sent to other ranks in moe.dispatch
    combine_bytes: int = 0  # payload it sent back to other ranks in moe.combine

    @property
    def a2a_bytes(self) -> int:
        return self.dispatch_bytes + self.combine_bytes


class DPExperts(EPExperts):
    """One DP/EP rank's routed experts: the model calls it with this rank's tokens only (see the module
    docstring for the round protocol). The arguments of :class:`EPExperts`, plus the activations' ``dtype``
    and ``device`` (a rank with no tokens sends empty rows of the same kind as its peers' rows) and the
    model's ``pass_layers`` (empty: a header every round)."""

    def __init__(self, ops: Any, comm: Any, placement: Placement, full_weights: Sequence[tuple[Any, Any]],
                 experts_p: ExpertsParams, dtype: torch.dtype, device: torch.device | str = "cpu",
                 recorder: Optional[Any] = None, pass_layers: Sequence[int] = ()):
        super().__init__(ops, comm, placement, full_weights, experts_p, recorder)
        self.traffic = MoeTraffic()
        self.dtype, self.device = dtype, torch.device(device)
        self.pass_layers = tuple(int(l) for l in pass_layers)
        self._dim = int(full_weights[0][1].shape[1])  # down: [E, D, I]
        self._top_k = 1  # of the empty rows (any will do: they go nowhere)
        self._pass: list[int] = []  # the layers left of the pass this rank brings tokens to

    def __call__(self, layer: int, x: torch.Tensor, weights: torch.Tensor, logical_ids: torch.Tensor) -> torch.Tensor:
        # x: [T, D] this rank's tokens, weights: [T, K] fp32, logical_ids: [T, K] -> y: [T, D] routed experts
        if self._pass:  # inside a planned pass: no header, the layer is known
            want = self._pass.pop(0)
            if layer != want:
                self._pass = []
                raise RankDivergenceError(f"rank {self.comm.layout.rank}: MoE layer {layer} called inside a pass "
                                          f"whose next layer is {want} (the model does not follow pass_layers)")
            return self._exchange(layer, x, weights, logical_ids)
        while True:
            chosen, _ = self._round(layer)
            starts = self._starts_pass(chosen)
            if chosen == layer:
                self._pass = list(self.pass_layers[1:]) if starts else []
                return self._exchange(layer, x, weights, logical_ids)
            self._serve(chosen, starts)  # another rank's layer first; ours in a later round

    def _starts_pass(self, layer: Optional[int]) -> bool:
        return bool(self.pass_layers) and layer == self.pass_layers[0]

    def _serve(self, layer: int, starts: bool) -> None:
        """Join the round of ``layer`` empty, and the rest of its pass when it starts one."""
        self._exchange_empty(layer)
        if starts:
            for nxt in self.pass_layers[1:]:
                self._exchange_empty(nxt)

    def drain(self, step: int, unfinished: bool) -> bool:
        """End this rank's step: join every round the others still need, with no tokens, until all ranks
        are idle. Raises :class:`RankDivergenceError` when the ranks' step counters differ. Returns whether
        any rank still has unfinished requests."""
        if self._pass:
            left, self._pass = self._pass, []
            raise RankDivergenceError(f"rank {self.comm.layout.rank}: step {step} ended inside a pass with MoE "
                                      f"layers {left} left (the model does not follow pass_layers)")
        while True:
            chosen, got = self._round(None, step, unfinished)
            if chosen is None:
                break
            self._serve(chosen, self._starts_pass(chosen))
        steps = [int(g[2]) for g in got]
        if len(set(steps)) > 1:
            detail = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
            raise RankDivergenceError(f"DP ranks diverged in step count ({detail})")
        return any(int(g[3]) for g in got)

    def end_step(self) -> MoeTraffic:
        """This step's counters; the next step starts from zero."""
        t, self.traffic = self.traffic, MoeTraffic()
        return t

    # ------------------------------------------------------------------ rounds

    def _round(self, layer: Optional[int], step: int = 0, unfinished: bool = False) -> tuple[Optional[int], list]:
        """All-gather the headers; → (the layer this round runs, or None when every rank is idle; headers)."""
        mine = torch.tensor([int(layer is not None), -1 if layer is None else layer, step, int(unfinished)],
                            dtype=torch.long)
        self.traffic.headers += 1
        if self.comm.layout.world_size == 1:
            got = [mine]
        else:
            where = f"MoE layer {layer}" if layer is not None else f"the end of step {step}"
            got = collective(self.comm, where, self.comm.all_gather, mine)
        active = [int(g[1]) for g in got if int(g[0])]
        return (active[0] if active else None), got

    def _exchange_empty(self, layer: int) -> None:
        dev, k = self.device, self._top_k
        self._exchange(layer, torch.zeros((0, self._dim), dtype=self.dtype, device=dev),
                       torch.zeros((0, k), dtype=torch.float32, device=dev),
                       torch.zeros((0, k), dtype=torch.long, device=dev))

    def _exchange(self, layer: int, x: torch.Tensor, weights: torch.Tensor, logical_ids: torch.Tensor) -> torch.Tensor:
        ops, comm, p = self.ops, self.comm, self.placement
        me = comm.layout.rank
        t, k = logical_ids.shape
        tr = self.traffic
        tr.rounds += 1
        if t == 0:
            tr.empty_rounds += 1
            # one row that goes nowhere: every backend's dispatch/combine sees a non-empty batch
            xs, ws = x.new_zeros((1, self._dim)), weights.new_zeros((1, k))
            phys = torch.full((1, k), -1, dtype=torch.long, device=x.device)
        else:
            if x.dtype != self.dtype:  # every rank's rows must have one dtype (the all-to-all buffers do)
                raise ValueError(f"DPExperts: MoE input of dtype {x.dtype}, but the ranks exchange {self.dtype}")
            idx = torch.arange(t, device=x.device)
            phys = to_physical(logical_ids, p.log2phy[layer], p.logcnt[layer], idx)  # [T, K]
            if self.recorder is not None:
                self.recorder.record(layer, phys)
            xs, ws = x, weights
            tr.token_rows += t
        dest = phys[phys >= 0] // self.ep_p.slots_per_rank
        local_rows = int((dest == me).sum())
        es = xs.element_size()
        tr.dispatch_bytes += (int(dest.numel()) - local_rows) * (self._dim * es + 8)
        sent = collective(comm, f"MoE layer {layer} (dispatch)", ops["moe.dispatch"], xs, phys, comm, self.ep_p)
        tr.combine_bytes += (int(sent.x.shape[0]) - local_rows) * self._dim * es
        gu, down = self.local[layer]
        ones = torch.ones((sent.x.shape[0], 1), dtype=torch.float32, device=xs.device)
        y_local = ops["moe.experts"](sent.x, ones, sent.local_ids[:, None], gu, down, self.experts_p)
        y = collective(comm, f"MoE layer {layer} (combine)", ops["moe.combine"], y_local, ws, sent.handle, comm,
                       self.ep_p)
        return y[:t]
