"""The MTP drafter: a model's own multi-token-prediction layers (DeepSeek's ``nextn``) propose the next
``k`` tokens, greedily.

MTP layer ``m`` at position ``p`` reads the target's final hidden state at ``p`` and the token at
``p + 1`` and predicts the token at ``p + 2``. So after a target step that computed positions
``[c, c')`` exactly (its accepted tokens), :meth:`MtpProposer.prefill` runs MTP layer 0 over the same
positions with the next tokens (all known by then, the one just sampled included); its last row, at
``c' - 1``, drafts the token at ``c' + 1``. :meth:`MtpProposer.propose` chains: draft ``j + 1`` comes from
position ``c' - 1 + j`` fed the draft ``j`` and the MTP layer's own output streams at the position
before; it uses MTP layer ``min(j, L - 1)``, so with one layer (DeepSeek-V4) that layer runs again on
its own output, as DeepSeek decodes with ``nextn=3``.

KV: the MTP layers' window attention lives in a paged group of its own, ``mtp`` (sliding, the target's
window), in the engine's one KV manager, so it is allocated, freed, prefix-cached and preempted with
the request. Its exact part always covers the target's computed tokens (the engine prefills every
step); chained positions past it are written speculatively into the scheduler's lookahead blocks
(``num_lookahead_tokens = k - 1``) and simply written again by the next prefill: that is the roll back
to the accepted length. Because position ``p``'s entry depends on token ``p + 1``, a prefix hit gives up
its last block (``reads_next_token``), as vLLM does for EAGLE.

Models with several MTP layers: layers past 0 run only in chained steps, so their window holds what
those steps wrote (vLLM's behaviour too); drafts stay exact to verify, only acceptance can suffer.
Drafts are the MTP head's argmax (``q`` one-hot), which the rejection sampler (``spec.verify``) verifies
exactly for greedy and sampled requests alike.

With ``backend.graphs=true`` (synchronous or asynchronous scheduling, one process or DP ranks) the engine calls
:meth:`MtpProposer.prefill_and_propose`, which replays the prefill and the drafts as one fixed-shape graph after
a uniform step (:attr:`MtpProposer.graphs`, core/spec/mtp_graph.py) and runs this eager code otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from inferhal.core.config.schema import SpecConfig
from inferhal.core.errors import UserError
from inferhal.core.models.base import ForwardBatch
from inferhal.core.paging.batch import SeqSlice, build_attn_batches
from inferhal.core.paging.spec import KVGroupSpec
from inferhal.core.spec.proposer import DraftContext, DraftWant, TargetStep

GROUP = "mtp"
MAX_K = 3  # DeepSeek's decode drafts nextn=3; more would only chain the last layer further


class _DrafterKV:
    """The KV storage as an MTP layer's attention reads it: its window group under the name ``swa``."""

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    def layer_cache(self, group: str, layer: int) -> torch.Tensor:
        return self.kv.layer_cache(GROUP if group == "swa" else group, layer)


