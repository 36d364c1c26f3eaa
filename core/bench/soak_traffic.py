"""The traffic of ``inferhal bench soak``: a seeded plan of requests mixing the server's routes and features,
and the offline engine's greedy text for each greedy request in it.

Kinds (share of the requests): ``completion`` (30 %) and ``chat`` (25 %), greedy, on prompts sharing a few
prefixes; ``messages`` (10 %, Anthropic's route, the chat prompts); ``long`` (10 %, a ~300-word preamble they
all share, then a question: long prefills and prefix hits); ``structured`` (10 %, chat with a JSON schema in
``response_format``); ``sampled_n`` (15 %, completions with ``n`` = 2 at temperature 0.8, seeded). Half of each
kind streams. Greedy requests come from a fixed set of :data:`PROMPTS` bodies (each with its own
``max_tokens``, up to ``bench.max_tokens``), so the offline references are few: one per body.

A share ``bench.soak.disconnect`` of the requests hang up: a long prompt's client right after sending (its
prefill running), a stream's before its first token (``send``, ``headers``) or after 1 to 6 events, a JSON
request's right after sending. A share ``bench.soak.resend`` of those send the same body again at once and
read it to the end (the API has no request ids a client sets: the same body is the retry).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional

from inferhal.core.bench.soak_client import Hang

KINDS = {"completion": 0.30, "chat": 0.25, "messages": 0.10, "long": 0.10, "structured": 0.10, "sampled_n": 0.15}
#: distinct greedy bodies per kind (their references are computed offline once each)
PROMPTS = 16
LONG_PROMPTS = 4
SYSTEMS = ["You are a helpful assistant. Answer in one short sentence.", "You are a terse expert. Be brief."]
PREFIXES = ["Story: ", "Question: what do you know about ", "Write a line of a poem about "]
SUBJECTS = ["a lighthouse keeper", "the river in spring", "an old map", "a small cat", "the north wind", "a baker",
            "the last train", "a violin", "the moon", "copper wire", "a chess opening", "rain on a tin roof",
            "a desert road", "the first snow", "a paper boat", "an empty station"]
PREAMBLE = " ".join(f"Rule {i}: keep the answer about {SUBJECTS[i % len(SUBJECTS)]} short, plain and kind." for i in
                    range(30))
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@dataclass(frozen=True)
class Job:
    """One planned request: the route, the body, its greedy reference's key (None: not greedy), where its
    client hangs up (None: never) and whether the same body is sent again after that."""

    kind: str
    path: str
    body: dict
    ref: Optional[tuple] = None
    hang: Hang = None
    resend: bool = False


def max_tokens_of(i: int, longest: int) -> int:
    return [4, 8, 16, longest][i % 4]


def question(i: int) -> str:
    return f"Tell me about {SUBJECTS[i % len(SUBJECTS)]}."


def chat_messages(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEMS[i % 2]}, {"role": "user", "content": question(i)}]


def body_of(kind: str, i: int, model: str, longest: int, stream: bool) -> tuple[str, dict, Optional[tuple]]:
    """(route, body, reference key) of greedy body ``i`` of ``kind`` (or a sampled one for ``sampled_n``)."""
    m = max_tokens_of(i, longest)
    base = {"model": model, "max_tokens": m, "temperature": 0, "stream": stream}
    if kind == "completion":
        return "/v1/completions", {**base, "prompt": PREFIXES[i % 3] + SUBJECTS[i]}, ("text", i, m)
    if kind == "long":
        m = 8
        return "/v1/completions", {**base, "max_tokens": m, "prompt": PREAMBLE + "\n" + question(i)}, ("long", i, m)
    if kind == "chat":
        return "/v1/chat/completions", {**base, "messages": chat_messages(i)}, ("chat", i, m)
    if kind == "messages":
        return "/v1/messages", {**base, "system": SYSTEMS[i % 2],
                                "messages": [{"role": "user", "content": question(i)}]}, ("chat", i, m)
    if kind == "structured":
        m = 24
        return "/v1/chat/completions", {**base, "max_tokens": m, "messages": [{"role": "user", "content": (
            f"Invent a person who likes {SUBJECTS[i]}: their name and age, as JSON.")}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}, ("json", i, m)
    body = {**base, "prompt": PREFIXES[i % 3] + SUBJECTS[i], "n": 2, "temperature": 0.8, "seed": i}
    return "/v1/completions", body, None


def plan(n: int, model: str, longest: int, disconnect: float, resend: float, seed: int) -> list[Job]:
    """``n`` requests (each resend counts as one) in a seeded order."""
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    jobs: list[Job] = []
    while sum(1 + j.resend for j in jobs) < n:
        kind = rng.choices(kinds, weights)[0]
        i = rng.randrange(LONG_PROMPTS if kind == "long" else PROMPTS)
        stream = rng.random() < 0.5
        path, body, ref = body_of(kind, i, model, longest, stream)
        hang: Hang = None
        if rng.random() < disconnect:
            if kind == "long" or not stream:
                hang = "send"  # in the prefill, or before a JSON answer
            else:
                hang = rng.choice(["send", "headers", rng.randint(1, 6)])
        again = hang is not None and rng.random() < resend and sum(1 + j.resend for j in jobs) + 2 <= n
        jobs.append(Job(kind, path, body, ref, hang, again))
    return jobs


def references(llm: Any, jobs: list[Job]) -> dict[tuple, str]:
    """The offline engine's greedy text of every greedy body in ``jobs`` (chat prompts rendered by the server's
    own renderer, structured ones under the same JSON schema), in one batched ``generate``."""
    from inferhal.core.sampling.params import SamplingParams
    from inferhal.core.server.tools import prompt as render
    from inferhal.core.server.tools.formats import call_format

    tok = llm.tokenizer
    fmt = call_format(getattr(llm.engine.loaded, "family", None))
    keys = sorted({j.ref for j in jobs if j.ref is not None})
    prompts, params = [], []
    for kind, i, m in keys:
        greedy = SamplingParams(max_tokens=m, temperature=0.0)
        if kind in ("text", "long"):
            _, body, _ = body_of("completion" if kind == "text" else "long", i, "", m, False)
            prompts.append(body["prompt"])
        else:
            msgs = chat_messages(i) if kind == "chat" else body_of("structured", i, "", m, False)[1]["messages"]
            prompts.append(tok.encode(render.render(tok, msgs, fmt, None, {}), add_bos=False))
            if kind == "json":
                greedy = SamplingParams(max_tokens=m, temperature=0.0, structured={"json": SCHEMA})
        params.append(greedy)
    outs = llm.generate(prompts, params) if keys else []
    return {k: o.outputs[0].text for k, o in zip(keys, outs)}
