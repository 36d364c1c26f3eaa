"""The e2e benchmark's workload and its clients: the prompts, and one closed-loop client per engine
(inferhal's engine, transformers ``generate``, llama.cpp), each returning the wall time and per request
(TTFT, TPOT, output tokens). ``bench e2e`` compares them; ``bench ops`` and ``bench greedy_head`` reuse the
prompts and inferhal's client."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

PROMPTS = (
    "The capital of France is", "Write a short poem about the sea:", "def quicksort(arr):\n",
    "The three laws of thermodynamics are", "Once upon a time, in a land far away,",
    "Explain photosynthesis in simple terms:", "A recipe for pancakes:\n1.", "The history of the Roman Empire",
    "Q: What is the square root of 144?\nA:", "Les avantages du vélo en ville sont", "In machine learning, overfitting",
    "The best way to learn a new language is", "import numpy as np\n\n# compute the mean of", "My favourite book is",
    "The weather forecast for tomorrow:", "Dear hiring manager,\n", "Ten facts about octopuses:\n1.",
    "SELECT name, age FROM users WHERE", "The moon landing in 1969", "How to plant a tree: first,",
)
PEERS = ("transformers", "llama_cpp")


def prompt_ids(tok, n: int) -> list[list[int]]:
    """``n`` prompts as token ids: :data:`PROMPTS` in turn, marked ``(take k)`` from their second round on."""
    return [tok.encode(PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" (take {i // len(PROMPTS) + 1})"))
            for i in range(n)]


def run_inferhal(llm, prompts: Sequence[list[int]], c: int, max_tokens: int,
                 steps: list[int] | None = None) -> tuple[float, list]:
    """The closed loop at concurrency ``c`` → (wall seconds, per request (TTFT, TPOT, tokens)); the number of
    engine steps it took is appended to ``steps`` when given."""
    from inferhal.core.sampling.params import SamplingParams

    eng = llm.engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = list(range(len(prompts)))
    submit, first, last, count = {}, {}, {}, {}
    t0 = time.perf_counter()

    def add() -> None:
        i = pending.pop(0)
        rid = eng.add_request(list(prompts[i]), sp, request_id=f"e2e-{c}-{i}")
        submit[rid] = time.perf_counter()

    for _ in range(min(c, len(pending))):
        add()
    done = n_steps = 0
    while done < len(prompts):
        outs = eng.step()
        n_steps += 1
        now = time.perf_counter()
        for o in outs:
            n = len(o.token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = now
            last[o.request_id], count[o.request_id] = now, n
            if o.finished:
                done += 1
                if pending:
                    add()
    wall = time.perf_counter() - t0
    if steps is not None:
        steps.append(n_steps)
    per = [(first[r] - submit[r], (last[r] - first[r]) / max(count[r] - 1, 1), count[r]) for r in submit]
    return wall, per


def run_transformers(model, prompts: Sequence[list[int]], c: int, max_tokens: int, pad_id: int) -> tuple[float, list]:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    per = []
    t0 = time.perf_counter()
    for s in range(0, len(prompts), c):  # c clients submit together when the previous batch is done
        t_submit = time.perf_counter()
        batch = prompts[s : s + c]
        width = max(len(p) for p in batch)
        dev = getattr(model, "device", "cpu")  # the model's own device (the device run moves it there)
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in batch], device=dev)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)
        stamp = Stamp()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([stamp]))
        first, end = stamp.times[0], time.perf_counter()
        n = len(stamp.times)
        per += [(first - t_submit, (end - first) / max(n - 1, 1), n)] * len(batch)
    return time.perf_counter() - t0, per


def run_llama_cpp(llama, prompts: Sequence[list[int]], c: int, max_tokens: int, eos_ids: Sequence[int]) -> tuple[float, list]:
    per = []
    t0 = time.perf_counter()
    bias = {int(e): -1e9 for e in eos_ids}  # ignore EOS, as the other engines do
    for s in range(0, len(prompts), c):  # c clients submit together; llama.cpp serves them one by one
        t_submit = time.perf_counter()
        for p in prompts[s : s + c]:
            llama.reset()
            first = None
            n = 0
            for chunk in llama.create_completion(prompt=list(p), max_tokens=max_tokens, temperature=0.0, top_k=1,
                                                 stream=True, logit_bias=bias):
                ch = chunk["choices"][0]
                if ch.get("finish_reason") and not ch.get("text"):
                    continue  # the closing chunk carries no token
                n += 1
                if first is None:
                    first = time.perf_counter()
            end = time.perf_counter()
            per.append((first - t_submit, (end - first) / max(n - 1, 1), n))
    return time.perf_counter() - t0, per


def peer_loaders(path: str, threads: int, dtype: str) -> dict[str, Callable[[], Any]]:
    """Per peer, a loader of it on the GGUF at ``path``: transformers through ``gguf_file=`` in ``dtype``,
    llama.cpp with ``threads`` threads."""
    def transformers_model():
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=getattr(torch, dtype)).eval()

    def llama_cpp_model():
        from llama_cpp import Llama

        return Llama(model_path=path, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False, seed=0)

    return {"transformers": transformers_model, "llama_cpp": llama_cpp_model}
