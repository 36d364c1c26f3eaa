"""What the router knows of the model, without its weights: the tokenizer and the limits its instances sent
at hello (:func:`~.instance.hello`). :class:`Front` validates a request as an engine's
:meth:`~inferhal.core.engine.engine.Engine.make_request` does (the prompt, ``max_model_len``, the KV pool's
room, a structured-output constraint compiled), so a bad request is a 400 at the router and never reaches
an instance (the prompt checks are the scheduler's own :func:`~inferhal.core.scheduler.scheduler.check_length`)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Hashable, Optional

from inferhal.core.engine.intake import Intake
from inferhal.core.sampling.params import SamplingParams
from inferhal.core.scheduler.request import Request
from inferhal.core.scheduler.scheduler import RequestError, check_length


class _Limits:
    """What the instances' pools and schedulers allow, as hello said (a request must fit every instance)."""

    def __init__(self, limits: dict) -> None:
        self.max_model_len = int(limits["max_model_len"])
        self.chunked_prefill = bool(limits["chunked_prefill"])
        self.max_num_batched_tokens = int(limits["max_num_batched_tokens"])
        self.capacity_tokens = int(limits["capacity_tokens"])

    def check_request(self, req: Request) -> None:
        total = check_length(req, self.max_model_len, self.chunked_prefill, self.max_num_batched_tokens)
        if total > self.capacity_tokens:
            raise RequestError(f"request {req.request_id!r}: {total} tokens do not fit the KV pool of every instance "
                               f"(at most {self.capacity_tokens}); lower max_tokens, or raise cache.kv_cache_bytes (or "
                               f"cache.num_blocks) on the instances")


class Front(Intake):
    """An engine's request-facing half (the engine's own :class:`~inferhal.core.engine.intake.Intake` over this
    tokenizer, vocabulary and limits); it runs nothing."""

    def __init__(self, tokenizer: Any, limits: dict) -> None:
        self.limits = _Limits(limits)
        super().__init__(SimpleNamespace(vocab_size=int(limits["vocab_size"])), tokenizer, self.limits,
                         tuple(limits["eos_token_ids"]), id_prefix="r")
        self.max_model_len = self.limits.max_model_len

    def tighten(self, limits: dict) -> None:
        """Another instance's limits: a request must fit every instance it may be placed on."""
        self.limits.capacity_tokens = min(self.limits.capacity_tokens, int(limits["capacity_tokens"]))

    def make_request(self, prompt: Any, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                     extra_keys: tuple[Hashable, ...] = ()) -> Request:  # type: ignore[override]
        return super().make_request(prompt, params, request_id, extra_keys)[0]


class Fronted:
    """What the server reads of an engine, for an engine that runs elsewhere and checks requests here with
    a :class:`Front` (``self.front``): the disaggregated router, the DP group of ``inferhal serve``."""

    front: Any

    @property
    def tokenizer(self) -> Any:
        return self.front.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.front.max_model_len

    @property
    def model(self) -> Any:
        return self.front.model

    def make_request(self, prompt, params=None, request_id=None, extra_keys=()):
        return self.front.make_request(prompt, params, request_id, extra_keys)  # raises on a bad request


def continued(resumed: dict, o: Any) -> Any:
    """``o`` as its stream knows it. ``resumed``: request id -> the output its request had streamed when it was
    run again from its prompt plus those tokens (dropped here when ``o`` finishes); such a request's ``o`` gets
    that output's tokens, logprobs and text before its own, and its prompt."""
    prev = resumed.get(o.request_id)
    if prev is None:
        return o
    if o.finished:
        del resumed[o.request_id]
    c, p = o.outputs[0], prev.outputs[0]
    comp = dataclasses.replace(c, token_ids=list(p.token_ids) + list(c.token_ids),
                               logprobs=list(p.logprobs) + list(c.logprobs), text=p.text + c.text)
    return dataclasses.replace(o, prompt_token_ids=list(prev.prompt_token_ids), outputs=[comp])


def ended(last: Any, request_id: str, prompt: list, reason: str) -> Any:
    """The final output of a request ended here (``reason``: its finish reason): ``last`` (its latest output,
    or None: nothing streamed) finished, with nothing new."""
    from inferhal.core.engine.outputs import CompletionOutput, RequestOutput

    last = last or RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, "", [], None, [])])
    return dataclasses.replace(last, finished=True, new_token_ids=[], new_text="",
                               outputs=[dataclasses.replace(last.outputs[0], finish_reason=reason)])
