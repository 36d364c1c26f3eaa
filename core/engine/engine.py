"""The engine: owns the scheduler, the KV pool and the model runner; ``step()`` = schedule → execute → update.

Construct it from a prebuilt :class:`~inferhal.core.models.base.LoadedModel` and an
:class:`~inferhal.core.registry.ActiveBackend` (what tests and other helpers do), or through
:class:`~inferhal.core.engine.llm.LLM`, which composes the config and loads the model.

Bad input raises for that request only, in :meth:`Engine.add_request`, before the request touches any
state (:class:`~inferhal.core.scheduler.scheduler.RequestError` or
:class:`~inferhal.core.sampling.params.SamplingParamsError`, both ``ValueError`` and ``UserError``);
every other request goes on untouched.
"""

from __future__ import annotations

import collections
import itertools
import operator
import time
from typing import Any, Hashable, Iterable, Optional, Sequence, Union

import torch

from inferhal.core.config.schema import CacheConfig, SchedulerConfig, SpecConfig
from inferhal.core.engine.executor import StepExecutor
from inferhal.core.engine.outputs import CompletionOutput, RequestOutput
from inferhal.core.engine.runner import ModelRunner
from inferhal.core.errors import UserError
from inferhal.core.models.base import LoadedModel
from inferhal.core.paging import formats, planning
from inferhal.core.paging.kv_manager import KVCacheManager
from inferhal.core.sampling.params import SamplingParams, SamplingParamsError
from inferhal.core.scheduler.request import Request
from inferhal.core.scheduler.scheduler import NoRoomNow, RequestError, Scheduler
from inferhal.core.spec.proposer import DraftContext, DraftWant, StepSeq, TargetStep, make_proposer

Prompt = Union[str, Sequence[int]]
ROLES = ("any", "prefill", "decode")


def plan_num_blocks(specs, block_size: int, cache: CacheConfig, device: Any, scheduler: SchedulerConfig,
                    max_model_len: int) -> dict[str, int]:
    """Blocks of each group's pool: ``cache.num_blocks`` each, else a split of ``cache.kv_cache_bytes``,
    else of a ``cache.memory_fraction`` of free device memory (capped by ``cache.auto_kv_cap_bytes``);
    :func:`~inferhal.core.paging.planning.blocks_for_budget` splits a budget."""
    if cache.num_blocks > 0:
        return {s.name: int(cache.num_blocks) for s in specs}
    if cache.kv_cache_bytes > 0:
        budget = int(cache.kv_cache_bytes)
    else:
        free = int(device.memory_stats().get("free", 0)) if hasattr(device, "memory_stats") else 0
        budget = int(free * cache.memory_fraction)
        if cache.auto_kv_cap_bytes > 0:
            budget = min(budget, cache.auto_kv_cap_bytes)
    return planning.blocks_for_budget(specs, block_size, budget, scheduler.max_num_seqs,
                                      scheduler.max_num_batched_tokens, max_model_len)


