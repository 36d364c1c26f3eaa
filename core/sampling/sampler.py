"""Sampling, draft verification and log-probabilities of one step's logits, over the backend's ops.

``sample`` draws one token per row with each request's own settings and generator (the backend's ``sample``
op); ``verify`` decides how many drafts of each row stand and the token after them (``spec.verify``: exact for
greedy and sampled rows alike); both advance a request's structured-output matcher through the tokens it
keeps and give the top log-probabilities of each emitted token where the request asked for them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from inferhal.core.ops.params import SampleBatch

Logprobs = dict[int, float]


def sample_batch(reqs: Sequence[Any]) -> SampleBatch:
    """The ``sample`` / ``spec.verify`` settings of ``reqs`` (one row each)."""
    ps = [r.params for r in reqs]
    return SampleBatch(
        temperature=tuple(float(p.temperature) for p in ps),
        top_k=tuple(int(p.top_k) for p in ps),
        top_p=tuple(float(p.top_p) for p in ps),
        generators=tuple(r.generator for r in reqs) if any(r.generator is not None for r in reqs) else (),
        min_p=tuple(float(p.min_p) for p in ps) if any(p.min_p for p in ps) else (),
    )


def top_logprobs(logits: torch.Tensor, tokens: Sequence[Sequence[int]], ks: Sequence[int]) -> list[list[Logprobs]]:
    """logits [sum(len(t)), V], one row per emitted token (requests in order) → per request, per token: the
    top ``k`` logprobs plus the emitted token's own."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    top_v, top_i = torch.topk(lp, min(max(ks), lp.shape[-1]), dim=-1)
    out, row = [], 0
    for toks, k in zip(tokens, ks):
        per = []
        for t in toks:
            d = {int(a): float(b) for a, b in zip(top_i[row, :k].tolist(), top_v[row, :k].tolist())}
            d.setdefault(int(t), float(lp[row, t]))
            per.append(d)
            row += 1
        out.append(per)
    return out


def _accept(req: Any, toks: Sequence[int]) -> None:
    """Advance ``req``'s structured-output matcher through the tokens it keeps (none once it has ended)."""
    if req.grammar is not None and not req.grammar.terminated:
        for t in toks:
            req.grammar.accept(int(t))


class Sampler:
    """The step's tokens (and logprobs) from its logits, through the backend's ``sample`` and ``spec.verify``."""

    def __init__(self, ops: Any, device: Any) -> None:
        self.ops, self.device = ops, device

    def sample(self, logits: torch.Tensor, reqs: Sequence[Any]) -> tuple[dict[str, int], dict[str, Logprobs]]:
        """logits [B, V], a row per request → (a token per request, the logprobs of those that asked)."""
        toks = self.ops["sample"](logits, sample_batch(reqs)).tolist()  # [B]
        tokens = {}
        for r, t in zip(reqs, toks):
            tokens[r.request_id] = int(t)
            _accept(r, (t,))
        want = [i for i, r in enumerate(reqs) if r.params.logprobs]
        logprobs = {}
        if want:
            for i, d in zip(want, top_logprobs(logits[want], [[toks[i]] for i in want],
                                               [reqs[i].params.logprobs for i in want])):
                logprobs[reqs[i].request_id] = d[0]
        return tokens, logprobs

    def verify(self, logits: torch.Tensor, drafts: Sequence[Sequence[int]],
               reqs: Sequence[Any]) -> tuple[dict[str, list[int]], dict[str, list[Logprobs]]]:
        """logits [B, S+1, V]: each row's S drafts checked by ``spec.verify`` → (the accepted drafts plus one
        token, per request; the logprobs of each emitted token of those that asked)."""
        d = torch.tensor([list(x) for x in drafts], dtype=torch.long, device=self.device)  # [B, S]
        toks, n = self.ops["spec.verify"](d, None, logits, sample_batch(reqs))  # [B, S+1], [B]
        emitted = [[int(t) for t in row[:k]] for row, k in zip(toks.tolist(), n.tolist())]
        tokens = {}
        for r, e in zip(reqs, emitted):
            tokens[r.request_id] = e
            _accept(r, e)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs]
        logprobs = {}
        if want:
            per = top_logprobs(torch.cat([logits[i, : len(emitted[i])] for i in want]),
                               [emitted[i] for i in want], [reqs[i].params.logprobs for i in want])
            for i, lp in zip(want, per):
                logprobs[reqs[i].request_id] = lp
        return tokens, logprobs
