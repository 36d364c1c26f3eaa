"""The MTP drafter's forward as a graph of its own (#46 item 3): after a uniform target step, the MTP layer's
prefill and its ``k - 1`` chained steps run as one function of fixed-shape tensors that reads nothing on the
host, captured once per (bucket, ``q``, ``k``) through the backend's graph runner, as the decode graphs of
core/engine/graphs.py are.

The eager drafter (:class:`~inferhal.core.spec.mtp.MtpProposer`) sizes its batches from values it read: the
prefill runs over each request's *exact* positions (its accepted drafts plus one, a different count per
request), its last row's draft is read with ``.tolist()``, and each chained step runs only the requests whose
``limit`` and allocated blocks allow one more draft. Here every one of those sizes comes from the host's plan
before the replay (the accepted counts are the verifier's tokens, already on the host):

- the prefill runs over all ``q`` positions of every sequence of the step (``[b * q]`` rows: a uniform step
  computed ``q`` tokens a sequence), with the slots of the rows past the exact ones -1, so it writes exactly the
  KV entries the eager prefill writes; rows attend causally, so an exact row's output is the eager one's;
- the row each draft starts from (the last exact one of each sequence) is an index tensor gathered on the device;
- every chained step runs all ``b`` sequences; where the eager drafter would have stopped (``limit``, or a
  position in no allocated block) the position repeats the last one it computed with its slot -1 (it reads only
  allocated blocks and writes nothing), and the host drops those drafts;
- each draft feeds the next step on the device (the argmax of the MTP head), and the graph returns the
  ``[b, k]`` drafts, which the host reads once, after the replay (as it reads the sampler's tokens).

Padding sequences up to the bucket repeat the first sequence's inputs with every slot -1. Taken only when the
drafter's plan is uniform: every running request of the step computed ``q`` tokens (``q`` one of the decode
graphs' widths), decodes next and wants drafts, and a bucket holds them; else the eager drafter runs.

Under DP attention (``decode.peers``, core/parallel/dp_graphs.py) the MTP layer's MoE exchange joins every rank,
so after a graph step (every rank left its forward together) the ranks vote on the draft graph too
(:meth:`~inferhal.core.parallel.dp_graphs.GraphPeers.agree_draft`): a rank whose plan holds votes its sequences,
a rank with none 0, any other rank eager (then every rank drafts eagerly, its MoE in rounds). Agreed, every rank
replays the (bucket of the largest, ``q``, ``k``) graph; a rank with no drafts to make replays a padding-only
one (one sequence of ``q`` rows reading block 0 and writing nothing, its hidden states zero), and a failed
capture raises (its peers exchange at the graph's shapes). After a step that was eager somewhere the ranks may
still be in the step's MoE rounds, so the drafts are eager on every rank. With
asynchronous scheduling the step thread calls it right after a step with the next step's wants
(core/engine/runner.py: ``ModelRunner._next_wants``), where the eager drafter proposes at the next step's start.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Sequence

import torch

from inferhal.core.errors import GraphCaptureWarning
from inferhal.core.models.base import ForwardBatch
from inferhal.core.ops.params import AttnBatch
from inferhal.core.paging.batch import token_slots
from inferhal.core.paging.kv_manager import blocks_needed
from inferhal.core.spec.mtp import _DrafterKV
from inferhal.core.spec.proposer import DraftWant, TargetStep

log = logging.getLogger(__name__)


class MtpDraftGraphs:
    """Draft graphs of one :class:`~inferhal.core.spec.mtp.MtpProposer` beside the engine's
    :class:`~inferhal.core.engine.graphs.DecodeGraphs` ``decode`` (its graph runner, buckets and widths)."""

    def __init__(self, proposer: Any, decode: Any, max_model_len: int) -> None:
        self.prop, self.decode = proposer, decode
        self.width = max(1, blocks_needed(proposer.group, proposer.block_size, max_model_len))
        self._replays: dict[tuple[int, int, int], Callable[..., Any]] = {}  # (bucket, q, k) -> replay
        self.disabled: str | None = None  # why draft graphs are off (a capture failed)
        self.num_captures = 0
        self.num_replays = 0

    # ------------------------------------------------------------------ the host's plan

    def usable(self) -> bool:
        """Whether any drafting call may replay: no capture failed (under DP attention a failed capture raises)."""
        return not self.disabled and not self.decode.disabled

    def plan(self, step: TargetStep, wants: Sequence[DraftWant] | None) -> tuple[int, list[int]] | None:
        """``(q, drafts kept per sequence)`` when this drafting call can replay, else None (eager). Host data
        only: the step's rows and exact counts, the wants' limits and each request's allocated blocks."""
        d = self.decode
        if (not self.usable() or not wants or step.hidden is None
                or len(wants) != len(step.seqs) or d.bucket(len(step.seqs)) is None):
            return None
        q = step.seqs[0].num_rows
        if q not in d.widths:
            return None
        bs, k, keep = self.prop.block_size, self.prop.k, []
        for s, w in zip(step.seqs, wants):
            if (w.request_id != s.request_id or s.num_rows != q or not 0 < s.num_exact <= q
                    or s.start + s.num_exact != len(s.token_ids) - 1):
                return None
            table, last = s.block_ids[self.prop.group.name], s.start + s.num_exact - 1  # c' - 1
            if len(table) > self.width and (last + k - 1) // bs >= self.width:  # a position past the table
                return None
            n = 1 if w.limit > 0 else 0
            while 0 < n < min(k, w.limit) and self.prop._allocated(table, last + n):
                n += 1
            keep.append(n)
        return q, keep

    def inputs(self, step: TargetStep, q: int, keep: Sequence[int], size: int) -> list[torch.Tensor]:
        """The replay's tensors at the bucket's shapes (``size`` sequences, ``q`` rows each, ``k - 1`` chained
        steps), built on the host (the hidden states gathered on the device by a host-made index)."""
        prop = self.prop
        dev = prop.device
        g, bs, k = prop.group, prop.block_size, prop.k
        ids, pos, lens, tables, slots, last, rows = [], [], [], [], [], [], []
        cpos, clens, cslots = [[] for _ in range(k - 1)], [[] for _ in range(k - 1)], [[] for _ in range(k - 1)]
        for i, (s, n) in enumerate(zip(step.seqs, keep)):
            table = list(s.block_ids[g.name])[: self.width]
            after = list(s.token_ids[s.start + 1: s.start + q + 1])
            ids += after + [after[-1]] * (q - len(after))  # past the exact rows: any token (their slots are -1)
            pos += range(s.start, s.start + q)
            lens.append(s.start + q)
            tables.append(table + [-1] * (self.width - len(table)))
            slots += token_slots(g, bs, table, range(s.start, s.start + s.num_exact)) + [-1] * (q - s.num_exact)
            last.append(i * q + s.num_exact - 1)
            rows += range(s.row, s.row + q)
            c = s.start + s.num_exact - 1  # c' - 1: chained step j drafts from position c' - 1 + j
            for j in range(1, k):
                p = c + min(j, max(n - 1, 0))  # where the eager drafter stopped: its last position again
                cpos[j - 1].append(p)
                clens[j - 1].append(p + 1)
                cslots[j - 1] += token_slots(g, bs, table, [p]) if j < n else [-1]
        pad, first = size - len(keep), step.seqs[0]
        ids += ids[:q] * pad
        pos += pos[:q] * pad
        lens += lens[:1] * pad
        tables += tables[:1] * pad
        slots += [-1] * (q * pad)
        last += [i * q + first.num_exact - 1 for i in range(len(keep), size)]
        rows += rows[:q] * pad
        for j in range(k - 1):
            cpos[j] += cpos[j][:1] * pad
            clens[j] += clens[j][:1] * pad
            cslots[j] += [-1] * pad

        def t(x, dtype=torch.long):
            return torch.tensor(x, dtype=dtype, device=dev)

        hidden = step.hidden[t(rows).to(step.hidden.device)]  # [size * q, N, D]
        chain = (k - 1, size)  # [k - 1, size]: chained step j's row j - 1
        return [t(ids), hidden, t(list(range(0, q * size + 1, q)), torch.int32), t(pos), t(lens, torch.int32),
                t(tables, torch.int32), t(slots), t(last), t(cpos).view(chain), t(clens, torch.int32).view(chain),
                t(cslots).view(chain)]

    # ------------------------------------------------------------------ the graph

    def step_fn(self) -> Callable[..., torch.Tensor]:
        """The drafting call as a function of the :meth:`inputs` tensors → drafts ``[size, k]`` int64: no host
        read, every shape fixed by the bucket, ``q`` and ``k``."""
        prop = self.prop
        model, kv, k, ratio = prop.model, _DrafterKV(self.decode.kv), prop.k, prop.group.tokens_per_slot
        top = prop.num_mtp_layers - 1

        def draft(ids, hidden, qsl, pos, lens, table, slots, last, cpos, clens, cslots):
            size = lens.shape[0]
            none = torch.empty(0, dtype=torch.long, device=ids.device)
            batch = ForwardBatch(ids, pos, qsl, {"swa": AttnBatch(qsl, lens, pos, table, slots, ratio)}, none)
            h = model.mtp_hidden(batch, kv, hidden, 0)[last]  # [size, N, D]: each sequence's last exact row
            tok = model.mtp_head(h, 0)  # [size] draft 1
            out, one = [tok], torch.arange(size + 1, dtype=qsl.dtype, device=ids.device)
            for j in range(1, k):
                layer = min(j, top)
                p = cpos[j - 1]
                step = ForwardBatch(tok, p, one, {"swa": AttnBatch(one, clens[j - 1], p, table, cslots[j - 1], ratio)},
                                    none)
                h = model.mtp_hidden(step, kv, h, layer)
                tok = model.mtp_head(h, layer)
                out.append(tok)
            return torch.stack(out, 1)

        return draft

    def draft(self, step: TargetStep, wants: Sequence[DraftWant] | None) -> dict[str, list[int]] | None:
        """The prefill and the drafts of this call from a replay, or None (run the eager drafter). Under DP
        attention a collective after a graph step (the module docstring)."""
        planned, peers = self.plan(step, wants), self.decode.peers
        if peers is None:
            if planned is None:
                return None
            q, keep = planned
            size = self.decode.bucket(len(keep))
        else:
            if not peers.stepped:  # eager somewhere: a rank may still be in the step's MoE rounds
                return None
            rows = len(planned[1]) if planned is not None else 0 if not step.seqs else None
            agreed = peers.agree_draft(rows, planned[0] if planned is not None else 1, self.prop.k)
            if agreed is None:
                return None
            size, q = agreed
            if planned is None:  # nothing to draft here: a padding-only replay, so the exchanges match the peers'
                self._replay(size, q, self.padding_inputs(size, q))
                return {}
            keep = planned[1]
        drafts = self._replay(size, q, self.inputs(step, q, keep, size))
        if drafts is None:
            return None
        return {s.request_id: d[:n] for s, d, n in zip(step.seqs, drafts[: len(keep)].tolist(), keep) if n}

    def padding_inputs(self, size: int, q: int) -> list[torch.Tensor]:
        """:meth:`inputs` of ``size`` copies of one sequence of ``q`` rows at positions ``0 .. q-1`` that reads
        block 0 (as each block its positions reach) and writes nothing, its hidden states zero: what a DP rank
        with no drafts to make replays."""
        prop = self.prop
        dev, k, cfg = prop.device, prop.k, prop.model.cfg

        def full(shape, value, dtype=torch.long):
            return torch.full(shape, value, dtype=dtype, device=dev)

        table = full((size, self.width), -1, torch.int32)
        table[:, : -(-q // prop.block_size)] = 0
        chain = (k - 1, size)
        return [full((size * q,), 0), torch.zeros(size * q, cfg.hc_mult, cfg.hidden_size, dtype=prop.model.dtype,
                                                      device=dev),
                torch.arange(0, q * size + 1, q, dtype=torch.int32, device=dev), torch.arange(q, device=dev).repeat(size),
                full((size,), q, torch.int32), table, full((size * q,), -1),
                torch.arange(q - 1, q * size, q, device=dev), full(chain, q - 1), full(chain, q, torch.int32),
                full(chain, -1)]

    def _replay(self, size: int, q: int, args: list[torch.Tensor]) -> torch.Tensor | None:
        """The ``[size, k]`` drafts of one replay (captured first if new), or None where the capture failed
        (alone: eager from now on, said once; under DP attention it raises)."""
        key = (size, q, self.prop.k)
        peers = self.decode.peers
        replay = self._replays.get(key)
        if replay is None:
            try:
                replay = self.decode.graph_runner.capture(self.step_fn(), *args)
            except Exception as exc:  # noqa: BLE001 - any capture failure: eager drafts from now on, said once
                self.disabled = f"capturing a {size}-sequence MTP draft step of {q} rows a sequence failed: " \
                                f"{type(exc).__name__}: {exc}"
                if peers is not None:
                    peers.done()
                    raise RuntimeError(f"backend.graphs: {self.disabled}; a DP rank cannot draft eagerly while its "
                                       f"peers exchange at the graph's shapes: set backend.graphs=false") from exc
                log.warning("MTP draft graphs off for this engine: %s", self.disabled)
                warnings.warn(f"backend.graphs: MTP draft graphs off for this engine, drafts run eagerly: "
                              f"{self.disabled}", GraphCaptureWarning, stacklevel=3)
                return None
            self._replays[key] = replay
            self.num_captures += 1
        try:
            drafts = replay(*args)
        finally:
            if peers is not None:  # the rest of the step exchanges in rounds
                peers.done()
        self.num_replays += 1
        return drafts
