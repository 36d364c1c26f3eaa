"""The proposer contract: what every drafter (n-gram, MTP, a multi-stage head such as DSpark) implements,
and the registry that picks one by ``spec.method``. Adding a drafter is a module, a line in
:data:`PROPOSERS` and a ``conf/spec/NAME.yaml``: no engine code.

After every executed step the engine drives the drafter with plain data, in this order:

1. ``accept(request_id, num_drafts, num_accepted)`` for each request whose drafts were just verified:
   the drafter rolls its state of that request back to the accepted length.
2. ``prefill(step)``: every running request's positions that the target computed *exactly* this step
   (prompt chunks, replayed windows, the decode token and its accepted drafts; rejected drafts excluded),
   with the target's final hidden states when ``needs_hidden``. A drafter's exact state of a request
   always covers the target's ``num_computed_tokens``: prefill runs even while drafting is paused
   (``spec.disable_by_batch_size``), so a paged drafter's KV is cached and resumed like the target's.
3. ``propose(wants, kv)``: up to ``min(num_speculative_tokens, limit)`` drafts per request that decodes
   in the next step. Any draft is safe: the target verifies each one (``spec.verify``).
4. ``free(request_id)`` when a request finishes or is aborted (at once: a request that finishes in a step
   is freed before that step's prefill, which leaves it out).

Paged state: ``kv_groups()`` are extra KV groups that join the target's in the one
:class:`~inferhal.core.paging.kv_manager.KVCacheManager` (so they are allocated, freed, prefix-cached
and preempted with the request); ``num_lookahead_tokens`` asks the scheduler to allocate that many
positions past the step's last one (where chained drafts write); ``reads_next_token`` says the
drafter's state at position ``p`` depends on token ``p + 1`` (MTP), so a prefix hit gives up its last
block (whose last position was drafted from a token the new request may not share).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

from inferhal.core.config.schema import SpecConfig
from inferhal.core.errors import UserError
from inferhal.core.paging.spec import KVGroupSpec

#: spec.method → "module:class" (or the class) of a proposer with ``from_config(cfg, ctx) -> Proposer``
PROPOSERS: dict[str, Any] = {
    "ngram": "inferhal.core.spec.ngram:NgramProposer",
    "mtp": "inferhal.core.spec.mtp:MtpProposer",
    "suffix": "inferhal.core.spec.suffix:SuffixProposer",
}
METHODS = ("none", *PROPOSERS)


@dataclass(frozen=True)
class StepSeq:
    """One request's exactly computed part of a target step: positions ``[start, start + num_exact)``,
    whose hidden states are rows ``[row, row + num_exact)`` of :attr:`TargetStep.hidden`."""

    request_id: str
    start: int
    num_exact: int
    row: int
    token_ids: Sequence[int]  # the request's tokens now (prompt + output, this step's tokens included)
    block_ids: Mapping[str, Sequence[int]]
    num_rows: int = 0  # the step's rows of this request (its scheduled tokens, rejected drafts included; 0: unknown)


@dataclass(frozen=True)
class TargetStep:
    seqs: tuple[StepSeq, ...]
    hidden: Any = None  # the target's final hidden states of this step's tokens [T, ...] (needs_hidden only)
    kv: Any = None  # the KV storage (drafters with kv_groups write theirs)


@dataclass(frozen=True)
class DraftWant:
    """Drafts wanted for ``request_id``: at most ``limit`` (``max_tokens`` / ``max_model_len`` room)."""

    request_id: str
    token_ids: Sequence[int]
    limit: int
    block_ids: Mapping[str, Sequence[int]]


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may use, given once at engine start."""

    model: Any
    model_name: str
    block_size: int
    device: Any
    max_model_len: int


@runtime_checkable
class Proposer(Protocol):
    num_speculative_tokens: int
    needs_hidden: bool
    num_lookahead_tokens: int
    reads_next_token: bool

    def kv_groups(self) -> Sequence[KVGroupSpec]: ...

    def accept(self, request_id: str, num_drafts: int, num_accepted: int) -> None: ...

    def prefill(self, step: TargetStep) -> None: ...

    def propose(self, wants: Sequence[DraftWant], kv: Any = None) -> dict[str, list[int]]: ...

    def free(self, request_id: str) -> None: ...


def check_spec_config(cfg: SpecConfig) -> None:
    """Raise :class:`UserError` naming the field when ``cfg`` cannot run with any model (model-specific
    checks, e.g. MTP weights, are the proposer's ``from_config``)."""
    if cfg.method != "none" and cfg.method not in PROPOSERS:
        raise UserError(f"spec.method must be one of {('none', *PROPOSERS)}, got {cfg.method!r}")
    for f in fields(cfg):  # spec.suffix_*: read by the suffix drafter only
        if f.name.startswith("suffix_") and cfg.method != "suffix" and getattr(cfg, f.name) != f.default:
            raise UserError(f"spec.{f.name}={getattr(cfg, f.name)} is read by spec.method=suffix only, "
                            f"not {cfg.method}; set spec=suffix or leave it out")
    if cfg.method == "none":
        if cfg.num_speculative_tokens:
            raise UserError(f"spec.num_speculative_tokens={cfg.num_speculative_tokens} has no effect with "
                            f"spec.method=none; set spec.method=ngram (or spec=ngram) to draft tokens")
        return
    if cfg.num_speculative_tokens < 1:
        raise UserError(f"spec.method={cfg.method} needs spec.num_speculative_tokens >= 1, "
                        f"got {cfg.num_speculative_tokens}")
    if cfg.disable_by_batch_size < 0:
        raise UserError(f"spec.disable_by_batch_size must be >= 0 (0: always draft), got {cfg.disable_by_batch_size}")
    cls = _proposer_class(cfg.method)
    check = getattr(cls, "check_config", None)
    if check is not None:
        check(cfg)


def _proposer_class(method: str) -> Any:
    if not isinstance(PROPOSERS[method], str):
        return PROPOSERS[method]
    mod, _, name = PROPOSERS[method].partition(":")
    return getattr(importlib.import_module(mod), name)


def make_proposer(cfg: SpecConfig, ctx: DraftContext) -> Optional[Proposer]:
    """The drafter ``cfg`` selects, or None for ``spec.method=none``."""
    check_spec_config(cfg)
    if cfg.method == "none":
        return None
    return _proposer_class(cfg.method).from_config(cfg, ctx)