class Engine:
    def __init__(self, loaded: LoadedModel, backend: Any, scheduler: SchedulerConfig | None = None,
                 cache: CacheConfig | None = None, max_model_len: Optional[int] = None, seed: int = 0,
                 spec: SpecConfig | None = None, deterministic: bool = False, role: str = "any") -> None:
        scheduler = scheduler or SchedulerConfig()
        cache = cache or CacheConfig()
        spec = spec or SpecConfig()
        self.spec_off_at = spec.disable_by_batch_size or None  # running requests at which drafting pauses
        self.spec_method = spec.method
        self.loaded, self.backend = loaded, backend
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.max_model_len = int(self.model.max_model_len if max_model_len is None else max_model_len)
        if self.max_model_len < 2:  # also refused at compose (config/refusals.py: RANGES)
            raise UserError(f"model.max_model_len must be >= 2 (one prompt token and one generated token), "
                            f"got {self.max_model_len}")
        # the model stores its KV as cache.kv_dtype (FP8/FP4 records refused where the backend cannot read them)
        formats.apply_kv_dtype(self.model, getattr(backend, "name", "?"), getattr(backend, "profile", None),
                               cache.kv_dtype)
        bs = cache.block_size
        # the drafter (spec.method; None: no drafts), its own KV groups beside the model's
        self.proposer = make_proposer(spec, DraftContext(self.model, loaded.name, bs, getattr(
            backend.device, "torch_device", "cpu"), self.max_model_len))
        self.specs = tuple(self.model.kv_groups()) + tuple(self.proposer.kv_groups() if self.proposer else ())
        need = planning.compatible_block_size(self.specs, bs)
        if need != bs:
            raise UserError(f"cache.block_size={bs} is not a multiple of every KV group's tokens_per_slot; "
                            f"use cache.block_size={need}")
        num_blocks = plan_num_blocks(self.specs, bs, cache, backend.device, scheduler, self.max_model_len)
        planning.check_budget(self.specs, bs, num_blocks)
        self.kv_manager = KVCacheManager(self.specs, bs, num_blocks, cache.enable_prefix_caching)
        self.kv_storage = backend.kv_storage(planning.storage_request(self.specs, bs, num_blocks))
        self.scheduler = Scheduler(scheduler, self.kv_manager, self.max_model_len)
        self.device = torch.device(getattr(backend.device, "torch_device", "cpu"))
        self.runner = ModelRunner(self.model, backend.ops, self.kv_storage, self.specs, bs, self.device)
        self.runner.eos_token_ids = self.eos_token_ids
        self.runner.graphs = self._decode_graphs(backend)
        self.executor = StepExecutor(self.runner, scheduler.async_scheduling)
        # asynchronous scheduling with a drafter: the drafter runs on the step thread (it needs the step in
        # flight's tokens), and the host schedules placeholders for its drafts (see core/engine/runner.py)
        self.runner_drafts = scheduler.async_scheduling and self.proposer is not None
        self._free: list[str] = []  # requests ended since the last submitted step (runner_drafts)
        self._submitted: set[str] = set()  # the requests of the last submitted step (runner_drafts)
        if self.proposer is not None:
            self.runner.keep_hidden = self.proposer.needs_hidden
            self.scheduler.num_lookahead_tokens = self.proposer.num_lookahead_tokens
            self.scheduler.trim_prefix_hit = self.proposer.reads_next_token
        if self.runner_drafts:
            self.runner.proposer, self.runner.max_model_len = self.proposer, self.max_model_len
            self.scheduler.num_placeholder_drafts = self.proposer.num_speculative_tokens
            self.scheduler.spec_off_at = self.spec_off_at
        self.seed = seed
        # prefill/decode disaggregation (core/disagg): a prefill engine hands each request off once its first
        # token is sampled (take_handoffs); a decode engine also adopts requests prefilled elsewhere
        if role not in ROLES:
            raise UserError(f"parallel.role must be one of {', '.join(ROLES)}, got {role!r}")
        if role == "prefill" and scheduler.async_scheduling:
            raise UserError("parallel.role=prefill runs with scheduler.async_scheduling=false (a request's KV is "
                            "read for its hand-off right after the step that sampled its first token)")
        self.role = role
        self._handoffs: list = []
        self.keep_local: set[str] = set()  # prefill role: requests decoded here all the same (a hand-off failed)
        self._transfers: collections.deque = collections.deque()
        self._grammars = None  # the structured-output grammar compiler, built on first use (grammars())
        self.deterministic = deterministic  # unseeded sampled requests all draw from `seed` (not their arrival)
        self.stream_text = False  # decode text on every step (streaming) or only when a request finishes
        # called as hook(engine) at the end of every step(), in order (e.g. core/parallel's EP rank sync
        # and EPLB rebalance); an exception from a hook propagates out of step()
        self.step_hooks: list = []
        self._ids = itertools.count()
        self._prompts: dict[str, Optional[str]] = {}
        self._logprobs: dict[str, list[dict[int, float]]] = {}
        self._sent: dict[str, int] = {}  # tokens already reported (streaming deltas)
        self._text: dict[str, str] = {}
        self.stats = {"steps": 0, "schedule_s": 0.0, "prepare_s": 0.0, "model_s": 0.0, "sample_s": 0.0,
                      "mask_s": 0.0,  # structured-output bitmasks: the part the step waited out, in sample_s
                      "fill_s": 0.0,  # structured-output bitmasks filled on the side while the model ran
                      "update_s": 0.0, "tokens": 0, "draft_tokens": 0, "accepted_tokens": 0,
                      "drafted_at": [], "accepted_at": [],  # [i]: steps that verified / accepted draft i
                      "device_busy_s": 0.0, "device_gap_s": 0.0}  # the runner's steps, the host time between them

    def _decode_graphs(self, backend: Any) -> Any:
        """Decode steps through the backend's graph runner (``backend.graphs``), or None: the backend has none
        (the CPU backends, an interpreter), or graphs are off."""
        cfg = getattr(backend, "config", None)
        if cfg is None or not getattr(cfg, "graphs", True):
            return None
        from inferhal.core.engine.graphs import DecodeGraphs, check_sizes

        sizes = check_sizes(cfg.graph_batch_sizes)
        runner = backend.graph_runner() if hasattr(backend, "graph_runner") else None
        if runner is None:
            return None
        return DecodeGraphs(runner, self.model, self.specs, self.kv_manager.block_size, self.max_model_len, sizes,
                            self.kv_storage)

    # ------------------------------------------------------------------ requests

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(getattr(self.tokenizer, "eos_token_ids", ()) or ()) if self.tokenizer else ()

    def encode(self, prompt: Prompt) -> tuple[Optional[str], list[int]]:
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
        return params

    def make_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                     extra_keys: tuple[Hashable, ...] = ()) -> Request:
        """Build and validate a request without adding it (raises RequestError / SamplingParamsError)."""
        params = self.check_params(params)
        text, ids = self.encode(prompt)
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        req = Request(rid, ids, params, eos_token_ids=self.eos_token_ids, extra_keys=tuple(extra_keys))
        self.scheduler.check_request(req)
        if params.structured is not None:  # compiled (cached per constraint) before the request is queued
            req.grammar = self.grammars().matcher(params.structured)
        self._prompts[rid] = text
        return req

    def discard(self, request_id: str) -> None:
        """Forget a request made by :meth:`make_request` but never added (e.g. one checked here and run
        elsewhere): nothing of it stays."""
        self._prompts.pop(str(request_id), None)

    def grammars(self):
        """The structured-output grammar compiler of this engine's tokenizer and vocabulary (built once)."""
        if self._grammars is None:
            from inferhal.core.structured.grammar import GrammarCompiler

            if self.tokenizer is None:
                raise RequestError("structured outputs need the model's tokenizer; this model has none")
            self._grammars = GrammarCompiler(self.tokenizer, int(self.model.vocab_size), self.eos_token_ids)
        return self._grammars

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                    extra_keys: tuple[Hashable, ...] = ()) -> str:
        return self.add(self.make_request(prompt, params, request_id, extra_keys))

    def add(self, req: Request) -> str:
        self.scheduler.add_request(req)
        if req.params.temperature > 0:
            seed = req.params.seed if req.params.seed is not None else (
                self.seed if self.deterministic else self.seed * 1_000_003 + req.arrival)
            req.generator = torch.Generator(device=self.device).manual_seed(int(seed))
        self._logprobs[req.request_id] = []
        self._sent[req.request_id] = 0
        return req.request_id

    # ------------------------------------------------------------------ disaggregation (core/disagg)

    def take_handoffs(self) -> list:
        """Prefill role: the requests handed off since the last call (:class:`~inferhal.core.disagg.connector.KVPayload`),
        for a connector to send to a decode instance."""
        out, self._handoffs = self._handoffs, []
        return out

    def add_transferred(self, payload: Any) -> str:
        """Decode side: adopt a request prefilled elsewhere. It joins the running batch now, or at the first
        step where a sequence slot and its blocks are free (it waits here, in arrival order). A request this
        engine can never run raises :class:`RequestError` (nothing changed)."""
        st = payload.state
        rid = str(st["request_id"])
        if self._transfers or not self._try_adopt(payload):
            if any(str(p.state["request_id"]) == rid for p in self._transfers):
                raise RequestError(f"request id {rid!r} is already in use")
            self.make_request(st["prompt_token_ids"], SamplingParams(**st["params"]), rid)  # checks, or raises
            self.discard(rid)
            self._transfers.append(payload)
        return rid

    def _try_adopt(self, payload: Any) -> bool:
        from inferhal.core.disagg.handoff import import_request

        try:
            import_request(self, payload)
        except NoRoomNow:
            self.discard(str(payload.state["request_id"]))
            return False
        return True

    def _adopt_transfers(self) -> None:
        while self._transfers and self._try_adopt(self._transfers[0]):
            self._transfers.popleft()

    def adopted(self, req: Request, generator_state: Any, logprobs: list) -> None:
        """Bookkeeping for a request the scheduler adopted (:func:`~inferhal.core.disagg.handoff.import_request`)."""
        if req.params.temperature > 0:
            req.generator = torch.Generator(device=self.device)
            if generator_state is not None:
                req.generator.set_state(generator_state)
            else:
                req.generator.manual_seed(int(req.params.seed if req.params.seed is not None else self.seed))
        self._logprobs[req.request_id] = list(logprobs)
        self._sent[req.request_id] = req.num_output_tokens  # the prefill side streamed those

    def _hand_off(self, changed: Sequence[Request]) -> None:
        from inferhal.core.disagg.handoff import export_request

        for r in changed:
            if r.is_finished:
                self.keep_local.discard(r.request_id)
            if r.is_finished or r.num_output_tokens < 1 or r.request_id in self.keep_local:
                continue
            self._handoffs.append(export_request(self, r, self._logprobs.get(r.request_id)))
            if self.proposer is not None:
                self.proposer.free(r.request_id)
            self.scheduler.finish([r.request_id], "transferred")

    def transfers_waiting(self) -> list[str]:
        """Decode side: the ids of requests handed here (:meth:`add_transferred`) still waiting for room."""
        return [str(p.state["request_id"]) for p in self._transfers]

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort these requests: running or waiting in the scheduler (their outputs, finish reason ``abort``),
        or handed here and still waiting for room (dropped before anything was allocated for them)."""
        request_ids = list(request_ids)
        if self._transfers:
            gone = set(request_ids)
            self._transfers = collections.deque(p for p in self._transfers if str(p.state["request_id"]) not in gone)
        done = self.scheduler.abort(request_ids)
        if self.runner_drafts:  # the drafter is the step thread's: freed before its next step, or now if idle
            self._free.extend(r.request_id for r in done)
            if not self.executor.in_flight:
                self.runner.release(self._free)
                self._free = []
        elif self.proposer is not None:
            for r in done:
                self.proposer.free(r.request_id)
        return [self._output(r) for r in done]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._transfers)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One iteration; → an output for every request that received a token or finished. With
        ``scheduler.async_scheduling`` it schedules and submits step N+1, then folds in step N (one step
        late), so the device runs N+1 while the host updates N and schedules N+2."""
        t0 = time.perf_counter()
        if self._transfers:
            self._adopt_transfers()
        ex = self.executor
        if ex.asynchronous:
            if not ex.in_flight:  # prime the pipeline
                self._submit(self.scheduler.schedule())
            self._submit(self.scheduler.schedule())  # step N+1, while step N runs
            t1 = time.perf_counter()
            if not ex.in_flight:
                ex.idle()
                return []
            out, res = ex.result()
        else:
            out = self.scheduler.schedule()
            t1 = time.perf_counter()
            res = ex.run(out, self.scheduler.requests)
        t2 = time.perf_counter()
        before = {s.request_id: self.scheduler.requests[s.request_id].num_output_tokens
                  for s in out.seqs if s.sample and s.request_id in self.scheduler.requests}
        changed = self.scheduler.update(out, res.tokens, res.drafts)
        for rid, lp in res.logprobs.items():
            if rid not in self._logprobs:
                continue  # finished before this step was folded in (asynchronous scheduling)
            (self._logprobs[rid].extend if isinstance(lp, list) else self._logprobs[rid].append)(lp)
        stopped = self._check_stop_strings(changed, before)
        if res.grammar_dead_ends:
            self._end_dead_grammars(set(res.grammar_dead_ends), changed)
        for r in changed:  # a stop among accepted drafts drops the tokens after it, and their logprobs
            lps = self._logprobs[r.request_id]
            del lps[r.num_output_tokens:]
        if self.runner_drafts:
            self._free.extend(r.request_id for r in changed if r.is_finished)
        elif self.proposer is not None:
            self._draft(out, res, changed)
        if self.role == "prefill":
            self._hand_off(changed)
        outputs = [self._output(r) for r in changed]
        t3 = time.perf_counter()
        s = self.stats
        s["steps"] += 1
        s["schedule_s"] += t1 - t0
        s["prepare_s"] += res.prepare_s
        s["model_s"] += res.model_s
        s["sample_s"] += res.sample_s
        s["mask_s"] += res.mask_s
        s["fill_s"] += res.fill_s
        s["update_s"] += t3 - t2
        s["tokens"] += out.num_scheduled_tokens
        s["draft_tokens"], s["accepted_tokens"] = self.scheduler.num_draft_tokens, self.scheduler.num_accepted_tokens
        s["drafted_at"], s["accepted_at"] = list(self.scheduler.drafted_at), list(self.scheduler.accepted_at)
        self.last_step = {"schedule_s": t1 - t0, "execute_s": t2 - t1, "prepare_s": res.prepare_s,
                          "model_s": res.model_s, "sample_s": res.sample_s, "update_s": t3 - t2,
                          "num_seqs": len(out.seqs), "num_tokens": out.num_scheduled_tokens, "stopped": stopped}
        s["device_busy_s"], s["device_gap_s"] = ex.busy_s, ex.gap_s
        if not self.scheduler.has_unfinished() and not ex.in_flight:
            ex.idle()
            if self.runner_drafts:  # no step to carry the frees: the step thread is idle, free them here
                self.runner.release(self._free)
                self._free = []
        for hook in self.step_hooks:
            hook(self)
        return outputs

    def _submit(self, out) -> None:
        if out.is_empty:
            return
        reqs = self.scheduler.requests
        if not self.runner_drafts:
            self.executor.submit(out, {s.request_id: reqs[s.request_id] for s in out.seqs})
            return
        # the step thread's drafter: the requests ended since, and the tokens of each request that was not in
        # the step before (all folded in by now; the step thread tracks the others itself)
        tokens = {s.request_id: list(reqs[s.request_id].all_token_ids) for s in out.seqs
                  if s.request_id not in self._submitted}
        self._submitted = {s.request_id for s in out.seqs}
        free, self._free = tuple(self._free), []
        self.executor.submit(out, {s.request_id: reqs[s.request_id] for s in out.seqs}, free=free, tokens=tokens)

    def _draft(self, out, res, changed: Sequence[Request]) -> None:
        """Drive the drafter (the order of :mod:`inferhal.core.spec.proposer`): accept, prefill every running
        request's exact positions of the step, free the finished, then drafts for the next step of every
        request that got tokens and decodes on, capped so no draft lies past ``max_tokens`` or
        ``max_model_len`` (the verifier's own token always comes on top). No drafts while
        ``spec.disable_by_batch_size`` or more requests run: verifying drafts costs rows, and on a busy
        batch (compute-bound products) more than the accepted tokens give back."""
        prop, reqs = self.proposer, self.scheduler.requests
        seqs, row = [], 0
        for s in out.seqs:
            r = reqs.get(s.request_id)
            if s.spec_token_ids and r is not None:
                known = s.num_new - len(s.spec_token_ids)
                prop.accept(s.request_id, len(s.spec_token_ids), r.num_computed_tokens - s.num_computed - known)
            if r is not None and not r.is_finished and r.num_computed_tokens > s.num_computed:
                seqs.append(StepSeq(s.request_id, s.num_computed, r.num_computed_tokens - s.num_computed, row,
                                    r.all_token_ids, self.kv_manager.block_ids(s.request_id)))
            row += s.num_new
        for r in changed:
            if r.is_finished:
                prop.free(r.request_id)
        prop.prefill(TargetStep(tuple(seqs), res.hidden, self.kv_storage))
        if self.spec_off_at and len(self.scheduler.running) >= self.spec_off_at:
            return
        wants = []
        for r in changed:
            if r.is_finished or r.num_tokens - r.num_computed_tokens != 1:
                continue
            left = min(r.params.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens)
            wants.append(DraftWant(r.request_id, r.all_token_ids, left - 1, self.kv_manager.block_ids(r.request_id)))
        for rid, drafts in prop.propose(wants, self.kv_storage).items():
            reqs[rid].spec_token_ids = list(drafts)

    def _end_dead_grammars(self, dead: set[str], changed: Sequence[Request]) -> None:
        """Finish the requests whose grammar allowed no token this step with the reason ``grammar_dead_end``
        (the end-of-sequence token they were let through ends them as ``stop`` otherwise, or not at all with
        ``ignore_eos``): the output is as far as the constraint could go, which a user must be told."""
        live = []
        for r in changed:
            if r.request_id not in dead:
                continue
            if not r.is_finished:
                live.append(r.request_id)
            elif r.finish_reason == "stop":
                r.finish_reason = "grammar_dead_end"
        if live:  # (their drafter state is freed by _draft with every finished request of the step)
            self.scheduler.finish(live, "grammar_dead_end")

    def _check_stop_strings(self, changed: Sequence[Request], before: dict[str, int]) -> int:
        """Finish the requests whose text now holds a stop string, cutting this step's tokens (accepted
        drafts among them) right after the first token whose text holds it, as decoding one token a step
        would have."""
        ids = []
        for r in changed:
            if r.params.stop and not r.is_finished and self.tokenizer is not None:
                toks = r.output_token_ids
                if not any(s in self.tokenizer.decode(toks) for s in r.params.stop):
                    continue
                for n in range(before.get(r.request_id, len(toks) - 1) + 1, len(toks)):
                    if any(s in self.tokenizer.decode(toks[:n]) for s in r.params.stop):
                        del r.all_token_ids[r.num_prompt_tokens + n:]
                        break
                ids.append(r.request_id)
        if ids:  # (their drafter state is freed by _draft with every finished request of the step)
            self.scheduler.finish(ids, "stop")
        return len(ids)

    def _output(self, req: Request) -> RequestOutput:
        rid = req.request_id
        toks = req.output_token_ids
        text = ""
        if self.tokenizer is not None and (req.is_finished or self.stream_text):
            # the end-of-sequence token that stopped the request is not text (as vLLM returns it)
            eos_end = req.is_finished and bool(toks) and toks[-1] in req.eos_token_ids and not req.params.ignore_eos
            text = self.tokenizer.decode(toks[:-1] if eos_end else toks)
            if req.finish_reason == "stop" and req.params.stop:
                cut = min((text.find(s) for s in req.params.stop if s in text), default=-1)
                if cut >= 0:
                    text = text[:cut]
        prev = self._sent.get(rid, 0)
        prev_text = self._text.get(rid, "")
        new_text = text[len(prev_text):] if text.startswith(prev_text) else text
        self._sent[rid], self._text[rid] = len(toks), text
        lps = self._logprobs.get(rid, [])
        out = RequestOutput(rid, self._prompts.get(rid), list(req.prompt_token_ids),
                            [CompletionOutput(0, text, list(toks), req.finish_reason, list(lps))],
                            finished=req.is_finished, num_cached_tokens=req.num_cached_tokens,
                            num_preemptions=req.num_preemptions, new_token_ids=list(toks[prev:]), new_text=new_text,
                            num_replayed_tokens=req.num_replayed_tokens, num_draft_tokens=req.num_draft_tokens,
                            num_accepted_tokens=req.num_accepted_tokens)
        if req.is_finished:
            for d in (self._prompts, self._logprobs, self._sent, self._text):
                d.pop(rid, None)
        return out