class MtpProposer:
    needs_hidden = True
    reads_next_token = True

    def __init__(self, model: Any, k: int, block_size: int, device: Any) -> None:
        self.model, self.k, self.block_size, self.device = model, k, block_size, torch.device(device)
        self.num_mtp_layers = int(model.num_mtp_layers)
        swa = next(g for g in model.kv_groups() if g.name == "swa")
        n = model.cfg.num_layers
        self.group = dataclasses.replace(swa, name=GROUP, layers=tuple(range(n, n + self.num_mtp_layers)))
        self._first: dict[str, tuple[int, torch.Tensor]] = {}  # request → (draft 1, MTP streams at c' - 1)
        self.graphs: Any = None  # core/spec/mtp_graph.MtpDraftGraphs (backend.graphs=true)

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    @property
    def num_lookahead_tokens(self) -> int:
        return self.k - 1

    @staticmethod
    def check_config(cfg: SpecConfig) -> None:
        if not 1 <= cfg.num_speculative_tokens <= MAX_K:
            raise UserError(f"spec.num_speculative_tokens must be in 1..{MAX_K} for spec.method=mtp, "
                            f"got {cfg.num_speculative_tokens}")

    @classmethod
    def from_config(cls, cfg: SpecConfig, ctx: DraftContext) -> "MtpProposer":
        cls.check_config(cfg)
        model = ctx.model
        if not hasattr(model, "mtp_hidden"):
            raise UserError(f"spec.method=mtp: model {ctx.model_name!r} has no MTP draft layers (its family has "
                            f"none); use spec.method=ngram or spec.method=none")
        if int(getattr(model, "num_mtp_layers", 0)) < 1:
            want = getattr(getattr(model, "cfg", None), "num_mtp", 0)
            what = (f"its config declares {want} MTP layer(s) but the checkpoint has no mtp.* weights "
                    f"(e.g. mtp.0.e_proj.weight)" if want else "its config declares no MTP layers "
                    f"(num_nextn_predict_layers=0) and it has no mtp.* weights")
            raise UserError(f"spec.method=mtp: model {ctx.model_name!r} has no MTP weights: {what}; use "
                            f"spec.method=ngram or spec.method=none")
        return cls(model, cfg.num_speculative_tokens, ctx.block_size, ctx.device)

    # ------------------------------------------------------------------ the proposer contract

    def kv_groups(self) -> list[KVGroupSpec]:
        return [self.group]

    def accept(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Nothing to undo: the next :meth:`prefill` rewrites the rejected positions' entries."""

    def free(self, request_id: str) -> None:
        self._first.pop(request_id, None)

    def prefill(self, step: TargetStep) -> None:
        """MTP layer 0 over every request's exact positions of the step; draft 1 for those that decode next."""
        self._first.clear()
        seqs = [s for s in step.seqs if s.num_exact > 0]
        if not seqs:
            return
        ids: list[int] = []
        rows: list[torch.Tensor] = []
        last: list[int] = []  # rows (of this batch) whose next token is the request's next to compute
        last_req: list[str] = []
        for s in seqs:
            ids.extend(s.token_ids[s.start + 1: s.start + s.num_exact + 1])  # the token after each position
            rows.append(torch.arange(s.row, s.row + s.num_exact))
            if s.start + s.num_exact == len(s.token_ids) - 1:
                last.append(len(ids) - 1)
                last_req.append(s.request_id)
        slices = [SeqSlice(s.start, s.num_exact, {GROUP: s.block_ids[GROUP]}) for s in seqs]
        hidden = step.hidden[torch.cat(rows).to(step.hidden.device)]
        streams = self._run(slices, ids, hidden, 0, step.kv)
        if last:
            tail = streams[torch.tensor(last, device=streams.device)]
            toks = self.model.mtp_head(tail, 0).tolist()
            for rid, tok, h in zip(last_req, toks, tail):
                self._first[rid] = (int(tok), h)

    def prefill_and_propose(self, step: TargetStep, wants: Sequence[DraftWant] | None,
                            kv: Any = None) -> dict[str, list[int]]:
        """:meth:`prefill` then :meth:`propose` (``wants`` None: drafting paused, the prefill alone): one replay
        of a draft graph where :attr:`graphs` takes the call (core/spec/mtp_graph.py), else eagerly."""
        got = None if self.graphs is None else self.graphs.draft(step, wants)
        if got is not None:
            self._first.clear()
            return got
        self.prefill(step)
        return {} if wants is None else self.propose(wants, kv)

    def propose(self, wants: Sequence[DraftWant], kv: Any = None) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        hid: dict[str, torch.Tensor] = {}
        for w in wants:
            if w.limit > 0 and w.request_id in self._first:
                tok, h = self._first[w.request_id]
                out[w.request_id], hid[w.request_id] = [tok], h
        limits = {w.request_id: min(self.k, w.limit) for w in wants}
        tables = {w.request_id: w.block_ids[GROUP] for w in wants}
        ctx = {w.request_id: len(w.token_ids) - 1 for w in wants}  # c': the target's computed tokens
        for j in range(1, self.k):
            go = [r for r in out if len(out[r]) == j and limits[r] > j and self._allocated(tables[r], ctx[r] - 1 + j)]
            if not go:
                break
            slices = [SeqSlice(ctx[r] - 1 + j, 1, {GROUP: tables[r]}) for r in go]
            streams = self._run(slices, [out[r][-1] for r in go], torch.stack([hid[r] for r in go]),
                                min(j, self.num_mtp_layers - 1), kv)
            toks = self.model.mtp_head(streams, min(j, self.num_mtp_layers - 1)).tolist()
            for r, tok, h in zip(go, toks, streams):
                out[r].append(int(tok))
                hid[r] = h
        self._first.clear()
        return out

    # ------------------------------------------------------------------ pieces

    def _allocated(self, table: Sequence[int], pos: int) -> bool:
        b = pos // self.block_size
        return b < len(table) and table[b] >= 0

    def _run(self, slices: Sequence[SeqSlice], ids: Sequence[int], hidden: torch.Tensor, layer: int, kv: Any):
        """MTP layer ``layer`` over ``slices`` (token ``ids[t]`` follows position ``t``): its output streams."""
        positions, qsl, attn = build_attn_batches([self.group], self.block_size, slices, self.device)
        batch = ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.long, device=self.device), positions=positions,
                             query_start_loc=qsl, attn={"swa": attn[GROUP]},
                             logits_indices=torch.empty(0, dtype=torch.long, device=self.device), seqs=tuple(slices))
        return self.model.mtp_hidden(batch, _DrafterKV(kv), hidden, layer)
