"""What the scheduler hands the model runner each step: the whole contract between them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """Compute ``num_new`` tokens of ``request_id`` after ``num_computed``; ``sample`` when this step
    reaches the end of its known tokens (so a next token is drawn). ``block_ids[group]`` is the block
    table (-1 for released blocks), valid until the next :meth:`Scheduler.schedule`.

    A decode step with drafts feeds the last known token then ``spec_token_ids`` (``num_new = 1 + len``);
    every one of those positions is verified, and the step yields 1 to ``len + 1`` tokens."""

    request_id: str
    num_computed: int
    num_new: int
    token_ids: Sequence[int]  # the num_new token ids to feed
    block_ids: Mapping[str, Sequence[int]]
    sample: bool
    spec_token_ids: Sequence[int] = ()
    write_from: int = 0  # tokens below it are a bounded replay: they rebuild only the sliding groups' KV


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]
    num_scheduled_tokens: int
    preempted: tuple[str, ...] = ()
    num_running: int = 0
    num_waiting: int = 0
    stats: Mapping[str, float] = field(default_factory=dict)
    #: two-batch overlap: the sequences of each micro-batch, consecutive in ``seqs`` (() = one batch)
    micro_batches: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.seqs
