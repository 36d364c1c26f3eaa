"""The engine: ``step()`` = schedule → execute → update, over collaborators built once, each configured by its
constructor.

- :class:`~inferhal.core.engine.intake.Intake`: a prompt and its settings → a checked request (tokenised,
  grammar compiled); bad input raises for that request only, before it touches any state
  (:class:`~inferhal.core.scheduler.scheduler.RequestError` or
  :class:`~inferhal.core.sampling.params.SamplingParamsError`, both ``ValueError`` and ``UserError``).
- :class:`~inferhal.core.scheduler.scheduler.Scheduler`: what runs next, and (through its
  :class:`~inferhal.core.scheduler.stopping.StopChecker`) when each request ends.
- :class:`~inferhal.core.engine.executor.StepExecutor` over the
  :class:`~inferhal.core.engine.runner.ModelRunner`: the step, inline or on a worker thread
  (``scheduler.async_scheduling``).
- :class:`~inferhal.core.engine.outputs.OutputProcessor`: text, logprobs and streaming deltas.
- :class:`~inferhal.core.engine.drafting.Drafting`: the drafter (``spec.method``) between steps.
- a :class:`~inferhal.core.engine.transfer.KVTransfer` (prefill/decode disaggregation, core/disagg).

Construct it from a prebuilt :class:`~inferhal.core.models.base.LoadedModel` and an
:class:`~inferhal.core.registry.ActiveBackend` (what tests and other helpers do), or through
:class:`~inferhal.core.engine.llm.LLM`, which composes the config and loads the model.
"""

from __future__ import annotations

import time
from typing import Any, Hashable, Iterable, Optional

import torch

from inferhal.core.config.schema import CacheConfig, SchedulerConfig, SpecConfig
from inferhal.core.engine import kv_tiers
from inferhal.core.engine.drafting import Drafting
from inferhal.core.engine.executor import StepExecutor
from inferhal.core.engine.intake import Intake, Prompt
from inferhal.core.engine.outputs import OutputProcessor, RequestOutput
from inferhal.core.engine.runner import ModelRunner
from inferhal.core.engine.stats import new_stats, record_step
from inferhal.core.engine.transfer import KVTransfer
from inferhal.core.errors import UserError
from inferhal.core.models.base import LoadedModel
from inferhal.core.paging import formats, planning
from inferhal.core.paging.kv_manager import KVCacheManager
from inferhal.core.sampling.params import SamplingParams
from inferhal.core.scheduler.request import Request
from inferhal.core.scheduler.scheduler import Scheduler
from inferhal.core.scheduler.stopping import StopChecker
from inferhal.core.spec.proposer import DraftContext, make_proposer

__all__ = ["Engine", "Prompt", "plan_num_blocks"]


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
                                      scheduler.max_num_batched_tokens, max_model_len, cache.retain_windows)


