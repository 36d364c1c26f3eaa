"""Input processing: a prompt and its settings → a checked :class:`~inferhal.core.scheduler.request.Request`
(tokenised, checked against the model and the KV pool, its structured-output grammar compiled), before it
touches any engine state. Bad input raises :class:`~inferhal.core.scheduler.scheduler.RequestError` or
:class:`~inferhal.core.sampling.params.SamplingParamsError` (both ``ValueError`` and ``UserError``) for that
request only."""

from __future__ import annotations

import itertools
import operator
from typing import Any, Hashable, Optional, Sequence, Union

from inferhal.core.sampling.params import SamplingParams, SamplingParamsError
from inferhal.core.scheduler.request import Request
from inferhal.core.scheduler.scheduler import RequestError

Prompt = Union[str, Sequence[int]]


class Intake:
    def __init__(self, model: Any, tokenizer: Any, scheduler: Any, eos_token_ids: Sequence[int],
                 id_prefix: str = "") -> None:
        """``model``: its ``vocab_size``; ``scheduler``: its ``check_request(req)`` (the request fits);
        ``id_prefix``: of the ids it draws for requests that come without one."""
        self.model, self.tokenizer, self.scheduler = model, tokenizer, scheduler
        self.eos_token_ids, self.id_prefix = tuple(eos_token_ids), id_prefix
        self._ids = itertools.count()
        self._grammars = None  # the structured-output grammar compiler, built on first use (grammars())

    def encode(self, prompt: Prompt) -> tuple[Optional[str], list[int]]:
        """``(the prompt's text or None, its token ids)``."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty: pass some text (or token ids)")
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: pass token-id lists instead of strings")
            return prompt, list(self.tokenizer.encode(prompt))
        try:
            ids = [operator.index(t) for t in prompt]  # ints only: 1.5 or "7" is not a token id
        except TypeError:
            what = type(prompt).__name__ if not isinstance(prompt, (list, tuple)) else "a list holding " + ", ".join(
                sorted({type(t).__name__ for t in prompt if not isinstance(t, int)}))
            raise RequestError(f"a prompt must be a string or a list of integer token ids, got {what}") from None
        bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.model.vocab_size})")
        return None, ids

    def check_params(self, params: Optional[SamplingParams]) -> SamplingParams:
        """A request's sampling settings (None: the defaults), checked against this model."""
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise SamplingParamsError(f"expected SamplingParams, got {type(params).__name__}")
        if params.logprobs > self.model.vocab_size:
            raise SamplingParamsError(f"SamplingParams.logprobs={params.logprobs} asks for more log-probabilities than "
                                      f"the vocabulary has tokens ({self.model.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise SamplingParamsError("SamplingParams.stop needs the model's tokenizer to read the text; this model "
                                      "has none (use stop_token_ids)")
        return params

    def make_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                     request_id: Optional[str] = None, extra_keys: tuple[Hashable, ...] = ()) -> tuple[Request, Optional[str]]:
        """``(the checked request, its prompt text or None)``; nothing is added anywhere."""
        params = self.check_params(params)
        text, ids = self.encode(prompt)
        rid = f"{self.id_prefix}{next(self._ids)}" if request_id is None else str(request_id)
        req = Request(rid, ids, params, eos_token_ids=self.eos_token_ids, extra_keys=tuple(extra_keys))
        self.scheduler.check_request(req)
        if params.structured is not None:  # compiled (cached per constraint) before the request is queued
            req.grammar = self.grammars().matcher(params.structured)
        return req, text

    def grammars(self):
        """The structured-output grammar compiler of this tokenizer and vocabulary (built once)."""
        if self._grammars is None:
            from inferhal.core.structured.grammar import GrammarCompiler

            if self.tokenizer is None:
                raise RequestError("structured outputs need the model's tokenizer; this model has none")
            self._grammars = GrammarCompiler(self.tokenizer, int(self.model.vocab_size), self.eos_token_ids)
        return self._grammars
