"""Decode graphs under DP attention × EP MoE (``backend.graphs=true`` with ``parallel.dp > 1``): every rank
replays the same bucket in the same step.

Each DP rank runs its own batch, but every MoE layer's all-to-all joins all ranks, and a captured step's
exchange is a padded one (a ``moe.dispatch`` that reads nothing on the host: a device backend's EP ops pick
it while a graph is being captured, DeepEP's low-latency layout): one equal-split all-to-all whose blocks hold
``capacity = rows x top_k`` rows, so every rank must dispatch as many rows. As vLLM's and SGLang's DP attention
do, every rank pads its decode step to the bucket of the largest batch across the ranks:

1. before its forward, outside the step, each rank all-gathers a vote ``[state, rows, greedy, q]`` over the
   communicator the MoE round headers use (:meth:`GraphPeers.agree`): ``state`` 1 with its sequences ``rows``
   when its step is eligible (:meth:`~inferhal.core.engine.graphs.DecodeGraphs.uniform`: every sequence
   computes the same ``q`` tokens, a plain decode ``q = 1`` or a speculative verification step ``q = 1 + k``,
   a bucket holds them), 0 when it scheduled nothing, 2 when its forward is not eligible (a prompt chunk,
   sequences with different draft counts, graphs off after a failed capture); ``greedy`` when it wants tokens,
   not logits;
2. any 2, or eligible ranks with different ``q`` (one rank verifies drafts while another runs a plain
   decode, or fewer drafts): no rank replays, every rank runs its step eagerly (:mod:`.dp_moe`'s rounds);
   every rank idle: nothing runs; otherwise every rank takes the eligible ranks' ``q`` and the smallest bucket
   that holds the largest rows, and the greedy graph only when every rank's step is greedy (else the logits
   graph, whose greedy rows the sampler takes): every rank then uses each (bucket, ``q``, kind) graph first in
   the same step, so the exchanges of a device runner's warm-up before its capture match across the ranks too;
3. a rank that scheduled nothing runs a padding-only step through that graph (one sequence of ``q`` tokens
   that reads block 0 and writes nothing, copied to the bucket:
   :meth:`~inferhal.core.engine.graphs.DecodeGraphs.idle`), so its exchanges are the same program as its peers';
4. :meth:`~.dp_moe.DPExperts.graph_step` tells the expert runner: each MoE layer of the step's forward is one
   exchange of the bucket's ``bucket x q`` token rows without a header; :meth:`GraphPeers.done` ends that
   after the forward; its counters are set at the step's end;
5. with an MTP drafter, after a graph step (and only then: every rank has left the step's exchanges, none is
   still in rounds) the ranks vote again, on the draft graph (:meth:`GraphPeers.agree_draft`,
   core/spec/mtp_graph.py): eligible with the sequences whose drafts a replay computes, idle, or eager; the same
   rules pick one (bucket, ``q``) for all, a rank with no drafts to make replays a padding-only draft through it,
   and the draft forward's MoE calls (the prefill's ``bucket x q`` rows, then ``bucket`` rows for each chained
   draft) exchange without headers too. When the vote finds no graph, every rank drafts eagerly and the MTP
   layer's MoE runs in rounds.

The capacity needs no argument: every rank dispatches the bucket's token rows (its own and the padding sequences'
copies), so the dispatch's default capacity, rows x top_k, is the same on every rank; it holds every routed pair
even if all go to one rank. A failed capture raises on that rank (it cannot run the step eagerly while its peers
exchange at the bucket's shapes); its peers then fail at their next exchange, as at any rank's error.

Graph steps run as one batch: with ``parallel.tbo=true`` the eager steps (prompt chunks) split in two
micro-batches, the replayed decode steps do not. ``eplb`` is refused with graphs (its recorder reads each MoE
layer's routing on the host: :func:`check_graphs`).
"""

from __future__ import annotations

from typing import Any

import torch

from inferhal.core.errors import UserError
from inferhal.core.parallel.sync import collective

#: a rank's vote: its step is eligible (with its rows), it scheduled nothing, its forward is not eligible
ELIGIBLE, IDLE, EAGER = 1, 0, 2


def check_graphs(graphs_on: bool, eplb_on: bool) -> None:
    """Refuse what a captured decode step under EP cannot hold, naming the fields."""
    if graphs_on and eplb_on:
        raise UserError("backend.graphs=true with eplb.enabled=true under expert parallelism: EPLB's load recorder "
                        "reads each MoE layer's routing on the host (core/eplb/recorder.py), which a captured decode "
                        "step cannot; set backend.graphs=false or eplb=none")


