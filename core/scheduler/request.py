"""A request as the scheduler sees it: token ids, progress, status. Plain data, no tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

from inferhal.core.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """``all_token_ids`` = prompt + output. ``num_computed_tokens`` have KV in the cache (or are being
    replayed). ``finish_reason`` is ``stop`` (EOS, a stop token or a stop string), ``length``
    (``max_tokens`` or ``max_model_len``), ``grammar_dead_end`` (a structured-output grammar allowed no token) or
    ``abort``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0  # order of arrival (FCFS key and priority tie-break)
    eos_token_ids: tuple[int, ...] = ()
    extra_keys: tuple[Hashable, ...] = ()  # prefix-cache keys beyond the tokens (LoRA, mm hashes, salt)
    session: Optional[str] = None  # a client's session key (server: prompt_cache_key / X-Session-Id; DP placement)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the first admission
    num_preemptions: int = 0
    num_replayed_tokens: int = 0  # tokens recomputed by bounded sliding-window replay
    preempted_at: int = 0  # num_computed_tokens when last preempted
    write_from: int = 0  # a replay below this many tokens rebuilds only the sliding groups (cached KV above)
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    generator: Any = None  # torch.Generator for sampling, owned by the engine
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next decode step
    num_pending: int = 0  # tokens a step in flight samples, at most (asynchronous scheduling; drafts: all stand)
    num_pending_drafts: int = 0  # of which drafts (placeholders): num_computed_tokens is that much too far, at most
    num_draft_tokens: int = 0  # drafts verified for this request so far
    num_accepted_tokens: int = 0  # of which accepted
    grammar: Any = None  # structured outputs: the request's matcher (core/structured/grammar.py), owned by the runner

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