class Engine:
    def __init__(self, loaded: LoadedModel, backend: Any, scheduler: SchedulerConfig | None = None,
                 cache: CacheConfig | None = None, max_model_len: Optional[int] = None, seed: int = 0,
                 spec: SpecConfig | None = None, deterministic: bool = False,
                 transfer: KVTransfer | None = None) -> None:
        scheduler, cache, spec = scheduler or SchedulerConfig(), cache or CacheConfig(), spec or SpecConfig()
        self.loaded, self.backend = loaded, backend
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.max_model_len = int(self.model.max_model_len if max_model_len is None else max_model_len)
        if self.max_model_len < 2:  # also refused at compose (config/refusals.py: RANGES)
            raise UserError(f"model.max_model_len must be >= 2 (one prompt token and one generated token), "
                            f"got {self.max_model_len}")
        # the model stores its KV as cache.kv_dtype (FP8/FP4 records refused where the backend cannot read them)
        formats.apply_kv_dtype(self.model, getattr(backend, "name", "?"), getattr(backend, "profile", None),
                               cache.kv_dtype)
        bs, torch_device = cache.block_size, getattr(backend.device, "torch_device", "cpu")
        self.device = torch.device(torch_device)
        # the drafter (spec.method; None: no drafts), its own KV groups beside the model's
        self.spec_method = spec.method
        prop = self.proposer = make_proposer(spec, DraftContext(self.model, loaded.name, bs, torch_device,
                                                                self.max_model_len))
        self.specs = tuple(self.model.kv_groups()) + tuple(prop.kv_groups() if prop else ())
        need = planning.compatible_block_size(self.specs, bs)
        if need != bs:
            raise UserError(f"cache.block_size={bs} is not a multiple of every KV group's tokens_per_slot; "
                            f"use cache.block_size={need}")
        num_blocks = plan_num_blocks(self.specs, bs, cache, backend.device, scheduler, self.max_model_len)
        planning.check_budget(self.specs, bs, num_blocks)
        keep = kv_tiers.keep_blocks(self.specs, bs, cache)
        self.kv_manager = KVCacheManager(self.specs, bs, num_blocks, cache.enable_prefix_caching, keep)
        self.kv_storage = backend.kv_storage(planning.storage_request(self.specs, bs, num_blocks))
        # tiers behind the prefix cache and KV events (cache.host_tier_bytes, disk_tier_*, kv_events_*)
        self.kv_offload, self.kv_events = kv_tiers.attach(self.kv_manager, loaded, backend, self.kv_storage, cache,
                                                       eager=not scheduler.async_scheduling)
        # asynchronous scheduling with a drafter: the drafter runs on the step thread (it needs the step in
        # flight's tokens), and the host schedules placeholders for its drafts (see core/engine/runner.py)
        on_step_thread = scheduler.async_scheduling and prop is not None
        off_at = spec.disable_by_batch_size or None  # running requests at which drafting pauses
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        self.scheduler = Scheduler(
            scheduler, self.kv_manager, self.max_model_len, stop=StopChecker(self.max_model_len, decode),
            num_lookahead_tokens=prop.num_lookahead_tokens if prop else 0,
            trim_prefix_hit=prop.reads_next_token if prop else False,
            num_placeholder_drafts=prop.num_speculative_tokens if on_step_thread else 0,
            spec_off_at=off_at if on_step_thread else None)
        graphs = self._decode_graphs(backend, prop)
        if graphs is not None and hasattr(prop, "graphs"):  # MTP's forward: a graph too
            from inferhal.core.spec.mtp_graph import MtpDraftGraphs

            prop.graphs = MtpDraftGraphs(prop, graphs, self.max_model_len)
        self.runner = ModelRunner(self.model, backend.ops, self.kv_storage, self.specs, bs, self.device,
                                  eos_token_ids=self.eos_token_ids, graphs=graphs,
                                  keep_hidden=prop.needs_hidden if prop else False,
                                  proposer=prop if on_step_thread else None, max_model_len=self.max_model_len)
        self.executor = StepExecutor(kv_tiers.StepCopies(self.runner, self.kv_offload) if self.kv_offload else self.runner,
                                     scheduler.async_scheduling)
        self.drafting = None if prop is None else Drafting(prop, self.kv_manager, self.kv_storage, self.max_model_len,
                                                           off_at, on_step_thread, self.runner)
        self.intake = Intake(self.model, self.tokenizer, self.scheduler, self.eos_token_ids)
        self.encode, self.check_params, self.grammars = self.intake.encode, self.intake.check_params, self.intake.grammars
        self.outputs = OutputProcessor(self.tokenizer)
        self.seed = seed
        self.deterministic = deterministic  # unseeded sampled requests all draw from `seed` (not their arrival)
        # called as hook(engine) at the end of every step(), in order (e.g. core/parallel's EP rank sync
        # and EPLB rebalance); an exception from a hook propagates out of step()
        self.step_hooks: list = []
        self.stats = new_stats()
        self.last_step: dict = {}
        self.transfer = transfer
        self._early: list[RequestOutput] = []  # outputs of steps folded in outside step() (add: a reused id)
        if transfer is not None:
            kv_tiers.check_transfer(transfer, self.kv_offload, scheduler.async_scheduling)
            transfer.bind(self)

    def _decode_graphs(self, backend: Any, prop: Any = None) -> Any:
        """Decode steps through the backend's graph runner with ``backend.graphs=true`` (refused where the
        backend has none), or None: graphs are off. With a drafter (``prop``) its ``1 + k``-token verification
        steps replay too, with the hidden states as an output when it reads them."""
        from inferhal.core.engine.graphs import DecodeGraphs, check_config

        cfg = getattr(backend, "config", None)
        if cfg is None:
            return None
        runner = backend.graph_runner() if cfg.graphs and hasattr(backend, "graph_runner") else None
        sizes = check_config(cfg, runner, getattr(backend, "profile", None))
        if sizes is None:
            return None
        return DecodeGraphs(runner, self.model, self.specs, self.kv_manager.block_size, self.max_model_len, sizes,
                            self.kv_storage, self.device, num_drafts=prop.num_speculative_tokens if prop else 0,
                            hidden=bool(prop and prop.needs_hidden))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(getattr(self.tokenizer, "eos_token_ids", ()) or ()) if self.tokenizer else ()

    @property
    def stream_text(self) -> bool:
        """Decode text on every step (streaming) or only when a request finishes."""
        return self.outputs.stream_text

    @stream_text.setter
    def stream_text(self, on: bool) -> None:
        self.outputs.stream_text = bool(on)

    # ------------------------------------------------------------------ requests

    def make_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                     extra_keys: tuple[Hashable, ...] = ()) -> Request:
        """Build and validate a request without adding it (raises RequestError / SamplingParamsError);
        :meth:`discard` forgets one that is never added."""
        req, text = self.intake.make_request(prompt, params, request_id, extra_keys)
        self.outputs.track(req.request_id, text)
        return req

    def discard(self, request_id: str) -> None:
        """Forget a request made by :meth:`make_request` but never added (e.g. one checked here and run
        elsewhere): nothing of it stays."""
        self.outputs.forget(str(request_id))

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                    extra_keys: tuple[Hashable, ...] = ()) -> str:
        return self.add(self.make_request(prompt, params, request_id, extra_keys))

    def add(self, req: Request) -> str:
        if self.executor.asynchronous and req.request_id in self.executor.pending_ids():
            self._fold_in_flight()  # an id reused at once: its last life's steps must not land in this one
        self.scheduler.add_request(req)
        if req.params.temperature > 0:
            seed = req.params.seed if req.params.seed is not None else (
                self.seed if self.deterministic else self.seed * 1_000_003 + req.arrival)
            req.generator = torch.Generator(device=self.device).manual_seed(int(seed))
        return req.request_id

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort these requests: running or waiting in the scheduler (their outputs, finish reason ``abort``),
        or held by the KV transfer (a hand-off still waiting for room: dropped before anything was allocated)."""
        request_ids = list(request_ids)
        if self.transfer is not None:
            self.transfer.abort(request_ids)
        done = self.scheduler.abort(request_ids)
        if self.drafting is not None:
            self.drafting.ended([r.request_id for r in done], bool(self.executor.in_flight))
        return [self.outputs.output(r) for r in done]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.transfer is not None and self.transfer.pending())

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One iteration; → an output for every request that received a token or finished. With
        ``scheduler.async_scheduling`` it schedules and submits step N+1, then folds in step N (one step
        late), so the device runs N+1 while the host updates N and schedules N+2."""
        t0 = time.perf_counter()
        early, self._early = self._early, []
        if self.transfer is not None:
            self.transfer.before_step()
        ex = self.executor
        if ex.asynchronous:
            if not ex.in_flight:  # prime the pipeline
                self._submit(self.scheduler.schedule())
            self._submit(self.scheduler.schedule())  # step N+1, while step N runs
            t1 = time.perf_counter()
            if not ex.in_flight:
                ex.idle()
                return early
            out, res = ex.result()
        else:
            out = self.scheduler.schedule()
            t1 = time.perf_counter()
            res = ex.run(out, self.scheduler.requests)
        return early + self._fold(out, res, t0, t1)

    def _fold_in_flight(self) -> None:
        """Fold in every step in flight now (asynchronous scheduling); their outputs come with the next step()."""
        while self.executor.in_flight:
            t0 = time.perf_counter()
            out, res = self.executor.result()
            self._early += self._fold(out, res, t0, t0)
        if self.drafting is not None:
            self.drafting.caught_up()

    def _fold(self, out, res, t0: float, t1: float) -> list[RequestOutput]:
        """Apply an executed step (scheduled ``t0..t1``): tokens, logprobs, drafts, hand-offs → the outputs."""
        ex = self.executor
        t2 = time.perf_counter()
        changed = self.scheduler.update(out, res.tokens, res.drafts, res.grammar_dead_ends)
        self.outputs.record(res.logprobs)
        if self.drafting is not None:
            self.drafting.after_update(out, res.hidden, changed, self.scheduler.requests, len(self.scheduler.running))
        if self.transfer is not None:
            self.transfer.after_update(changed)
        outputs = [self.outputs.output(r) for r in changed]
        self.last_step = record_step(self.stats, out, res, self.scheduler, ex, t0, t1, t2, time.perf_counter())
        if not self.scheduler.has_unfinished() and not ex.in_flight:
            ex.idle()
            if self.kv_offload is not None:  # nothing in flight: the queued tier copies run now
                self.kv_offload.idle()
            if self.drafting is not None:  # no step to carry the frees: the step thread is idle, free them here
                self.drafting.release()
        for hook in self.step_hooks:
            hook(self)
        return outputs

    def _submit(self, out) -> None:
        if out.is_empty:
            return
        reqs = {s.request_id: self.scheduler.requests[s.request_id] for s in out.seqs}
        extra = self.drafting.submit_extra(out, reqs) if self.drafting is not None else {}
        if self.kv_offload is not None:  # the tier copies queued since the last step, run before this one
            extra["kv_copies"] = self.kv_offload.take()
        self.executor.submit(out, reqs, **extra)
