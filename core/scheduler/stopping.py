"""When a request ends, decided in one place: token by token, as :meth:`Scheduler.update` appends them.

After each appended token, in this order: a structured-output grammar that allowed no token at that position
(``grammar_dead_end``: the output is as far as the constraint could go), an end-of-sequence token (unless
``ignore_eos``) or a stop token (``stop``), a stop string in the output's text (``stop``: the tokens end with
the first one whose text holds it, as decoding one token a step would), ``max_tokens`` or ``max_model_len``
(``length``). The first reason ends the request there: tokens a step emitted after it (accepted drafts) are
dropped. Ends from outside the tokens (an abort, a hand-off to a decode instance) are the scheduler's
``finish``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence


class StopChecker:
    def __init__(self, max_model_len: int, decode: Optional[Callable[[Sequence[int]], str]] = None) -> None:
        """``decode``: token ids → text, for stop strings (None: a model without a tokenizer, whose requests
        cannot carry stop strings)."""
        self.max_model_len, self.decode = int(max_model_len), decode

    def reason(self, req: Any, dead: bool = False) -> Optional[str]:
        """Why ``req`` ends with the token just appended (``dead``: its grammar allowed no token there), or None."""
        p, tok = req.params, req.all_token_ids[-1]
        if dead:
            return "grammar_dead_end"
        if (not p.ignore_eos and tok in req.eos_token_ids) or tok in p.stop_token_ids:
            return "stop"
        if p.stop and self.decode is not None:
            text = self.decode(req.output_token_ids)
            if any(s in text for s in p.stop):
                return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None
