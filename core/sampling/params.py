"""``SamplingParams``: what one request asks of the sampler and of the stopping rules.

Validated at construction: an unknown field, ``max_tokens < 1`` or an out-of-range value raises
:class:`SamplingParamsError` (a ``ValueError`` and a :class:`~inferhal.core.errors.UserError`) that
names the field.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from inferhal.core.errors import UserError


class SamplingParamsError(UserError, ValueError):
    """A sampling field is unknown or out of range; the message names it."""


#: the lowest temperature sampled at: a lower positive one is raised to it (vLLM's ``_MAX_TEMP``, which it
#: raises such temperatures to as well); below it the logits' quotient can overflow to infinity
MIN_TEMPERATURE = 1e-2
#: the seeds a torch generator takes (``manual_seed``: a signed or unsigned 64-bit integer)
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1


@dataclass
class SamplingParams:
    """``temperature == 0`` is greedy. ``top_k`` 0 or -1 and ``top_p`` 1.0 are off. ``seed`` gives the
    request its own generator (output independent of the batch); without one a seeded request still
    gets its own generator, seeded from the engine seed and the request's arrival order.
    ``logprobs = k`` returns the top-k log-probabilities of every generated position.
    A temperature in (0, :data:`MIN_TEMPERATURE`) samples at :data:`MIN_TEMPERATURE`.
    ``priority``: lower runs first under ``scheduler.policy=priority``. ``structured``: a constraint on the
    output (:class:`~inferhal.core.structured.params.StructuredOutputs`, or a mapping such as
    ``{"json": schema}``, ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ebnf}``,
    ``{"json_object": True}``): every sampled token keeps the output inside the grammar (xgrammar)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int = 0
    ignore_eos: bool = False
    priority: int = 0
    structured: Optional[Any] = None

    def __post_init__(self) -> None:
        from inferhal.core.structured.params import StructuredOutputs

        self.structured = StructuredOutputs.coerce(self.structured)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.stop is None or isinstance(self.stop, (list, tuple)), "stop",
               f"must be a string or a list of strings, got {type(self.stop).__name__}")
        self.stop = list(self.stop or [])
        ids = [_token_id(t) for t in self.stop_token_ids] if isinstance(self.stop_token_ids, (list, tuple)) else None
        _check(self.stop_token_ids is None or (ids is not None and None not in ids), "stop_token_ids",
               f"must be a list of integer token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids or []
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed",
               f"must be an integer or None, got {self.seed!r}")
        _check(self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed",  # what a torch generator takes
               f"must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_real(self.temperature) and self.temperature >= 0.0, "temperature", f"must be a number >= 0, got {self.temperature!r}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # logits / 1e-300 overflow to inf and the softmax gives NaN
            self.temperature = MIN_TEMPERATURE
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        _check(_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        _check(_real(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        _check(isinstance(self.logprobs, int) and self.logprobs >= 0, "logprobs", f"must be an integer >= 0, got {self.logprobs!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_config(cls, cfg) -> "SamplingParams":
        """From a ``sampling`` config node (:class:`~inferhal.core.config.schema.SamplingConfig`)."""
        from omegaconf import DictConfig, ListConfig, OmegaConf

        names = {f.name for f in dataclasses.fields(cls)}
        plain = {k: OmegaConf.to_container(v) if isinstance(v, (DictConfig, ListConfig)) else v
                 for k, v in dict(cfg).items()}
        return cls(**{k: (list(v) if isinstance(v, Sequence) and not isinstance(v, str) else v)
                      for k, v in plain.items() if k in names})


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _token_id(t: Any) -> Optional[int]:
    """An integer token id from an int (numpy's too) or its decimal text; None for anything else (1.5)."""
    try:
        return int(t) if isinstance(t, str) else operator.index(t)
    except (TypeError, ValueError):
        return None


#: SamplingParams' field names, in order
FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_dataclass_init = SamplingParams.__init__


def name_unknown(unknown: Sequence[str], known: Sequence[str]) -> str:
    """``'k' (did you mean 'x'?), ...`` for each unknown key, with the closest known name where one is close."""
    import difflib

    return ", ".join(f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, known, n=1)) else repr(k)
                     for k in unknown)


def _init(self, *args, **kwargs):
    unknown = [k for k in kwargs if k not in FIELDS]
    if unknown:
        raise SamplingParamsError(f"unknown sampling field(s) {name_unknown(unknown, FIELDS)}; valid fields: "
                                  f"{', '.join(FIELDS)}")
    if len(args) > len(FIELDS):
        raise SamplingParamsError(f"SamplingParams takes at most {len(FIELDS)} positional arguments")
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init  # type: ignore[method-assign]


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise SamplingParamsError(f"SamplingParams.{name} {msg}")
