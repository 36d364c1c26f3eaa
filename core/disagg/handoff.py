"""Moving one request from a prefill engine to a decode engine: what is described at handshake, what is
sent, and how the decode side adopts it.

After the prefill engine samples a request's first token, it has computed positions ``[0, P)`` (``P`` =
the prompt). :func:`export_request` packs, per KV group, the logical blocks the decode step at position
``P`` reads: every block for full and compressed groups, and for a sliding group only its window's
(``first_live_block(P)`` on): the bounded window, so a long prompt moves its compressed KV and one
window, never its whole window history. :func:`import_request` allocates the same logical blocks on the
decode side (``allocate(P, 0)``), writes them, and hands the scheduler a running request whose next step
decodes position ``P``, with its sampling state (seeded generator, logprobs of the first token).

:class:`PrefillSide` and :class:`DecodeSide` are the two engines' KV transfers (the engine's
:class:`~inferhal.core.engine.transfer.KVTransfer`): the engine calls them and imports nothing of this package.

Both sides describe themselves at handshake (:func:`describe`: model, block size, and every KV group's
kind, layers, slot shape, dtype and record format); :func:`check_compatible` refuses a mismatch naming it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Mapping, Sequence

import torch

from inferhal.core.disagg.connector import KVPayload
from inferhal.core.errors import UserError
from inferhal.core.paging.kv_manager import blocks_needed, first_live_block
from inferhal.core.sampling.params import SamplingParams
from inferhal.core.scheduler.scheduler import NoRoomNow, RequestError


def describe(engine: Any) -> dict[str, Any]:
    """What a peer must share for blocks to mean the same on both sides."""
    groups = [{"name": s.name, "kind": s.kind, "layers": list(s.layers), "slot_shape": list(s.slot_shape),
               "dtype": str(s.dtype).replace("torch.", ""), "tokens_per_slot": s.tokens_per_slot,
               "window": s.window, "record": getattr(s, "record", None)} for s in engine.specs]
    return {"model": engine.loaded.name, "vocab_size": int(engine.model.vocab_size),
            "block_size": int(engine.kv_manager.block_size), "kv_groups": groups}


def check_compatible(local: Mapping[str, Any], peer: Mapping[str, Any], me: str = "decode",
                     them: str = "prefill") -> None:
    """Raise :class:`UserError` naming the first difference between two instances' descriptions."""
    for key, field in (("model", "model"), ("vocab_size", "model vocabulary"), ("block_size", "cache.block_size")):
        if local[key] != peer[key]:
            raise UserError(f"the {them} instance's {field} is {peer[key]!r} and this {me} instance's is "
                            f"{local[key]!r}: KV blocks cannot move between them")
    mine, theirs = {g["name"]: g for g in local["kv_groups"]}, {g["name"]: g for g in peer["kv_groups"]}
    if mine.keys() != theirs.keys():
        only_me, only_them = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
        raise UserError(f"KV groups differ: this {me} instance has {only_me or 'none'} that the {them} instance "
                        f"lacks, it has {only_them or 'none'} that this one lacks (same model, cache.kv_dtype and "
                        f"spec.method on both sides)")
    for name, g in mine.items():
        for k, v in g.items():
            if theirs[name][k] != v:
                raise UserError(f"KV group {name!r}: the {them} instance's {k} is {theirs[name][k]!r}, this {me} "
                                f"instance's is {v!r} (cache.kv_dtype and the model must match)")


def window_blocks(spec: Any, block_size: int, num_computed: int) -> tuple[int, int]:
    """Logical blocks ``[first, end)`` of ``spec`` that a decode at position ``num_computed`` reads."""
    return first_live_block(spec, block_size, num_computed), blocks_needed(spec, block_size, num_computed)


def export_request(engine: Any, req: Any, logprobs: list | None = None) -> KVPayload:
    """Pack ``req`` (its first token sampled, positions ``[0, P)`` computed) for a decode instance."""
    p = req.num_computed_tokens
    bs = engine.kv_manager.block_size
    tables = engine.kv_manager.block_ids(req.request_id)
    blocks, first = {}, {}
    for s in engine.specs:
        lo, hi = window_blocks(s, bs, p)
        ids = list(tables[s.name][lo:hi])
        if len(ids) != hi - lo or min(ids, default=0) < 0:
            raise RuntimeError(f"request {req.request_id!r}: KV group {s.name!r} lacks logical blocks {lo}..{hi - 1}")
        idx = torch.tensor(ids, dtype=torch.long)
        per_layer = [engine.kv_storage.layer_cache(s.name, layer)[idx.to(engine.kv_storage.layer_cache(
            s.name, layer).device)].cpu() for layer in s.layers]
        blocks[s.name] = torch.stack(per_layer) if per_layer else torch.empty(0)
        first[s.name] = lo
    gen = req.generator.get_state() if req.generator is not None else None
    state = {"request_id": req.request_id, "prompt_token_ids": list(req.prompt_token_ids),
             "output_token_ids": list(req.output_token_ids), "num_computed": p,
             "params": {f.name: getattr(req.params, f.name) for f in dataclasses.fields(req.params)}, "generator": gen, "logprobs": list(logprobs or []),
             "extra_keys": list(req.extra_keys)}
    return KVPayload(state, blocks, first)


