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

**Two-batch overlap** (``tbo``, ``parallel.tbo=true``; :mod:`.tbo`): a rank whose step the scheduler split
in two micro-batches runs its forward through :meth:`DPExperts.run_two`, and announces it in the header's
fifth integer (``split``). A pass that some rank at its first layer announced split is a **split pass**:
every MoE layer of it is two exchanges on every rank, in one order everywhere: dispatch A, dispatch B,
combine A, combine B. A split rank brings its micro-batches (A's dispatch travels while B computes its
attention, A's experts run while B's dispatch travels, A's combine while B's experts run, B's combine
while A computes the next layer); a rank of the pass that did not split brings its batch as A and an
empty B; every other rank serves both empty. The exchanges run on the communicator's communication thread
(``run_async``, FIFO, so the order holds), and every one is waited for before the forward returns, so the
headers and every other collective stay on the caller's thread, never interleaved with them. Passes
nobody split, and rounds outside a pass (MTP layers), run as one exchange each, as without overlap.

**Graph steps** (``backend.graphs=true``, :mod:`.dp_graphs`): the ranks agree before a decode step on one
bucket and tokens a sequence ``q``, every rank's forward has ``bucket x q`` token rows (an idle rank's all
padding), and :meth:`DPExperts.graph_step` sets ``graph_calls``, the token rows of each MoE call of the coming
forward (the main stack's: ``bucket x q`` at each of ``pass_layers``): each call is then one exchange of its rows
without a header, through a dispatch that reads nothing on the host (the backend's padded exchange while a graph
is captured, its capacity rows x top_k the same on every rank), until :meth:`DPExperts.graph_done` after the
forward. An MTP draft graph after such a step (core/spec/mtp_graph.py) is a second graph forward of the step:
its prefill's ``bucket x q`` rows, then ``bucket`` rows for each chained draft. A drafter's MoE calls outside a
draft graph run in rounds. A replayed forward runs no Python, so the step's counters are set at its end from
those rows: a round per call, the rank's own rows, and the padded exchange's bytes (``ranks - 1`` blocks of
``rows x top_k`` rows each way); no timing.

Timing (per step, in :class:`MoeTraffic`): ``a2a_s``, the seconds the exchanges' collectives ran
(``moe.dispatch`` and ``moe.combine``, on whichever thread; on gloo this includes waiting for the peers),
and ``wait_s``, the seconds the forward's thread spent in them or waiting for them. Without overlap the two
are equal; with it ``a2a_s - wait_s`` is the collective time hidden behind compute.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generator, Optional, Sequence

import torch

from inferhal.core.eplb.placement import Placement
from inferhal.core.ops.params import ExpertsParams
from inferhal.core.parallel.ep_moe import EPExperts, to_physical
from inferhal.core.parallel.sync import RankDivergenceError, collective
from inferhal.core.parallel.tbo import empty_rows, interleave, submit


@dataclass
class MoeTraffic:
    """One rank's MoE work and traffic in one step."""

    rounds: int = 0  # MoE exchanges this rank took part in (one per layer call; two per layer of a split pass)
    empty_rounds: int = 0  # of which with no token of its own
    headers: int = 0  # round headers all-gathered (rounds of a planned pass need none, the step's end does)
    token_rows: int = 0  # (token, layer) rows it routed
    dispatch_bytes: int = 0  # payload it sent to other ranks in moe.dispatch
    combine_bytes: int = 0  # payload it sent back to other ranks in moe.combine
    split_passes: int = 0  # passes run as two micro-batches (two-batch overlap), on every rank
    a2a_s: float = 0.0  # seconds in moe.dispatch / moe.combine collectives (on the communication thread with tbo)
    wait_s: float = 0.0  # seconds the forward's thread spent in them or waiting for them (= a2a_s without tbo)
    graph_rows: int = 0  # a graph step's token rows, bucket x q (every rank's; counters from it, not timed); 0: eager
    draft_graph_rows: int = 0  # its MTP draft graph's rows, bucket x q then bucket per chained draft, summed; 0: none

    @property
    def a2a_bytes(self) -> int:
        return self.dispatch_bytes + self.combine_bytes


class DPExperts(EPExperts):
    """One DP/EP rank's routed experts: the model calls it with this rank's tokens only (see the module
    docstring for the round protocol). The arguments of :class:`EPExperts`, plus the activations' ``dtype``
    and ``device`` (a rank with no tokens sends empty rows of the same kind as its peers' rows), the
    model's ``pass_layers`` (empty: a header every round) and ``tbo`` (two-batch overlap: the exchanges
    run on the communicator's thread, and :meth:`run_two` takes a forward split in two)."""

    def __init__(self, ops: Any, comm: Any, placement: Placement, full_weights: Sequence[tuple[Any, Any]],
                 experts_p: ExpertsParams, dtype: torch.dtype, device: torch.device | str = "cpu",
                 recorder: Optional[Any] = None, pass_layers: Sequence[int] = (), tbo: bool = False):
        super().__init__(ops, comm, placement, full_weights, experts_p, recorder)
        self.traffic = MoeTraffic()
        self.dtype, self.device = dtype, torch.device(device)
        self.pass_layers = tuple(int(l) for l in pass_layers)
        self.tbo = bool(tbo)
        self._dim = int(full_weights[0][1].shape[1])  # down: [E, D, I]
        self._top_k = 1  # of the empty rows (any will do: they go nowhere)
        self._pass: list[int] = []  # the layers left of the pass this rank brings tokens to
        self._split = False  # that pass is split: each layer is two exchanges (ours as A, an empty B)
        self._inflight: list[Future] = []  # exchanges submitted and not waited for yet
        # inside a graph forward (dp_graphs): the token rows of each of its MoE calls on every rank, in order (a
        # device runner's warm-up runs before its capture repeat them: the calls cycle), and the next call's index
        self.graph_calls: tuple[int, ...] = ()
        self._graph_at = 0
        self._graph_k = 0  # top_k, as its capture saw it
        # the step's graph forwards, counted at its end: (rows, this rank's own rows) of each MoE call
        self._graph_steps: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    @property
    def two_batch(self) -> bool:
        """Whether the model may run a forward split in two micro-batches through :meth:`run_two`."""
        return self.tbo and bool(self.pass_layers)

    def __call__(self, layer: int, x: torch.Tensor, weights: torch.Tensor, logical_ids: torch.Tensor) -> torch.Tensor:
        # x: [T, D] this rank's tokens, weights: [T, K] fp32, logical_ids: [T, K] -> y: [T, D] routed experts
        if self.graph_calls:  # a graph forward: every rank at the same rows, no header
            return self._graph_layer(layer, x, weights, logical_ids)
        if self._pass:  # inside a planned pass: no header, the layer is known
            want = self._pass.pop(0)
            if layer != want:
                self._pass, self._split = [], False
                raise RankDivergenceError(f"rank {self.comm.layout.rank}: MoE layer {layer} called inside a pass "
                                          f"whose next layer is {want} (the model does not follow pass_layers)")
            return self._layer(layer, x, weights, logical_ids)
        while True:
            chosen, split, _ = self._round(layer)
            starts = self._starts_pass(chosen)
            if chosen == layer:
                self._pass = list(self.pass_layers[1:]) if starts else []
                self._split = starts and split
                self.traffic.split_passes += int(self._split)
                return self._layer(layer, x, weights, logical_ids)
            self._serve(chosen, starts, split)  # another rank's layer first; ours in a later round

    def _layer(self, layer: int, x: torch.Tensor, weights: torch.Tensor, logical_ids: torch.Tensor) -> torch.Tensor:
        """This rank's batch through one layer: one exchange, or in a split pass as micro-batch A beside an
        empty B."""
        if not self._split:
            return self._settled([self._steps(layer, x, weights, logical_ids)])[0]
        self._split = bool(self._pass)  # the pass's last layer ends it
        return self._settled([self._steps(layer, x, weights, logical_ids), self._empty_steps(layer)])[0]

    def graph_step(self, rows: Sequence[int], own: Sequence[int]) -> None:
        """The coming forward is a graph forward whose MoE calls have ``rows[i]`` token rows on every rank,
        ``own[i]`` of them this rank's (:mod:`.dp_graphs`, before it); :meth:`graph_done` ends it, :meth:`drain`
        counts it with the step."""
        if not rows or len(rows) != len(own):
            raise ValueError(f"a graph forward's MoE calls: rows {list(rows)}, own rows {list(own)}")
        self.graph_calls, self._graph_at = tuple(int(r) for r in rows), 0
        self._graph_steps.append((self.graph_calls, tuple(int(o) for o in own)))

    def graph_done(self) -> None:
        """The graph forward has ended: later MoE calls of the step run in rounds (or in the next graph forward)."""
        self.graph_calls, self._graph_at = (), 0

    def _graph_layer(self, layer: int, x: torch.Tensor, weights: torch.Tensor,
                     logical_ids: torch.Tensor) -> torch.Tensor:
        """One MoE call of a graph forward: one exchange of its rows, nothing read or counted on the host."""
        t, k = logical_ids.shape
        want = self.graph_calls[self._graph_at % len(self.graph_calls)]
        self._graph_at += 1
        if t != want or x.dtype != self.dtype:
            raise RankDivergenceError(f"rank {self.comm.layout.rank}: MoE layer {layer} got {t} rows of {x.dtype} in "
                                      f"a graph forward whose call has {want} rows of {self.dtype} on every rank")
        self._graph_k = int(k)
        p = self.placement
        phys = to_physical(logical_ids, p.log2phy[layer], p.logcnt[layer], torch.arange(t, device=x.device))
        return self.through_experts(layer, x, weights, phys)

    def _count_graph_steps(self) -> None:
        """The step's graph forwards' counters, from their rows (their exchanges were the padded layout's; see
        the module docstring)."""
        tr, n = self.traffic, int(self.comm.layout.world_size)
        es = torch.empty((), dtype=self.dtype).element_size()
        for i, (rows, own) in enumerate(self._graph_steps):
            if i == 0:
                tr.graph_rows = rows[0]
            else:
                tr.draft_graph_rows += sum(rows)
            sent = (n - 1) * sum(rows) * self._graph_k  # rows this rank sent to other ranks, each way
            tr.rounds += len(rows)
            tr.empty_rounds += sum(1 for o in own if not o)
            tr.token_rows += sum(own)
            tr.dispatch_bytes += sent * (self._dim * es + 8)
            tr.combine_bytes += sent * self._dim * es
        self._graph_steps = []

    def run_two(self, a: Generator, b: Generator, offset_b: int) -> list[Any]:
        """A forward of the pass layers split in two micro-batches, with overlap. ``a`` and ``b`` are the
        model's generators of the micro-batches' forwards: each yields ``(layer, x[T, D], weights[T, K],
        logical_ids[T, K])`` at every MoE layer, receives the routed experts' ``y[T, D]`` and returns its
        result (e.g. the final streams); ``offset_b`` is B's first row in the step (A's rows), so each token
        picks the expert replica it would in one batch. → ``[a's result, b's result]``."""
        if self._pass:
            left, self._pass, self._split = self._pass, [], False
            raise RankDivergenceError(f"rank {self.comm.layout.rank}: a split forward started inside a pass with "
                                      f"MoE layers {left} left (the model does not follow pass_layers)")
        return self._settled([self._micro(a, 0, lead=True), self._micro(b, int(offset_b), lead=False)])

    def _micro(self, gen: Generator, offset: int, lead: bool) -> Generator:
        """One micro-batch's forward as a task of :func:`~.tbo.interleave`: it yields while its exchanges
        travel. The lead (A) opens the split pass with a header round before its first dispatch."""
        me, last = self.comm.layout.rank, len(self.pass_layers) - 1
        req = next(gen)
        for i, want in enumerate(self.pass_layers):
            layer, x, weights, ids = req
            if layer != want:
                raise RankDivergenceError(f"rank {me}: MoE layer {layer} called inside a split pass whose next "
                                          f"layer is {want} (the model does not follow pass_layers)")
            if lead and i == 0:
                self._open_split_pass(layer)
            y = yield from self._steps(layer, x, weights, ids, offset)
            try:
                req = gen.send(y)
            except StopIteration as stop:
                if i != last:
                    raise RankDivergenceError(f"rank {me}: a split forward ended with MoE layers "
                                              f"{list(self.pass_layers[i + 1:])} left") from None
                return stop.value
        raise RankDivergenceError(f"rank {me}: a split forward called MoE layer {req[0]} after its pass's last layer")

    def _open_split_pass(self, layer: int) -> None:
        """Announce ``layer`` with ``split`` set; serve the rounds chosen before it."""
        while True:
            chosen, split, _ = self._round(layer, split=True)
            starts = self._starts_pass(chosen)
            if chosen == layer:
                self.traffic.split_passes += 1
                return
            self._serve(chosen, starts, split)

    def _starts_pass(self, layer: Optional[int]) -> bool:
        return bool(self.pass_layers) and layer == self.pass_layers[0]

    def _serve(self, layer: int, starts: bool, split: bool = False) -> None:
        """Join the round of ``layer`` empty, and the rest of its pass when it starts one (two empty
        micro-batches a layer when the pass is split)."""
        both = starts and split
        self.traffic.split_passes += int(both)
        for nxt in [layer, *(self.pass_layers[1:] if starts else ())]:
            self._settled([self._empty_steps(nxt), self._empty_steps(nxt)] if both else [self._empty_steps(nxt)])

    def drain(self, step: int, unfinished: bool) -> bool:
        """End this rank's step: join every round the others still need, with no tokens, until all ranks
        are idle. Raises :class:`RankDivergenceError` when the ranks' step counters differ. Returns whether
        any rank still has unfinished requests."""
        if self._pass:
            left, self._pass, self._split = self._pass, [], False
            raise RankDivergenceError(f"rank {self.comm.layout.rank}: step {step} ended inside a pass with MoE "
                                      f"layers {left} left (the model does not follow pass_layers)")
        if self._graph_steps:
            self._count_graph_steps()
            self.graph_calls, self._graph_at = (), 0
        while True:
            chosen, split, got = self._round(None, step, unfinished)
            if chosen is None:
                break
            self._serve(chosen, self._starts_pass(chosen), split)
        steps = [int(g[2]) for g in got]
        if len(set(steps)) > 1:
            detail = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
            raise RankDivergenceError(f"DP ranks diverged in step count ({detail})")
        return any(int(g[3]) for g in got)

    def shrink(self, placement: Placement) -> None:
        """:meth:`EPExperts.shrink`, and whatever the torn step left is dropped (its pass, its counters)."""
        super().shrink(placement)
        self._pass, self._split, self._inflight, self._graph_steps = [], False, [], []
        self.graph_calls, self._graph_at = (), 0
        self.traffic = MoeTraffic()

    def end_step(self) -> MoeTraffic:
        """This step's counters; the next step starts from zero."""
        t, self.traffic = self.traffic, MoeTraffic()
        return t

    # ------------------------------------------------------------------ rounds

    def _round(self, layer: Optional[int], step: int = 0, unfinished: bool = False,
               split: bool = False) -> tuple[Optional[int], bool, list]:
        """All-gather the headers; → (the layer this round runs, or None when every rank is idle; whether
        a rank at that layer split its forward; the headers)."""
        mine = torch.tensor([int(layer is not None), -1 if layer is None else layer, step, int(unfinished),
                             int(split)], dtype=torch.long)
        self.traffic.headers += 1
        if self.comm.layout.world_size == 1:
            got = [mine]
        else:
            where = f"MoE layer {layer}" if layer is not None else f"the end of step {step}"
            got = collective(self.comm, where, self.comm.all_gather, mine)
        active = [int(g[1]) for g in got if int(g[0])]
        if not active:
            return None, False, got
        chosen = active[0]
        return chosen, any(int(g[4]) for g in got if int(g[0]) and int(g[1]) == chosen), got

    # ------------------------------------------------------------------ exchanges

    def _settled(self, tasks: list[Generator]) -> list[Any]:
        """Run exchange tasks interleaved (one alone: just in order); whatever fails, nothing of theirs is
        left in flight on the communication thread."""
        try:
            return interleave(tasks)
        except BaseException:
            for fut in self._inflight:
                try:
                    fut.result()
                except BaseException:
                    pass
            self._inflight = []
            raise

    def _empty_steps(self, layer: int) -> Generator:
        return self._steps(layer, *empty_rows(self._dim, self._top_k, self.dtype, self.device))

    def _submit(self, where: str, fn: Any, *args: Any) -> Future:
        """A collective op: on the communicator's thread with ``tbo`` (timed there), else at once."""
        tr, comm = self.traffic, self.comm
        overlap = self.tbo and hasattr(comm, "run_async")

        def timed():
            t0 = time.perf_counter()
            try:
                return collective(comm, where, fn, *args)
            finally:
                dt = time.perf_counter() - t0
                tr.a2a_s += dt
                if not overlap:  # ran on the forward's thread
                    tr.wait_s += dt

        fut = submit(comm if overlap else None, timed)
        self._inflight.append(fut)
        return fut

    def _wait(self, fut: Future) -> Any:
        t0 = time.perf_counter()
        try:
            return fut.result()
        finally:
            self.traffic.wait_s += time.perf_counter() - t0
            self._inflight.remove(fut)

    def _steps(self, layer: int, x: torch.Tensor, weights: torch.Tensor, logical_ids: torch.Tensor,
               offset: int = 0) -> Generator:
        """One exchange of ``layer`` as a task: dispatch, yield, experts, combine, yield → ``y[T, D]``.
        ``offset``: the first row's index in the step (the replica choice of :func:`to_physical`)."""
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
            idx = torch.arange(offset, offset + t, device=x.device)
            phys = to_physical(logical_ids, p.log2phy[layer], p.logcnt[layer], idx)  # [T, K]
            if self.recorder is not None:
                self.recorder.record(layer, phys)
            xs, ws = x, weights
            tr.token_rows += t
        dest = phys[phys >= 0] // self.ep_p.slots_per_rank
        local_rows = int((dest == me).sum())
        es = xs.element_size()
        tr.dispatch_bytes += (int(dest.numel()) - local_rows) * (self._dim * es + 8)
        fut = self._submit(f"MoE layer {layer} (dispatch)", ops["moe.dispatch"], xs, phys, comm, self.ep_p)
        yield
        sent = self._wait(fut)
        tr.combine_bytes += (int(sent.x.shape[0]) - local_rows) * self._dim * es
        gu, down = self.local[layer]
        ones = torch.ones((sent.x.shape[0], 1), dtype=torch.float32, device=xs.device)
        y_local = ops["moe.experts"](sent.x, ones, sent.local_ids[:, None], gu, down, self.experts_p)
        fut = self._submit(f"MoE layer {layer} (combine)", ops["moe.combine"], y_local, ws, sent.handle, comm,
                           self.ep_p)
        yield
        return self._wait(fut)[:t]
