"""The model runner: one :class:`SchedulerOutput` → one forward pass and one sampling call.

It builds the :class:`~inferhal.core.models.base.ForwardBatch` (block tables → slots through
:func:`~inferhal.core.paging.batch.build_attn_batches`, the one place that maps positions to slots),
calls ``model.forward`` with the backend's KV storage, then the backend's ``sample`` op with each
row's own settings and generator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from inferhal.core.models.base import CausalLM, ForwardBatch
from inferhal.core.ops.params import SampleBatch
from inferhal.core.paging.batch import SeqSlice, build_attn_batches
from inferhal.core.paging.spec import KVGroupSpec
from inferhal.core.scheduler.output import SchedulerOutput
from inferhal.core.scheduler.request import Request


@dataclass
class StepResult:
    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    prepare_s: float = 0.0
    model_s: float = 0.0
    sample_s: float = 0.0


class ModelRunner:
    def __init__(self, model: CausalLM, ops: Any, kv: Any, specs: Sequence[KVGroupSpec], block_size: int,
                 device: torch.device) -> None:
        self.model, self.ops, self.kv = model, ops, kv
        self.specs, self.block_size, self.device = tuple(specs), block_size, device
        self._logits = torch.empty(0, model.vocab_size, dtype=torch.float32, device=device)

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """``[rows, V]`` fp32 for the model's logits, one buffer grown to the most rows seen and reused every
        step (fresh 32 MiB logits at 32 rows cost ~12 ms of page faults a step on the CPU). The logits
        live until the next step: sampling and logprobs read them before then."""
        if self._logits.shape[0] < rows:
            self._logits = torch.empty(rows, self.model.vocab_size, dtype=torch.float32, device=self.device)
        return self._logits[:rows]

    def execute(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> StepResult:
        res = StepResult()
        if out.is_empty:
            return res
        t0 = time.perf_counter()
        seqs = [SeqSlice(s.num_computed, s.num_new, s.block_ids) for s in out.seqs]
        positions, qsl, attn = build_attn_batches(self.specs, self.block_size, seqs, self.device)
        ids: list[int] = []
        rows, sample_reqs = [], []
        for s in out.seqs:
            ids.extend(s.token_ids)
            if s.sample:
                rows.append(len(ids) - 1)
                sample_reqs.append(requests[s.request_id])
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),  # [T]
            positions=positions,
            query_start_loc=qsl,
            attn=attn,
            logits_indices=torch.tensor(rows, dtype=torch.long, device=self.device),  # [B']
            logits_out=self._logits_buffer(len(rows)),
        )
        t1 = time.perf_counter()
        logits = self.model.forward(batch, self.kv)  # [B', V] fp32
        t2 = time.perf_counter()
        res.prepare_s, res.model_s = t1 - t0, t2 - t1
        if sample_reqs:
            self._sample(logits, sample_reqs, res)
        res.sample_s = time.perf_counter() - t2
        return res

    def _sample(self, logits: torch.Tensor, reqs: Sequence[Request], res: StepResult) -> None:
        ps = [r.params for r in reqs]
        sb = SampleBatch(
            temperature=tuple(float(p.temperature) for p in ps),
            top_k=tuple(int(p.top_k) for p in ps),
            top_p=tuple(float(p.top_p) for p in ps),
            generators=tuple(r.generator for r in reqs) if any(r.generator is not None for r in reqs) else (),
            min_p=tuple(float(p.min_p) for p in ps) if any(p.min_p for p in ps) else (),
        )
        toks = self.ops["sample"](logits, sb).tolist()  # [B']
        want = [i for i, p in enumerate(ps) if p.logprobs]
        if want:
            lp = torch.log_softmax(logits[want].float(), dim=-1)  # [W, V]
            k = max(ps[i].logprobs for i in want)
            top_v, top_i = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
            for j, i in enumerate(want):
                kk = ps[i].logprobs
                d = {int(t): float(v) for t, v in zip(top_i[j, :kk].tolist(), top_v[j, :kk].tolist())}
                d.setdefault(int(toks[i]), float(lp[j, toks[i]]))
                res.logprobs[reqs[i].request_id] = d
        for r, t in zip(reqs, toks):
            res.tokens[r.request_id] = int(t)