def import_request(engine: Any, payload: KVPayload) -> str:
    """Adopt a transferred request: its blocks allocated and written, running, decoding position ``P`` next.
    A request the pool cannot hold now raises :class:`~inferhal.core.scheduler.scheduler.RequestError`."""
    st = payload.state
    params = SamplingParams(**st["params"])
    req = engine.make_request(st["prompt_token_ids"], params, st["request_id"], tuple(st["extra_keys"]))
    outs = list(st["output_token_ids"])
    req.all_token_ids.extend(outs)
    if req.grammar is not None:
        for t in outs:
            req.grammar.accept(int(t))
    p = int(st["num_computed"])
    bs = engine.kv_manager.block_size
    engine.scheduler.adopt(req, p)
    tables = engine.kv_manager.block_ids(req.request_id)
    for s in engine.specs:
        lo, hi = window_blocks(s, bs, p)
        if payload.first_block[s.name] != lo or payload.blocks[s.name].shape[1] != hi - lo:
            engine.scheduler.finish([req.request_id], "abort")
            raise ValueError(f"request {req.request_id!r}: KV group {s.name!r} came as blocks "
                             f"{payload.first_block[s.name]}+{payload.blocks[s.name].shape[1]}, expected {lo}..{hi - 1}")
        idx = torch.tensor(tables[s.name][lo:hi], dtype=torch.long)
        for i, layer in enumerate(s.layers):
            cache = engine.kv_storage.layer_cache(s.name, layer)
            cache[idx.to(cache.device)] = payload.blocks[s.name][i].to(cache.device, cache.dtype)
    if req.params.temperature > 0:  # the prefill side's generator, where it sent one
        req.generator = torch.Generator(device=engine.device)
        if st.get("generator") is not None:
            req.generator.set_state(st["generator"])
        else:
            req.generator.manual_seed(int(params.seed if params.seed is not None else engine.seed))
    engine.outputs.track(req.request_id, None, st.get("logprobs") or [], sent=req.num_output_tokens)  # streamed there
    return req.request_id


class PrefillSide:
    """A prefill engine's :class:`~inferhal.core.engine.transfer.KVTransfer`: each request that got its first
    token is exported (:meth:`take` hands the payloads to a connector) and finished there as ``transferred``,
    except those in :attr:`keep_local` (a hand-off failed: decoded here all the same)."""

    role = "prefill"

    def __init__(self) -> None:
        self.engine: Any = None
        self.keep_local: set[str] = set()
        self._handoffs: list[KVPayload] = []

    def bind(self, engine: Any) -> None:
        if engine.executor.asynchronous:
            raise UserError("parallel.role=prefill runs with scheduler.async_scheduling=false (a request's KV is "
                            "read for its hand-off right after the step that sampled its first token)")
        self.engine = engine

    def before_step(self) -> None:
        pass

    def after_update(self, changed: Sequence[Any]) -> None:
        e = self.engine
        for r in changed:
            if r.is_finished:
                self.keep_local.discard(r.request_id)
            if r.is_finished or r.num_output_tokens < 1 or r.request_id in self.keep_local:
                continue
            self._handoffs.append(export_request(e, r, e.outputs.logprobs(r.request_id)))
            if e.proposer is not None:
                e.proposer.free(r.request_id)
            e.scheduler.finish([r.request_id], "transferred")

    def abort(self, request_ids: Sequence[str]) -> None:
        """Requests exported but not yet taken are dropped: nothing of them reaches a decode instance."""
        gone = set(request_ids)
        self._handoffs = [p for p in self._handoffs if str(p.state["request_id"]) not in gone]

    def pending(self) -> Sequence[str]:
        return ()

    def take(self) -> list[KVPayload]:
        """The requests handed off since the last call, for a connector to send to a decode instance."""
        out, self._handoffs = self._handoffs, []
        return out


class DecodeSide:
    """A decode engine's :class:`~inferhal.core.engine.transfer.KVTransfer`: :meth:`add` adopts a request
    prefilled elsewhere, at once or at the first step where a sequence slot and its blocks are free (it waits
    here, in arrival order)."""

    role = "decode"

    def __init__(self) -> None:
        self.engine: Any = None
        self._waiting: collections.deque = collections.deque()

    def bind(self, engine: Any) -> None:
        self.engine = engine

    def add(self, payload: KVPayload) -> str:
        """Adopt ``payload``'s request (→ its id); one this engine can never run raises
        :class:`~inferhal.core.scheduler.scheduler.RequestError` (nothing changed)."""
        st = payload.state
        rid = str(st["request_id"])
        if self._waiting or not self._try(payload):
            if any(str(p.state["request_id"]) == rid for p in self._waiting):
                raise RequestError(f"request id {rid!r} is already in use")
            self.engine.make_request(st["prompt_token_ids"], SamplingParams(**st["params"]), rid)  # checks, or raises
            self.engine.discard(rid)
            self._waiting.append(payload)
        return rid

    def _try(self, payload: KVPayload) -> bool:
        try:
            import_request(self.engine, payload)
        except NoRoomNow:
            self.engine.discard(str(payload.state["request_id"]))
            return False
        return True

    def before_step(self) -> None:
        while self._waiting and self._try(self._waiting[0]):
            self._waiting.popleft()

    def after_update(self, changed: Sequence[Any]) -> None:
        pass

    def abort(self, request_ids: Sequence[str]) -> None:
        gone = set(request_ids)
        self._waiting = collections.deque(p for p in self._waiting if str(p.state["request_id"]) not in gone)

    def pending(self) -> list[str]:
        """The ids of requests handed here still waiting for room."""
        return [str(p.state["request_id"]) for p in self._waiting]


SIDES = {"prefill": PrefillSide, "decode": DecodeSide}


def side(role: str) -> Any:
    """A new KV transfer for an engine of ``role`` (prefill | decode)."""
    if role not in SIDES:
        raise UserError(f"parallel.role must be one of {', '.join(SIDES)} for an instance's engine, got {role!r}")
    return SIDES[role]()
