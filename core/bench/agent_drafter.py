"""The drafters' host cost on the agent bench's own turns: the recorded conversations replayed through a
drafter as the engine drives it, without a model.

Each completed turn of a run (its prompt rendered with the model's chat template, its output as the server
sent it, both tokenized by the model's tokenizer) is replayed in the order the turns ran, one request at a
time: ``prefill`` of the prompt step, then per decode step ``propose`` (at most the drafter's ``k`` and the
tokens left), verification as a greedy target does it (the drafts up to the first one that differs from the
recorded output stand, plus the target's own token), ``accept`` and ``prefill`` of the step's exact tokens;
``free`` at the end. The drafter calls alone are timed (``time.perf_counter`` around each), so the result is
the host time a drafter adds per request and decode step, to set against the step time the servers measured
(ITL p50); and the tokens a step would give each request with greedy drafts (a model-free view of what the
servers' ``tokens per chunk`` shows). Re-tokenizing an output's text may split it a little differently from
the ids the model emitted: the replay is of the text.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

from inferhal.core.spec.proposer import DraftWant, StepSeq, TargetStep


def replay(proposer: Any, turns: Sequence[tuple[list[int], list[int]]]) -> dict[str, float]:
    """``turns``: (prompt ids, output ids) in the order they ran → per decode step: the drafter's host µs
    (median and mean), drafts proposed and accepted, tokens per step."""
    costs: list[float] = []
    steps = drafted = accepted = emitted = 0
    for i, (prompt, output) in enumerate(turns):
        if len(output) < 2 or not prompt:
            continue
        rid = f"replay-{i}"
        toks = list(prompt) + output[:1]  # the prompt step sampled the first output token
        t = time.perf_counter()
        proposer.prefill(TargetStep((StepSeq(rid, 0, len(prompt), 0, toks, {}),)))
        costs.append(time.perf_counter() - t)
        pos = 1
        while pos < len(output):
            t = time.perf_counter()
            got = proposer.propose([DraftWant(rid, toks, len(output) - pos - 1, {})]).get(rid, [])
            dt = time.perf_counter() - t
            n = 0
            while n < len(got) and got[n] == output[pos + n]:
                n += 1
            new = output[pos : pos + n + 1]
            start = len(toks) - 1
            toks.extend(new)
            t = time.perf_counter()
            if got:
                proposer.accept(rid, len(got), n)
            proposer.prefill(TargetStep((StepSeq(rid, start, len(new), 0, toks, {}),)))
            costs.append(dt + time.perf_counter() - t)
            steps += 1
            drafted += len(got)
            accepted += n
            emitted += len(new)
            pos += len(new)
        t = time.perf_counter()
        proposer.free(rid)
        costs[-1] += time.perf_counter() - t
    return {"decode_steps": steps, "host_us_p50": 1e6 * statistics.median(costs) if costs else float("nan"),
            "host_us_mean": 1e6 * statistics.fmean(costs) if costs else float("nan"),
            "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
            "tokens_per_step": emitted / steps if steps else None}


def tokenized(tokenizer: Any, records: Sequence[tuple[list[dict], str]]) -> list[tuple[list[int], list[int]]]:
    """(messages, output text) → (prompt ids as the server renders them, output ids)."""
    out = []
    for messages, text in records:
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_bos=False)
        out.append((prompt, tokenizer.encode(text, add_bos=False)))
    return out
