"""Decode steps replayed from device graphs, one capture per batch-size bucket (as vLLM's device graphs).

The backend's optional ``graph_runner`` hook (:class:`~inferhal.core.backend.GraphRunner`) captures a
callable for fixed-shape example tensors and returns a replay that copies new inputs into the captured
buffers, runs the graph and returns the captured outputs. Core names no device: a device backend returns
its graph runner; the host backends and the interpreter return none, and steps run eagerly.

A step is replayed when it is *uniform*: every sequence computes the same number ``q`` of tokens, each with a
logits row (no prompt chunk), and the batch fits the largest of ``backend.graph_batch_sizes``. ``q`` is 1 (a
plain decode) or, with a drafter (``spec.method``), ``1 + spec.num_speculative_tokens``: the last accepted
token and ``k`` drafts, verified together (vLLM's and SGLang's "uniform decode"). Decided on the host from
the step's shapes and the scheduler's plan (``ForwardBatch.seqs``), never from a device read. A step whose
sequences carry different counts (a drafter that found fewer than ``k`` drafts for one, a request whose
``max_tokens`` leaves no room for them, one sequence without drafts beside others with) runs eagerly: the
drafts are not padded to ``k``. Buckets count sequences: a ``q``-token step of bucket ``b`` holds ``q * b``
tokens. The batch is padded to the smallest bucket that holds it: each padding sequence repeats the first
sequence's ``q`` tokens, positions, lengths and block tables (so it reads only allocated blocks) with every
slot mapping -1 (so it writes no KV), and its outputs are dropped. Block tables are as wide as a
``max_model_len`` request needs, so one capture serves every context length. Each (bucket, ``q``, kind) is
captured once, on first use: the kind is the logits of every token (or, for an all-greedy plain decode, the
tokens), and with a drafter that reads the target's hidden states (MTP: ``forward_and_hidden``) the final
hidden states of every token as a second output, which the drafter reads after the step. Sampling,
verification (``spec.verify``) and bitmasks stay outside the graph; the MTP drafter's own forward (its prefill
and chained drafts) after a uniform step is a graph of its own, per (bucket, ``q``, ``k``), in one process
(core/spec/mtp_graph.py; with asynchronous scheduling the step thread makes the next step's drafts with the
prefill: core/engine/runner.py), else eager.

Nothing a captured step computes may depend on a device value read on the host, or on host data of the
capture: the step's batch carries no host plan (``ForwardBatch.seqs`` is None), so the models size their
tensors by fixed bounds (``max_model_len``) and mask on the device; ``core/engine/host_sync.py`` and its
test keep the model code free of host reads (DeepSeek-V4's compressor rows: a bound from the step's shapes,
-1 rows past the device's count). What still reads (a backend op that synchronises) makes the capture fail
rather than replay a stale size.

``backend.graphs=true`` on a backend without a graph runner is refused, naming the field. A capture that
fails turns graphs off for the engine with a :class:`GraphCaptureWarning` that says why (the reason stays in
:attr:`DecodeGraphs.disabled`), and the step runs eagerly: never silently. The test suite turns that
warning into an error (pyproject's ``filterwarnings``).

Under DP attention (``peers``, :mod:`inferhal.core.parallel.dp_graphs`) the ranks' MoE all-to-alls must have
one shape, so each step's bucket and ``q`` are agreed by every rank before the step (:meth:`DecodeGraphs.plan`,
and :meth:`DecodeGraphs.idle` on a rank that scheduled nothing: it runs a padding-only step of ``q`` tokens a
sequence through the agreed graph), and a failed capture raises instead of falling back (its peers' steps
exchange at the bucket's shapes). Ranks whose uniform steps have different ``q`` all run eagerly.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Sequence

import torch

from inferhal.core.models.base import ForwardBatch
from inferhal.core.ops.params import AttnBatch
from inferhal.core.paging.kv_manager import blocks_needed
from inferhal.core.paging.spec import KVGroupSpec
from inferhal.core.errors import GraphCaptureWarning, UserError

log = logging.getLogger(__name__)


def check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """``backend.graph_batch_sizes`` as a sorted tuple; a clear error for an empty list or a size below 1."""
    try:
        out = tuple(sorted({int(s) for s in sizes}))
    except (TypeError, ValueError):
        raise UserError(f"backend.graph_batch_sizes must be a list of positive integers, got {list(sizes)!r}") from None
    if not out or out[0] < 1:
        raise UserError(f"backend.graph_batch_sizes must be a non-empty list of integers >= 1, got {list(sizes)!r}")
    return out




def check_config(cfg: Any, runner: Any, profile: Any = None) -> tuple[int, ...] | None:
    """``backend.graphs`` and ``backend.graph_batch_sizes`` checked against the backend: the buckets with
    graphs on, None with graphs off; a clear error for true on a backend without a graph runner, or buckets set
    while graphs are off (a field that would do nothing)."""
    if not cfg.graphs:
        if list(cfg.graph_batch_sizes) != list(type(cfg)().graph_batch_sizes):
            raise UserError("backend.graph_batch_sizes is read only with backend.graphs=true")
        return None
    sizes = check_sizes(cfg.graph_batch_sizes)
    if runner is None:
        level = getattr(getattr(profile, "exec_level", None), "value", None)
        raise UserError(f"backend.graphs=true: backend {cfg.name!r} captures no graphs"
                        f"{f' at level {level!r}' if level else ''} (graph runners come from device backends running on "
                        f"their device, not in an interpreter); set backend.graphs=false")
    return sizes


class DecodeGraphs:
    def __init__(self, graph_runner: Any, model: Any, specs: Sequence[KVGroupSpec], block_size: int,
                 max_model_len: int, sizes: Sequence[int], kv: Any, device: str | torch.device = "cpu",
                 num_drafts: int = 0, hidden: bool = False) -> None:
        """``num_drafts``: the drafter's ``k`` (0: none), so ``1 + k``-token steps replay too; ``hidden``: the
        drafter reads the target's final hidden states of every token (MTP), a second output of each graph."""
        self.graph_runner, self.model, self.kv, self.device = graph_runner, model, kv, torch.device(device)
        self.specs, self.block_size = tuple(specs), int(block_size)
        self.sizes = check_sizes(sizes)
        self.widths = (1, 1 + num_drafts) if num_drafts else (1,)  # tokens a sequence of a uniform step
        self.hidden = hidden
        self.width = {s.name: max(1, blocks_needed(s, block_size, max_model_len)) for s in self.specs}
        self._replays: dict[tuple[int, int, bool], Callable[..., Any]] = {}  # (bucket, q, greedy) -> replay
        self.disabled: str | None = None  # why graphs are off (a capture failed)
        self.num_captures = 0
        self.num_replays = 0
        # DP ranks: agree(rows or None, greedy) -> (bucket, greedy) of every rank (core/parallel/dp_graphs.py)
        self.peers: Any = None

    def bucket(self, n: int) -> int | None:
        """The smallest captured batch size that holds ``n`` sequences, or None (run eagerly)."""
        return next((b for b in self.sizes if b >= n), None)

    def uniform(self, batch: ForwardBatch, num_seqs: int) -> int | None:
        """``q``, the tokens of each sequence of a uniform step that a bucket holds (every token with a logits
        row, in order), or None. Decided on the host: ``n`` tokens of ``n`` sequences are one each, and for
        ``q > 1`` the plan's ``num_new``; ``n`` logits rows of ``n`` tokens are every token in order (the
        runner's ``_prepare``: a sequence's last token, or its last known token and each draft), so no device
        value is read."""
        n = int(batch.input_ids.shape[0])
        if self.disabled is not None or num_seqs <= 0 or n % num_seqs or self.bucket(num_seqs) is None:
            return None
        q = n // num_seqs
        if q not in self.widths or int(batch.logits_indices.shape[0]) != n:
            return None
        if q > 1 and (batch.seqs is None or any(s.num_new != q for s in batch.seqs)):
            return None
        if any(batch.attn[s.name].block_table.shape[1] > self.width[s.name] for s in self.specs):
            return None
        return q

    def eligible(self, batch: ForwardBatch, num_seqs: int) -> bool:
        """Whether :meth:`uniform` finds a ``q`` for this step."""
        return self.uniform(batch, num_seqs) is not None

    def plan(self, batch: ForwardBatch, num_seqs: int, wanted: bool, greedy: bool) -> tuple[int, bool] | None:
        """``(bucket, greedy)`` of the graph this step replays, or None (eager). ``wanted``: the caller's own
        conditions; ``greedy``: it wants tokens, not logits. Alone: the smallest bucket of a uniform step, and
        ``greedy``. With ``peers``, what every DP rank agreed on (a collective: each rank calls this or
        :meth:`idle` once per step): greedy only when every rank's step is, and eager when the ranks' ``q``
        differ, so every rank replays (and first captures) the same graph in the same step."""
        q = self.uniform(batch, num_seqs) if wanted else None
        if self.peers is None:
            return (self.bucket(num_seqs), greedy) if q is not None else None
        agreed = self.peers.agree(None if q is None else num_seqs, greedy, q or 1)
        return None if agreed is None else agreed[:2]

    def idle(self) -> None:
        """A step in which this rank scheduled nothing. With ``peers``: join the step's agreement, and when the
        other ranks replay a graph, run a padding-only step through it, so that this rank's MoE exchanges are
        the same program as theirs (vLLM's dummy batch). Alone: nothing."""
        if self.peers is None:
            return
        agreed = self.peers.agree(0 if self.disabled is None else None, hasattr(self.model, "forward_greedy"))
        if agreed is not None:
            size, greedy, q = agreed
            self.run(self._padding_batch(q), greedy, size)

    # ------------------------------------------------------------------ the step

    def run(self, batch: ForwardBatch, greedy: bool, size: int | None = None) -> Any:
        """The step's logits ``[T, V]`` (or for a plain decode greedy tokens ``[B]``), with ``hidden`` a pair
        of those and the final hidden states ``[T, ...]``, from the graph of ``size`` sequences (default: the
        smallest bucket that holds the batch); None when graphs are off (the caller runs eagerly). The outputs
        are the graph's own buffers: valid until the next replay."""
        n, seqs = int(batch.input_ids.shape[0]), int(batch.query_start_loc.shape[0]) - 1
        q = n // seqs
        size = self.bucket(seqs) if size is None else size
        args = self._pad(batch, size, q)
        key = (size, q, greedy)
        replay = self._replays.get(key)
        if replay is None:
            try:
                replay = self.graph_runner.capture(self._step_fn(greedy), *args)
            except Exception as exc:  # noqa: BLE001 - any capture failure: eager from now on, said once
                self.disabled = (f"capturing a {size}-row decode step{f' of {q} tokens a row' if q > 1 else ''} "
                                 f"failed: {type(exc).__name__}: {exc}")
                if self.peers is not None:
                    raise RuntimeError(f"backend.graphs: {self.disabled}; a DP rank cannot run this step eagerly "
                                       f"while its peers exchange at the bucket's shapes: set backend.graphs=false"
                                       ) from exc
                log.warning("graphs off for this engine: %s", self.disabled)
                warnings.warn(f"backend.graphs: graphs off for this engine, decode steps run eagerly: {self.disabled}",
                              GraphCaptureWarning, stacklevel=2)
                return None
            self._replays[key] = replay
            self.num_captures += 1
        try:
            out = replay(*args)
        finally:
            if self.peers is not None:  # the rest of the step (a drafter's MoE layers) exchanges in rounds
                self.peers.done()
        self.num_replays += 1
        return (out[0][:n], out[1][:n]) if self.hidden else out[:n]

    def _step_fn(self, greedy: bool) -> Callable[..., Any]:
        names = [s.name for s in self.specs]
        ratio = {s.name: s.tokens_per_slot for s in self.specs}
        model, kv, hidden = self.model, self.kv, self.hidden

        def step(input_ids, positions, qsl, rows, *per_group):
            attn = {}
            for i, g in enumerate(names):
                seq_lens, table, slots = per_group[3 * i: 3 * i + 3]
                attn[g] = AttnBatch(qsl, seq_lens, positions, table, slots, ratio[g])
            batch = ForwardBatch(input_ids, positions, qsl, attn, rows)
            if hidden:
                return model.forward_and_hidden(batch, kv, greedy=greedy)
            return model.forward_greedy(batch, kv) if greedy else model.forward(batch, kv)

        return step

    def _padding_batch(self, q: int = 1) -> ForwardBatch:
        """One sequence of ``q`` tokens at positions ``0 .. q-1`` that reads the first entries of block 0 in
        each group and writes nothing (every slot -1), each token a logits row: what an idle DP rank pads to
        its bucket."""
        dev, blocks = self.device, -(-q // self.block_size)  # block 0 as each block the q positions reach
        pos, qsl = torch.arange(q, device=dev), torch.tensor([0, q], dtype=torch.int32, device=dev)
        attn = {s.name: AttnBatch(qsl, torch.full((1,), q // s.tokens_per_slot, dtype=torch.int32, device=dev), pos,
                                  torch.zeros((1, blocks), dtype=torch.int32, device=dev), torch.full_like(pos, -1),
                                  s.tokens_per_slot)
                for s in self.specs}
        return ForwardBatch(torch.zeros_like(pos), pos, qsl, attn, torch.arange(q, device=dev))

    def _pad(self, batch: ForwardBatch, size: int, q: int = 1) -> list[torch.Tensor]:
        """The step's tensors at the bucket's shapes (``size`` sequences of ``q`` tokens): padding sequences
        copy the first sequence's tokens and write nothing."""
        seqs = int(batch.query_start_loc.shape[0]) - 1
        pad = size - seqs
        dev = batch.input_ids.device

        def tokens(t: torch.Tensor) -> torch.Tensor:  # [seqs * q, ...] -> [size * q, ...]
            return torch.cat([t, t[:q].repeat(pad, *([1] * (t.dim() - 1)))]) if pad else t

        def rows(t: torch.Tensor) -> torch.Tensor:  # [seqs, ...] -> [size, ...]
            return torch.cat([t, t[:1].expand(pad, *t.shape[1:])]) if pad else t

        out = [tokens(batch.input_ids), tokens(batch.positions),
               torch.arange(0, q * size + 1, q, dtype=batch.query_start_loc.dtype, device=dev),
               torch.arange(q * size, dtype=torch.long, device=dev)]
        for s in self.specs:
            a = batch.attn[s.name]
            table = torch.full((size, self.width[s.name]), -1, dtype=a.block_table.dtype, device=dev)
            w = min(a.block_table.shape[1], self.width[s.name])
            table[:seqs, :w] = a.block_table[:, :w]
            table[seqs:, :w] = a.block_table[:1, :w]
            slots = torch.cat([a.slot_mapping, torch.full((pad * q,), -1, dtype=a.slot_mapping.dtype, device=dev)])
            out += [rows(a.seq_lens), table, slots]
        return out
