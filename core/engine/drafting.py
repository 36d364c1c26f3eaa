"""The engine's side of speculative decoding: driving the drafter (``spec.method``) between steps.

Synchronously (:meth:`Drafting.after_update`), in the order of :mod:`inferhal.core.spec.proposer`: accept,
prefill every running request's exact positions of the step, free the finished, then drafts for the next step
of every request that got tokens and decodes on, capped so no draft lies past ``max_tokens`` or
``max_model_len`` (the verifier's own token always comes on top). No drafts while
``spec.disable_by_batch_size`` or more requests run: verifying drafts costs rows, and on a busy batch
(compute-bound products) more than the accepted tokens give back.

With asynchronous scheduling the drafter runs on the step thread instead (the runner's, see
core/engine/runner.py), which needs to know the requests that ended since its last step and the tokens of
each request new to a step: :meth:`submit_extra` gives them, and :meth:`release` frees what ended while no
step is in flight.
"""

from __future__ import annotations

from typing import Any, Sequence

from inferhal.core.spec.proposer import DraftWant, StepSeq, TargetStep


class Drafting:
    def __init__(self, proposer: Any, kv_manager: Any, kv_storage: Any, max_model_len: int, off_at: int | None,
                 on_step_thread: bool, runner: Any) -> None:
        self.proposer, self.kv_manager, self.kv_storage = proposer, kv_manager, kv_storage
        self.max_model_len, self.off_at = max_model_len, off_at
        self.on_step_thread, self.runner = on_step_thread, runner
        self._free: list[str] = []  # requests ended since the last submitted step (on_step_thread)
        self._submitted: set[str] = set()  # the requests of the last submitted step (on_step_thread)

    def submit_extra(self, out: Any, requests: dict) -> dict:
        """The runner's extra arguments for step ``out`` (on the step thread: the requests ended since, and the
        tokens of each request that was not in the step before; the step thread tracks the others itself)."""
        if not self.on_step_thread:
            return {}
        tokens = {s.request_id: list(requests[s.request_id].all_token_ids) for s in out.seqs
                  if s.request_id not in self._submitted}
        self._submitted = {s.request_id for s in out.seqs}
        free, self._free = tuple(self._free), []
        return {"free": free, "tokens": tokens}

    def ended(self, request_ids: Sequence[str], in_flight: bool) -> None:
        """Requests that ended outside a step's update (aborts): their drafter state freed now, or on the step
        thread before its next step."""
        if self.on_step_thread:
            self._free.extend(request_ids)
            self._submitted.difference_update(request_ids)  # a later request with one of these ids sends its tokens
            if not in_flight:
                self.release()
        else:
            for rid in request_ids:
                self.proposer.free(rid)

    def caught_up(self) -> None:
        """Every step was folded in (none in flight): the next one is scheduled from every step's tokens."""
        if self.on_step_thread:
            self.runner.caught_up()

    def release(self) -> None:
        """No step in flight: free on this thread what the step thread would have freed."""
        if self.on_step_thread and self._free:
            self.runner.release(self._free)
            self._free = []

    def after_update(self, out: Any, hidden: Any, changed: Sequence[Any], requests: dict, num_running: int) -> None:
        """A step folded in: drive the drafter (synchronous), or queue the finished for the step thread."""
        if self.on_step_thread:
            ended = [r.request_id for r in changed if r.is_finished]
            self._free.extend(ended)
            self._submitted.difference_update(ended)
            return
        prop = self.proposer
        seqs, row = [], 0
        for s in out.seqs:
            r = requests.get(s.request_id)
            if s.spec_token_ids and r is not None:
                known = s.num_new - len(s.spec_token_ids)
                prop.accept(s.request_id, len(s.spec_token_ids), r.num_computed_tokens - s.num_computed - known)
            if r is not None and not r.is_finished and r.num_computed_tokens > s.num_computed:
                seqs.append(StepSeq(s.request_id, s.num_computed, r.num_computed_tokens - s.num_computed, row,
                                    r.all_token_ids, self.kv_manager.block_ids(s.request_id), s.num_new))
            row += s.num_new
        for r in changed:
            if r.is_finished:
                prop.free(r.request_id)
        step = TargetStep(tuple(seqs), hidden, self.kv_storage)
        wants: list[DraftWant] | None = None if self.off_at and num_running >= self.off_at else []
        for r in changed if wants is not None else ():
            if r.is_finished or r.num_tokens - r.num_computed_tokens != 1:
                continue
            left = min(r.params.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens)
            wants.append(DraftWant(r.request_id, r.all_token_ids, left - 1, self.kv_manager.block_ids(r.request_id)))
        if hasattr(prop, "prefill_and_propose"):  # MTP: one draft graph replay where it can (core/spec/mtp_graph.py)
            drafts = prop.prefill_and_propose(step, wants, self.kv_storage)
        else:
            prop.prefill(step)
            drafts = {} if wants is None else prop.propose(wants, self.kv_storage)
        for rid, got in drafts.items():
            requests[rid].spec_token_ids = list(got)