class GraphPeers:
    """The ranks' agreement on each step's bucket (the module docstring); ``graphs.peers`` of every DP rank.
    ``log``: per agreed graph step, every rank's rows (0: padding only), the bucket, whether greedy and ``q``;
    ``draft_log`` the same for the MTP draft graphs."""

    def __init__(self, comm: Any, graphs: Any, experts: Any) -> None:
        if not experts.pass_layers:
            raise UserError("backend.graphs=true under parallel.dp > 1 needs a model whose forward calls its MoE "
                            "layers in a fixed order (pass_layers, e.g. DeepSeek-V4); set backend.graphs=false")
        self.comm, self.graphs, self.experts = comm, graphs, experts
        self.log: list[tuple[list[int], int, bool, int]] = []
        self.draft_log: list[tuple[list[int], int, int]] = []  # per draft graph replay: rows, bucket, q
        self.stepped = False  # the last agree() chose a graph: every rank ran this step's forward as one

    def agree(self, rows: int | None, greedy: bool, q: int = 1) -> tuple[int, bool, int] | None:
        """This rank's vote (``rows``: the sequences of an eligible step of ``q`` tokens each, 0 for an idle
        rank, None for a step that is not eligible; ``greedy``: its step wants tokens, not logits) →
        ``(bucket, greedy, q)`` of the graph every rank replays this step, or None (all eager). Collective,
        once per step on every rank; :attr:`stepped` says afterwards whether the step is a graph step."""
        got = self._vote(rows, greedy, q, "the graph bucket of a step")
        self.stepped = got is not None
        if got is None:
            return None
        counts, size, both, width = got
        layers = len(self.experts.pass_layers)
        self.experts.graph_step([size * width] * layers, [(rows or 0) * width] * layers)
        self.log.append((counts, size, both, width))
        return size, both, width

    def agree_draft(self, rows: int | None, q: int, k: int) -> tuple[int, int] | None:
        """After a graph step (:attr:`stepped`, so every rank has left its forward's exchanges), the MTP draft
        graph's vote (core/spec/mtp_graph.py): ``rows`` the sequences whose drafts a replay computes (each of
        ``q`` rows in the step), 0 for a rank with none, None for one that drafts eagerly → ``(bucket, q)`` of the
        draft graph every rank replays (an idle rank a padding-only one), or None (every rank drafts eagerly,
        its MTP layer's MoE in rounds). Its forward's MoE calls: the prefill's ``bucket x q`` rows, then
        ``bucket`` rows for each of the ``k - 1`` chained drafts. Collective."""
        if not self.stepped:
            raise RuntimeError("a draft graph's vote after a step that was not a graph step on every rank")
        got = self._vote(rows, True, q, "the MTP draft graph of a step")
        if got is None:
            return None
        counts, size, _, width = got
        own = rows or 0
        self.experts.graph_step([size * width] + [size] * (k - 1), [own * width] + [own] * (k - 1))
        self.draft_log.append((counts, size, width))
        return size, width

    def _vote(self, rows: int | None, greedy: bool, q: int, what: str
              ) -> tuple[list[int], int, bool, int] | None:
        """All-gather ``[state, rows, greedy, q]`` → (every rank's rows, bucket, greedy for all, q) or None."""
        state = EAGER if rows is None else ELIGIBLE if rows else IDLE
        mine = torch.tensor([state, rows or 0, int(greedy), q if rows else 0], dtype=torch.long)
        got = [mine] if self.comm.layout.world_size == 1 else collective(self.comm, what, self.comm.all_gather, mine)
        states, counts = [int(g[0]) for g in got], [int(g[1]) for g in got]
        qs = {int(g[3]) for g in got if int(g[0]) == ELIGIBLE}
        if EAGER in states or len(qs) != 1:  # not eligible somewhere, nobody eligible, or different q
            return None
        (width,) = qs
        size = self.graphs.bucket(max(counts))  # the largest rows fit a bucket of its rank: the same sizes here
        both = all(int(g[2]) for g in got)  # one graph for all: a logits graph when any rank samples
        return counts, size, both, width

    def done(self) -> None:
        """The graph forward has ended (replayed or captured): the rest of the step (a drafter's MoE layers
        outside a draft graph) runs in rounds again."""
        self.experts.graph_done()
