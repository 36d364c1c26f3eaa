"""One launch with both roles (``inferhal serve parallel.role=pd``): this process prefills and routes, a
spawned process decodes.

:class:`DisaggregatedEngine` stands where the server's engine stands (:class:`~inferhal.core.server.
async_engine.AsyncEngine` drives it from its loop thread): requests go to the prefill engine; each one that
samples its first token is handed to the decode process through the backend's KV connector
(``inferhal_kv_connector``; torch.distributed point-to-point by default, a 2-rank gloo group on the host),
and the decode process sends its outputs back on a queue. The first token streams from here, the rest
from the decode process.

Faults: a decode process that dies (or never starts) is noticed at the next step. Every request it held
is prefilled again here, from its prompt and the tokens it already streamed, and decoded here (this
process turns colocated); its stream goes on where it stopped, with nothing repeated or lost. The decode
process's blocks die with it, and the prefill side freed each request's blocks when it handed it off, so
no block leaks on either side. A prefill failure is this process's, and fails the server as any engine
error does.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Iterable, Sequence

from inferhal.core.errors import UserError

log = logging.getLogger("inferhal.disagg")


def decode_worker(cfg_dict: dict, port: int, ctl: Any, out: Any) -> None:
    """The decode process: load the model, join the 2-rank group, adopt transfers, step, send outputs."""
    try:
        import torch
        from omegaconf import OmegaConf

        from inferhal.core.backend import ParallelLayout
        from inferhal.core.disagg.handoff import check_compatible, describe
        from inferhal.core.engine.engine import Engine
        from inferhal.core.engine.llm import LLM, _to
        from inferhal.core.config import schema

        cfg = OmegaConf.create(cfg_dict)
        llm = LLM.from_config(cfg)
        e = llm.engine
        eng = Engine(e.loaded, e.backend, e.scheduler.cfg, _to(schema.CacheConfig, cfg.cache), e.max_model_len,
                     seed=int(cfg.seed), role="decode")
        del llm, e
        out.put(("ready", None))
        eng.backend.communicator(ParallelLayout(world_size=2, rank=1, master_port=port))
        conn = eng.backend.kv_connector(0)
        check_compatible(describe(eng), conn.handshake(describe(eng)), me="decode", them="prefill")
    except BaseException as exc:  # noqa: BLE001 - said to the front, which fails with it
        out.put(("error", f"{type(exc).__name__}: {exc}"))
        return
    inbox: "queue.Queue" = queue.Queue()

    def receive() -> None:
        while True:
            try:
                payload = conn.recv()
            except Exception as exc:  # noqa: BLE001 - the front is gone
                inbox.put(("gone", str(exc)))
                return
            inbox.put(("kv", payload))

    threading.Thread(target=receive, name="inferhal-kv-recv", daemon=True).start()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    while True:
        try:
            kind, arg = inbox.get(timeout=0.005 if eng.has_unfinished() else 0.2)
            if kind == "gone":
                return
            try:
                eng.add_transferred(arg)
            except UserError as exc:
                out.put(("failed", (arg.state["request_id"], str(exc))))
            continue
        except queue.Empty:
            pass
        try:
            while True:
                cmd, rid = ctl.get_nowait()
                if cmd == "stop":
                    return
                outs = eng.abort([rid])
                if outs:
                    out.put(("outputs", outs))
        except queue.Empty:
            pass
        if eng.has_unfinished():
            outs = eng.step()
            if outs:
                out.put(("outputs", outs))


class DisaggregatedEngine:
    """The prefill engine of this process plus the decode process, as one engine for the server."""

    def __init__(self, prefill: Any, cfg: Any, start_timeout_s: float = 600.0) -> None:
        import multiprocessing as mp

        from omegaconf import OmegaConf

        from inferhal.core.backend import ParallelLayout
        from inferhal.core.disagg.handoff import check_compatible, describe
        from inferhal.core.parallel.launch import free_port

        if prefill.role != "prefill":
            raise ValueError("DisaggregatedEngine needs an Engine(role='prefill')")
        self.prefill = prefill
        ctx = mp.get_context("spawn")
        self._ctl, self._out = ctx.Queue(), ctx.Queue()
        port = free_port()
        d = OmegaConf.to_container(cfg, resolve=True)
        d["parallel"]["role"] = "any"  # the worker's own config: a plain engine, made a decode engine there
        self.process = ctx.Process(target=decode_worker, args=(d, port, self._ctl, self._out), daemon=True,
                                   name="inferhal-decode")
        self.process.start()
        deadline = time.monotonic() + start_timeout_s
        while True:  # the worker loads its model first; a failure there is said, not waited out
            try:
                kind, msg = self._out.get(timeout=0.5)
                break
            except queue.Empty:
                if not self.process.is_alive() or time.monotonic() > deadline:
                    raise UserError(f"the decode process did not start (exit code {self.process.exitcode})")
        if kind == "error":
            raise UserError(f"the decode process failed to start: {msg}")
        prefill.backend.communicator(ParallelLayout(world_size=2, rank=0, master_port=port))
        self.conn = prefill.backend.kv_connector(1)
        check_compatible(describe(prefill), self.conn.handshake(describe(prefill)), me="prefill", them="decode")
        self.failed_over: str | None = None  # why this process decodes by itself now
        self._remote: dict[str, dict] = {}  # request id -> prompt, params, the last output seen
        self._resumed: dict[str, Any] = {}  # request id -> the output it had streamed when its decode died

    # the server reads these of its engine
    def __getattr__(self, name: str) -> Any:
        return getattr(self.prefill, name)

    def make_request(self, *a, **k):
        return self.prefill.make_request(*a, **k)

    def add(self, req) -> str:
        return self.prefill.add(req)

    def has_unfinished(self) -> bool:
        return self.prefill.has_unfinished() or bool(self._remote)

    def abort(self, request_ids: Iterable[str]) -> list:
        ids = list(request_ids)
        outs = self.prefill.abort(ids)
        for rid in ids:
            rec = self._remote.pop(rid, None)
            if rec is None:
                continue
            if self.failed_over is None:
                self._ctl.put(("abort", rid))
            last = rec["last"]
            outs.append(dataclasses.replace(last, finished=True, new_token_ids=[], new_text="", outputs=[
                dataclasses.replace(last.outputs[0], finish_reason="abort")]))
        return [self._resume(o) for o in outs]

    def step(self) -> list:
        if self.failed_over is None and not self.process.is_alive():
            self._fail_over(f"the decode process exited (code {self.process.exitcode})")
        outs = []
        if self.prefill.has_unfinished():
            for o in self.prefill.step():
                if o.finished and o.outputs[0].finish_reason == "transferred":  # its stream goes on remotely
                    o = dataclasses.replace(o, finished=False, outputs=[dataclasses.replace(o.outputs[0],
                                                                                             finish_reason=None)])
                outs.append(self._resume(o))
            for payload in self.prefill.take_handoffs():
                rid = payload.state["request_id"]
                self._remote[rid] = {"prompt": list(payload.state["prompt_token_ids"]),
                                     "params": self.prefill_params(payload), "last": outs_for(outs, rid)}
                if self.failed_over is None:
                    try:
                        self.conn.send(payload)
                    except Exception as exc:  # noqa: BLE001 - the peer is gone: decode here
                        self._fail_over(f"sending request {rid!r} to the decode process failed: {exc}")
                if self.failed_over is not None:
                    self._take_back([rid])
        wait = 0.0 if self.prefill.has_unfinished() else 0.02
        while self.failed_over is None:
            try:
                kind, arg = self._out.get(timeout=wait) if wait else self._out.get_nowait()
            except queue.Empty:
                break
            wait = 0.0
            if kind == "failed":
                rid, why = arg
                log.warning("the decode process refused request %s (%s): decoding it here", rid, why)
                self._take_back([rid])
                continue
            for o in arg:
                rec = self._remote.get(o.request_id)
                if rec is None:
                    continue  # aborted here meanwhile
                rec["last"] = o
                if o.finished:
                    del self._remote[o.request_id]
                outs.append(o)
        return outs

    @staticmethod
    def prefill_params(payload) -> Any:
        from inferhal.core.sampling.params import SamplingParams

        return SamplingParams(**payload.state["params"])

    # ------------------------------------------------------------------ faults

    def _fail_over(self, why: str) -> None:
        log.error("%s: %d request(s) are prefilled again here and decoded here from now on", why, len(self._remote))
        self.failed_over = why
        self.prefill.role = "any"
        self._take_back(list(self._remote))

    def _take_back(self, ids: Sequence[str]) -> None:
        """Prefill each request again here from its prompt and what it streamed, to decode the rest here."""
        for rid in ids:
            rec = self._remote.pop(rid, None)
            if rec is None:
                continue
            last = rec["last"]
            done = list(last.outputs[0].token_ids) if last is not None else []
            params = dataclasses.replace(rec["params"], max_tokens=rec["params"].max_tokens - len(done))
            self.prefill.keep_local.add(rid)  # (a refusal by a live decode process: this one decodes here too)
            self._resumed[rid] = last
            self.prefill.add(self.prefill.make_request(rec["prompt"] + done, params, request_id=rid))

    def _resume(self, o: Any) -> Any:
        """A resumed request's output as its stream knows it: earlier tokens and logprobs before the new."""
        prev = self._resumed.get(o.request_id)
        if prev is None:
            return o
        if o.finished:
            del self._resumed[o.request_id]
        c, p = o.outputs[0], prev.outputs[0]
        comp = dataclasses.replace(c, token_ids=list(p.token_ids) + list(c.token_ids),
                                   logprobs=list(p.logprobs) + list(c.logprobs), text=p.text + c.text)
        return dataclasses.replace(o, prompt_token_ids=list(prev.prompt_token_ids), outputs=[comp])

    def close(self) -> None:
        if self.process.is_alive():
            self._ctl.put(("stop", None))
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()


def outs_for(outs: Sequence[Any], rid: str) -> Any:
    return next((o for o in reversed(outs) if o.request_id == rid), None)
