"""A prefill engine and a decode engine driven together, through a connector (in one process: the
loopback pair by default). Requests go to the prefill engine; each one that samples its first token is
sent to the decode engine, which decodes it to the end. Requests that end at their first token (EOS,
``max_tokens=1``, a stop string) finish on the prefill side.

:func:`generate` returns the final outputs in the prompts' order and, per transferred request, the KV
bytes moved and the seconds its send and receive took (on loopback, a copy)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

from inferhal.core.disagg.connector import LoopbackConnector
from inferhal.core.disagg.handoff import check_compatible, describe


@dataclass
class TransferStats:
    bytes: dict[str, int] = field(default_factory=dict)  # request id -> KV bytes moved
    seconds: dict[str, float] = field(default_factory=dict)  # request id -> send + receive
    by_group: dict[str, int] = field(default_factory=dict)  # KV group -> bytes moved, all requests
    cached: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens the prefill side had cached
    blocks: dict[str, dict[str, int]] = field(default_factory=dict)  # request id -> KV group -> blocks moved
    first_token_s: dict[str, float] = field(default_factory=dict)  # request id -> start of generate -> first token
    finish_s: dict[str, float] = field(default_factory=dict)  # request id -> start of generate -> last token


def connect(prefill: Any, decode: Any, pair: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
    """Handshake both ends (each checks the other's description; a mismatch raises UserError naming it)."""
    send, recv = pair or LoopbackConnector.pair()
    mine, theirs = describe(prefill), describe(decode)
    with ThreadPoolExecutor(1) as pool:  # both ends here: the decode end answers on its own thread
        answer = pool.submit(recv.handshake, theirs)
        got_decode = send.handshake(mine)
        got_prefill = answer.result()
    check_compatible(theirs, got_prefill, me="decode", them="prefill")
    check_compatible(mine, got_decode, me="prefill", them="decode")
    return send, recv


def generate(prefill: Any, decode: Any, prompts: Sequence[Any], params: Sequence[Any] | Any,
             pair: tuple[Any, Any] | None = None) -> tuple[list, TransferStats]:
    send, recv = connect(prefill, decode, pair)
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    t0 = time.perf_counter()
    ids = [prefill.add_request(p, sp) for p, sp in zip(prompts, params)]
    done: dict[str, Any] = {}
    stats = TransferStats()

    def seen(o) -> None:
        now = time.perf_counter() - t0
        if o.outputs[0].token_ids:
            stats.first_token_s.setdefault(o.request_id, now)
        if o.finished and o.outputs[0].finish_reason != "transferred":
            stats.finish_s[o.request_id] = now
            done[o.request_id] = o

    while prefill.has_unfinished() or decode.has_unfinished():
        if prefill.has_unfinished():
            for o in prefill.step():
                seen(o)
                if o.finished and o.outputs[0].finish_reason == "transferred":
                    stats.cached[o.request_id] = o.num_cached_tokens
            for payload in prefill.transfer.take():
                ts = time.perf_counter()
                send.send(payload)
                got = recv.recv(timeout=30.0)
                rid = decode.transfer.add(got)
                stats.seconds[rid] = time.perf_counter() - ts
                stats.bytes[rid] = got.nbytes
                stats.blocks[rid] = {g: int(t.shape[1]) if t.dim() > 1 else 0 for g, t in got.blocks.items()}
                for g, t in got.blocks.items():
                    stats.by_group[g] = stats.by_group.get(g, 0) + t.numel() * t.element_size()
        if decode.has_unfinished():
            for o in decode.step():
                seen(o)
    return [done[i] for i in ids], stats
