"""Decode steps replayed from device graphs, one capture per batch-size bucket (as vLLM's device graphs).

The backend's optional ``graph_runner`` hook (:class:`~inferhal.core.backend.GraphRunner`) captures a
callable for fixed-shape example tensors and returns a replay that copies new inputs into the captured
buffers, runs the graph and returns the captured outputs. Core names no device: a device backend returns
its graph runner; the host backends and the interpreter return none, and steps run eagerly.

A step is replayed when every sequence decodes one token (no drafts, no prompt chunk), the model's
hidden states are not wanted (an MTP drafter reads them), and the batch fits the largest of
``backend.graph_batch_sizes``. The batch is padded to the smallest bucket that holds it: each padding
row repeats the first row's positions, lengths and block tables (so it reads only allocated blocks) with
every slot mapping -1 (so it writes no KV), and its outputs are dropped. Block tables are as wide as a
``max_model_len`` request needs, so one capture serves every context length. Each bucket is captured
once, on first use, for the logits (or, for an all-greedy step, the tokens) of the model's forward;
sampling, verification and bitmasks stay outside the graph.

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
from inferhal.core.errors import UserError

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


class GraphCaptureWarning(UserWarning):
    """A decode step's graph capture failed: the engine runs eagerly from then on (the message says why)."""


def check_config(cfg: Any, runner: Any, profile: Any = None) -> tuple[int, ...] | None:
    """``backend.graphs`` and ``backend.graph_batch_sizes`` checked against the backend: the buckets with
    graphs on, None with graphs off; a clear error for true on a backend without a graph runner, or buckets
    set while graphs are off (a field that would do nothing)."""
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
                 max_model_len: int, sizes: Sequence[int], kv: Any) -> None:
        self.graph_runner, self.model, self.kv = graph_runner, model, kv
        self.specs = tuple(specs)
        self.sizes = check_sizes(sizes)
        self.width = {s.name: max(1, blocks_needed(s, block_size, max_model_len)) for s in self.specs}
        self._replays: dict[tuple[int, bool], Callable[..., Any]] = {}
        self.disabled: str | None = None  # why graphs are off (a capture failed)
        self.num_captures = 0
        self.num_replays = 0

    def bucket(self, n: int) -> int | None:
        """The smallest captured batch size that holds ``n`` sequences, or None (run eagerly)."""
        return next((b for b in self.sizes if b >= n), None)

    def eligible(self, batch: ForwardBatch, num_seqs: int) -> bool:
        """A pure decode step (one token per sequence, logits for each in order) that a bucket holds. Decided on
        the host: ``n`` tokens of ``n`` sequences are one each, and ``n`` logits rows of a step without drafts
        are each sequence's last token in order (the runner's ``_prepare``), so no device value is read."""
        n = int(batch.input_ids.shape[0])
        return (self.disabled is None and 0 < n == num_seqs and self.bucket(n) is not None
                and int(batch.logits_indices.shape[0]) == n
                and all(batch.attn[s.name].block_table.shape[1] <= self.width[s.name] for s in self.specs))

    # ------------------------------------------------------------------ the step

    def run(self, batch: ForwardBatch, greedy: bool) -> torch.Tensor | None:
        """The step's logits ``[B, V]`` (or greedy tokens ``[B]``) from the bucket's graph; None when graphs
        are off (the caller runs eagerly)."""
        n = int(batch.input_ids.shape[0])
        size = self.bucket(n)
        args = self._pad(batch, size)
        key = (size, greedy)
        replay = self._replays.get(key)
        if replay is None:
            try:
                replay = self.graph_runner.capture(self._step_fn(greedy), *args)
            except Exception as exc:  # noqa: BLE001 - any capture failure: eager from now on, said once
                self.disabled = f"capturing a {size}-row decode step failed: {type(exc).__name__}: {exc}"
                log.warning("graphs off for this engine: %s", self.disabled)
                warnings.warn(f"backend.graphs: graphs off for this engine, decode steps run eagerly: {self.disabled}",
                              GraphCaptureWarning, stacklevel=2)
                return None
            self._replays[key] = replay
            self.num_captures += 1
        out = replay(*args)
        self.num_replays += 1
        return out[:n]

    def _step_fn(self, greedy: bool) -> Callable[..., torch.Tensor]:
        names = [s.name for s in self.specs]
        ratio = {s.name: s.tokens_per_slot for s in self.specs}
        model, kv = self.model, self.kv

        def step(input_ids, positions, qsl, rows, *per_group):
            attn = {}
            for i, g in enumerate(names):
                seq_lens, table, slots = per_group[3 * i: 3 * i + 3]
                attn[g] = AttnBatch(qsl, seq_lens, positions, table, slots, ratio[g])
            batch = ForwardBatch(input_ids, positions, qsl, attn, rows)
            return model.forward_greedy(batch, kv) if greedy else model.forward(batch, kv)

        return step

    def _pad(self, batch: ForwardBatch, size: int) -> list[torch.Tensor]:
        """The step's tensors at the bucket's shapes: padding rows copy row 0 and write nothing."""
        n = int(batch.input_ids.shape[0])
        pad = size - n
        dev = batch.input_ids.device

        def rows(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t[:1].expand(pad, *t.shape[1:])]) if pad else t

        out = [rows(batch.input_ids), rows(batch.positions), torch.arange(size + 1, dtype=batch.query_start_loc.dtype,
                                                                             device=dev),
               torch.arange(size, dtype=torch.long, device=dev)]
        for s in self.specs:
            a = batch.attn[s.name]
            table = torch.full((size, self.width[s.name]), -1, dtype=a.block_table.dtype, device=dev)
            w = min(a.block_table.shape[1], self.width[s.name])
            table[:n, :w] = a.block_table[:, :w]
            table[n:, :w] = a.block_table[:1, :w]
            slots = torch.cat([a.slot_mapping, torch.full((pad,), -1, dtype=a.slot_mapping.dtype, device=dev)])
            out += [rows(a.seq_lens), table, slots]
        return out
