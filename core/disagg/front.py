"""What the router knows of the model, without its weights: the tokenizer and the limits its instances sent
at hello (:func:`~.instance.hello`). :class:`Front` validates a request as an engine's
:meth:`~inferhal.core.engine.engine.Engine.make_request` does (the prompt, ``max_model_len``, the KV pool's
room, a structured-output constraint compiled), so a bad request is a 400 at the router and never reaches
an instance (the prompt checks are the scheduler's own :func:`~inferhal.core.scheduler.scheduler.check_length`)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any, Hashable, Optional

from inferhal.core.engine.engine import Engine
from inferhal.core.sampling.params import SamplingParams
from inferhal.core.scheduler.request import Request
from inferhal.core.scheduler.scheduler import RequestError, check_length


class Front:
    """An engine's request-facing half (tokenizer, limits, validation); it runs nothing."""

    #: Engine's own text handling and grammar compiler, over this object's tokenizer and vocabulary
    encode = Engine.encode
    check_params = Engine.check_params
    grammars = Engine.grammars

    def __init__(self, tokenizer: Any, limits: dict) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = int(limits["max_model_len"])
        self.model = SimpleNamespace(vocab_size=int(limits["vocab_size"]))
        self.eos_token_ids = tuple(limits["eos_token_ids"])
        self.chunked_prefill = bool(limits["chunked_prefill"])
        self.max_num_batched_tokens = int(limits["max_num_batched_tokens"])
        self.capacity_tokens = int(limits["capacity_tokens"])
        self._grammars = None
        self._ids = itertools.count()

    def tighten(self, limits: dict) -> None:
        """Another instance's limits: a request must fit every instance it may be placed on."""
        self.capacity_tokens = min(self.capacity_tokens, int(limits["capacity_tokens"]))

    def make_request(self, prompt: Any, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                     extra_keys: tuple[Hashable, ...] = ()) -> Request:
        params = self.check_params(params)
        _, ids = self.encode(prompt)
        rid = f"r{next(self._ids)}" if request_id is None else str(request_id)
        req = Request(rid, ids, params, eos_token_ids=self.eos_token_ids, extra_keys=tuple(extra_keys))
        total = check_length(req, self.max_model_len, self.chunked_prefill, self.max_num_batched_tokens)
        if total > self.capacity_tokens:
            raise RequestError(f"request {rid!r}: {total} tokens do not fit the KV pool of every instance (at most "
                               f"{self.capacity_tokens}); lower max_tokens, or raise cache.kv_cache_bytes (or "
                               f"cache.num_blocks) on the instances")
        if params.structured is not None:  # compiled here: an invalid schema is this request's error only
            req.grammar = self.grammars().matcher(params.structured)
        return req

