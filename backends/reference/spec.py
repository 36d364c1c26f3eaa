"""Reference speculative-decoding verification (rejection sampling)."""

from __future__ import annotations

import torch

from inferhal.backends.reference.sampling import argmax_rows, filtered_probs
from inferhal.core.ops.params import SampleBatch


def spec_verify(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                p: SampleBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_ids [B, S]; draft_probs [B, S, V] or None (a deterministic drafter, e.g. n-gram: q = one-hot);
    target_logits [B, S+1, V] → (tokens [B, S+1] padded with -1, n_emitted [B] = accepted drafts + 1).

    Greedy rows (temperature 0) accept the longest prefix equal to the target's argmax, then emit the
    argmax at the first mismatch (or the bonus token). Other rows run the standard rejection sampler
    against the same distribution ``sample`` draws from (temperature, top-k, top-p, min-p), which leaves
    the output distributed exactly as the target's: accept d with probability min(1, p(d)/q(d)), else draw
    from norm(max(0, p - q)); all accepted → draw the bonus from p.
    """
    b, s = draft_ids.shape
    out = torch.full((b, s + 1), -1, dtype=torch.long, device=draft_ids.device)
    n = torch.zeros(b, dtype=torch.long, device=draft_ids.device)
    greedy = [r for r in range(b) if p.temperature[r] <= 0]
    best = {}
    if greedy:  # every greedy row's S+1 argmaxes in one pass
        top = argmax_rows(target_logits[greedy].reshape(len(greedy) * (s + 1), -1).float()).view(len(greedy), s + 1)
        best = dict(zip(greedy, top.tolist()))
    drafts = draft_ids.tolist()
    for r in range(b):
        gen = p.generators[r] if p.generators else None
        k = 0
        while k < s:
            d = drafts[r][k]
            if r in best:
                t = best[r][k]
                if t != d:
                    out[r, k] = t
                    break
                out[r, k] = d
            else:
                pt = filtered_probs(target_logits[r, k], p, r)
                if draft_probs is None:
                    q = torch.zeros_like(pt)
                    q[d] = 1.0
                else:
                    q = draft_probs[r, k].float()
                u = torch.rand((), generator=gen, device=pt.device)
                if u * q[d] < pt[d]:  # u < p/q without dividing by a zero q (a filtered-out d never passes)
                    out[r, k] = d
                else:
                    resid = (pt - q).clamp(min=0)
                    resid = resid / resid.sum() if resid.sum() > 0 else pt
                    out[r, k] = torch.multinomial(resid, 1, generator=gen)[0]
                    break
            k += 1
        if k == s:  # every draft accepted: the bonus token
            out[r, s] = best[r][s] if r in best else int(
                torch.multinomial(filtered_probs(target_logits[r, s], p, r), 1, generator=gen)[0])
            n[r] = s + 1
        else:
            n[r] = k + 1
    return out, n


OPS = {"spec.verify": spec_verify}
